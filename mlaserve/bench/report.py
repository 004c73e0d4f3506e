"""The benchmark's results: JSON file (merged across runs into one --out), derived rates and ratios, table.

One row per (suite, shape, kv dtype, backend). Rates and ratios are derived from time, bytes and
FLOPs whenever the file is written, so that rows from separate invocations (one per suite on the
device) are compared with each other and with the latest measured limits.
"""

import json
import math
import os
import statistics
from pathlib import Path

SCHEMA = "mlaserve.bench.kernels/1"
JSON_NAME = "kernels.json"
PNG_NAME = "kernels.png"
OK_STATUSES = ("ok", "invalid")   # rows with a time


def row_id(row: dict) -> tuple:
    return (row["suite"], row["key"], row["kv"], row["backend"])


def load(path: Path) -> dict | None:
    """The results in `path`, or None when there are none (a file of another schema is an error, never ignored)."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path} has schema {data.get('schema')!r}, expected {SCHEMA!r}; use --fresh or another --out")
    return data


def merge(old: dict | None, new: dict) -> dict:
    """new's rows replace old rows with the same id; new's env, limits and backends win; notes accumulate."""
    if old is None:
        return new
    merged = dict(new)
    rows = {row_id(r): r for r in old["rows"]}
    rows.update({row_id(r): r for r in new["rows"]})
    merged["rows"] = list(rows.values())
    merged["backends"] = {**old.get("backends", {}), **new.get("backends", {})}
    merged["notes"] = list(dict.fromkeys(old.get("notes", []) + new.get("notes", [])))
    if new.get("limits", {}).get("copy_tbps") is None and old.get("limits", {}).get("copy_tbps") is not None:
        merged["limits"] = old["limits"]
    return merged


def derive(data: dict) -> dict:
    """Fill each timed row's rates, fractions of the limits, and ratios to the other backends of its shape."""
    limits = data.get("limits") or {}
    copy, peak = limits.get("copy_tbps"), limits.get("matmul_tflops")
    for row in data["rows"]:
        t = row.get("time_us")
        if row["status"] not in OK_STATUSES or not t:
            continue
        row["tbps"] = row["bytes"] / t / 1e6
        row["tflops"] = row["flops"] / t / 1e6
        if copy and peak:
            row["bw_frac"] = row["tbps"] / copy
            row["flop_frac"] = row["tflops"] / peak
            roof_us = max(row["bytes"] / copy / 1e6, row["flops"] / peak / 1e6)
            row["roofline_frac"] = roof_us / t
    by_shape: dict[tuple, list[dict]] = {}
    for row in data["rows"]:
        if row["status"] == "ok" and row.get("time_us"):
            by_shape.setdefault((row["suite"], row["key"]), []).append(row)
    for row in data["rows"]:
        row["vs"] = {}
        if row["status"] not in OK_STATUSES or not row.get("time_us"):
            continue
        for other in by_shape.get((row["suite"], row["key"]), []):
            if other is row:
                continue
            name = other["backend"] if other["kv"] == row["kv"] else f"{other['backend']}@{other['kv']}"
            row["vs"][name] = _ratio(other, row)   # > 1: this row is faster
    return data


def _ratio(other: dict, row: dict) -> float:
    """other's time / row's: the median of the per-round ratios where both were timed in the same interleaved
    rounds (same KV, as many rounds), which takes the clock's drift between rounds out; else of the medians."""
    a, b = other.get("time_rounds_us") or [], row.get("time_rounds_us") or []
    if other["kv"] == row["kv"] and a and len(a) == len(b) and all(b):
        return statistics.median(x / y for x, y in zip(a, b))
    return other["time_us"] / row["time_us"]


def _finite(value):
    """The same structure with NaN/inf floats as None: strict JSON has no NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write(data: dict, out_dir: Path) -> Path:
    """Atomically (a crash mid-write never leaves half a file) write kernels.json under out_dir."""
    path = out_dir / JSON_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_finite(derive(data)), indent=1, allow_nan=False))
    os.replace(tmp, path)
    return path


def _in_brief(row: dict) -> bool:
    """The headline shapes: dense fixed-length s_q 1, small batches, s_q 2 at h 128; all sparse and indexer."""
    shape = row.get("shape", {})
    if row["suite"] != "dense":
        return True
    return not shape.get("varlen") and (shape.get("s_q") == 1 or shape.get("h") == 128)


def table(data: dict, brief: bool = False, primary_order: tuple[str, ...] = ()) -> str:
    """One line per shape and kv dtype: the primary backend's time, TB/s, TFLOP/s and fraction of the roofline (on
    FP8 lines also its speed-up over its own bf16 time for the shape), then every other backend's time and (its
    time / primary's time: > 1 means the primary is faster)."""
    primary_order = primary_order or backend_order(data)
    groups: dict[tuple, list[dict]] = {}
    for row in data["rows"]:
        if brief and not _in_brief(row):
            continue
        groups.setdefault((row["suite"], row["key"], row["kv"]), []).append(row)
    limits = data.get("limits") or {}
    lines = []
    if limits.get("copy_tbps"):
        lines.append(f"limits: copy {limits['copy_tbps']:.2f} TB/s, bf16 matmul {limits['matmul_tflops']:.0f} TFLOP/s")
    else:
        lines.append(f"limits: {limits.get('note', 'not measured')}")
    lines.append("primary = first mlaserve kernel backend timed; others: µs (their time / primary's, the median of "
                 "the rounds' ratios; >1 = primary faster)")
    for (suite, key, kv), rows in groups.items():
        timed = [r for r in rows if r["status"] in OK_STATUSES and r.get("time_us")]
        prim = _primary(timed, primary_order)
        head = f"{suite:<7} {key:<44} {kv:<4}"
        if prim is None:
            reasons = "; ".join(f"{r['backend']}: {r['status']}" for r in rows)
            lines.append(f"{head} | {reasons[:120]}")
            continue
        cell = (f"{prim['backend']} {prim['time_us']:9.1f}us {prim.get('tbps', 0):5.2f}TB/s "
                f"{prim.get('tflops', 0):6.1f}TF")
        if "roofline_frac" in prim:
            cell += f" {100 * prim['roofline_frac']:3.0f}%roof"
        own_bf16 = prim.get("vs", {}).get(f"{prim['backend']}@bf16") if kv == "fp8" else None
        if own_bf16:
            cell += f" {own_bf16:.2f}x its bf16"      # the FP8 cache's speed-up over the same backend's bf16 cache
        if prim["status"] != "ok":
            cell += " INVALID"
        extra = prim.get("extra", {})
        if "scores_us" in extra:
            cell += f" (scores {extra['scores_us']:.1f} topk {extra['topk_us']:.1f})"
        others = []
        for r in rows:
            if r is prim:
                continue
            if r in timed:
                flag = "" if r["status"] == "ok" else "!"
                others.append(f"{r['backend']}{flag} {r['time_us']:.1f} ({r['time_us'] / prim['time_us']:.2f}x)")
            elif r["status"] == "error":
                others.append(f"{r['backend']} ERROR")
        lines.append(f"{head} | {cell}" + (" | " + " | ".join(others) if others else ""))
    bad = [r for r in data["rows"] if r["status"] in ("invalid", "error")]
    if bad:
        lines.append(f"{len(bad)} rows invalid or failed:")
        for r in bad[:15]:
            lines.append(f"  {r['suite']} {r['key']} {r['kv']} {r['backend']}: {r['status']}: "
                         f"{r.get('reason', '')[:150]}")
    return "\n".join(lines)


def backend_order(data: dict) -> tuple[str, ...]:
    """mlaserve's kernel backends first (the torch reference last among them), then the peers."""
    kinds = data.get("backends", {})
    names = sorted(kinds, key=lambda n: (kinds[n].get("kind") != "mlaserve", n == "torch", n))
    return tuple(names)


def _primary(timed: list[dict], order: tuple[str, ...]) -> dict | None:
    if not timed:
        return None
    rank = {name: i for i, name in enumerate(order)}
    return min(timed, key=lambda r: (rank.get(r["backend"], len(rank)), r["status"] != "ok"))
