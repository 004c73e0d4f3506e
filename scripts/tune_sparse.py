#!/usr/bin/env python3
"""Sweep the launch knobs of the Triton sparse MLA and DSA indexer kernels over the benchmark shapes (GPU).

    python3 scripts/tune_sparse.py --out tune_sparse.json [--budget-s 200] [--only sparse,indexer]

For each shape, in the order of the targets that matter most, it times candidate configs with
`triton.testing.do_bench` (median; do_bench flushes L2 before every run), checks every config's output
against the default config's (FlashMLA tolerances; indexer scores 1e-4) and the default against the torch
reference once, and prints one line per config as it goes. The JSON (GPU, versions, limits, every row,
the best config per shape) is rewritten after every shape, so a run cut short keeps what it measured.
The last lines printed are the `TUNED` tables to paste into kernels/triton/sparse_mla.py and indexer.py.

Shapes (DeepSeek-V3.2: d_qk 576, d_v 512, topk 2048, H_I 64, D_I 128, page 64):
  sparse prefill: one request of 4096 new tokens over a pool of 32768 (q [1, 4096, h, 576]), h 128 / 64, bf16
  sparse decode:  b 128 s_q 2 h 128 and b 64 s_q 1 h 64, each request its own pool of 32768, bf16 / FP8
  indexer:        decode b 128 x s_k 32768 (s_q 1); prefill 4096 x 32768; scoring and top-k timed apart
Rates: sparse FLOPs 2*tokens*h*topk*(576+512), bytes = gathered rows + q + out; indexer bytes = keys + scores.
"""

import argparse
import datetime
import importlib
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mlaserve import ops  # noqa: E402
from mlaserve.kernels import reference  # noqa: E402

sparse_mod = importlib.import_module("mlaserve.kernels.triton.sparse_mla")
indexer_mod = importlib.import_module("mlaserve.kernels.triton.indexer")

PAGE, TOPK, H_I, D_I = 64, 2048, 64, 128
SCALE = 192 ** -0.5
DEV = torch.device("cuda")
DTYPE = torch.bfloat16


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def bench_us(fn) -> float:
    return 1000.0 * triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def measure_limits() -> dict:
    """Device-to-device copy (read + written bytes) and a bf16 8192^3 matmul, measured now."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    copy_us = bench_us(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    mm_us = bench_us(lambda: a @ b)
    del src, dst, a, b
    return {"copy_tb_s": 2 * (1 << 30) / copy_us / 1e6, "matmul_tflop_s": 2 * 8192 ** 3 / mm_us / 1e6}


# -- sparse MLA --

@dataclass(frozen=True)
class SparseShape:
    name: str
    b: int
    s_q: int
    h: int
    s_kv: int
    kv: str          # "bf16" | "fp8"

    @property
    def tokens(self) -> int:
        return self.b * self.s_q

    def flops(self) -> float:
        return 2.0 * self.tokens * self.h * TOPK * (576 + 512)

    def bytes(self) -> float:
        row = 656 if self.kv == "fp8" else 1152
        return self.tokens * (TOPK * row + self.h * (576 + 512) * 2)


def make_sparse(shape: SparseShape):
    """q [b, s_q, h, 576] bf16, cache [pages, PAGE, 576|656], indices int32 [b, s_q, TOPK] (distinct, causal in prefill)."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    per_req = shape.s_kv // PAGE
    table = torch.randperm(shape.b * per_req, device=DEV, generator=gen).view(shape.b, per_req)
    noise = torch.rand(shape.b, shape.s_q, shape.s_kv, device=DEV, generator=gen)
    if shape.s_q > 2:
        last = shape.s_kv - shape.s_q + torch.arange(shape.s_q, device=DEV)
        noise.masked_fill_(torch.arange(shape.s_kv, device=DEV)[None, :] > last[:, None], -1.0)
    pos = noise.topk(TOPK, dim=-1).indices
    del noise
    pages = torch.gather(table, 1, (pos // PAGE).view(shape.b, -1)).view(pos.shape)
    indices = (pages * PAGE + pos % PAGE).to(torch.int32)
    rows = shape.b * shape.s_kv
    if shape.kv == "fp8":
        cache = torch.empty(rows, 656, dtype=torch.uint8, device=DEV)
        for start in range(0, rows, 1 << 19):
            n = min(1 << 19, rows - start)
            cache[start:start + n] = ops.quantize_kv_fp8(
                torch.randn(n, 576, device=DEV, generator=gen, dtype=DTYPE))
    else:
        cache = torch.randn(rows, 576, device=DEV, generator=gen, dtype=DTYPE)
    q = torch.randn(shape.b, shape.s_q, shape.h, 576, device=DEV, generator=gen, dtype=DTYPE)
    return q, cache.view(rows // PAGE, PAGE, -1), indices


def flashmla_close(out, ref) -> str | None:
    """None when out matches ref (1e-3 abs or 2/128 rel per element, cosine distance <= 1e-5), else why not."""
    out, ref = out.float(), ref.float()
    if out.isnan().any():
        return "NaN in output"
    err = (out - ref).abs()
    bad = int(((err > 1e-3) & (err > (2 / 128) * ref.abs())).sum())
    x, y = out.double().flatten(), ref.double().flatten()
    cos = float(1 - 2 * (x @ y) / (x @ x + y @ y).clamp_min(1e-30))
    if bad or cos > 1e-5:
        return f"{bad} elements off, cosine distance {cos:.2g}"
    return None


def sparse_candidates(shape: SparseShape, default: "sparse_mod.SparseMLAConfig") -> list[dict]:
    """Knob sets to try, most promising first; {} is the default config."""
    blocks = [{"block_n": bn, "num_stages": st} for bn, st in ((64, 3), (32, 3), (64, 2), (32, 2), (16, 3), (32, 4))]
    if shape.h <= 32:
        blocks += [{"block_h": 16}, {"block_h": 32, "num_warps": 4}]
    else:
        blocks += [{"block_h": 64, "block_n": 32, "num_warps": 4}]
    if shape.h >= 128:
        # all heads of a token in one program: each gathered row is loaded once, not once per 64 heads
        blocks += [{"block_h": 128, "block_n": 32, "num_warps": 16, "num_stages": 2},
                   {"block_h": 128, "block_n": 64, "num_warps": 16, "num_stages": 2}]
    same = lambda k: all(getattr(default, n) == v for n, v in k.items())  # noqa: E731
    return [{}] + [k for k in blocks if not same(k)]


def tune_sparse(shape: SparseShape, budget: Budget, seconds: float) -> dict:
    stop = time.monotonic() + seconds
    q, cache, indices = make_sparse(shape)
    default = sparse_mod.default_config(shape.tokens, shape.h, TOPK, shape.kv == "fp8", 512, DEV)
    rows, base = [], None

    def run(knobs: dict) -> dict:
        nonlocal base
        cfg = {**asdict(default), **knobs}
        row = {"config": cfg}
        try:
            out, _ = ops.sparse_mla(q, cache, indices, SCALE, head_dim_v=512, backend="triton", **cfg)
            if base is None:
                base = out
                n = min(shape.tokens, 64)
                sub = lambda t: t.reshape(shape.tokens, *t.shape[2:])[:n].unsqueeze(0)  # noqa: E731
                ref, _ = reference.sparse_mla(sub(q), cache, sub(indices), SCALE, head_dim_v=512)
                row["check"] = flashmla_close(sub(out), ref) or "ok vs torch reference"
            else:
                row["check"] = flashmla_close(out, base) or "ok vs default"
            us = bench_us(lambda: ops.sparse_mla(q, cache, indices, SCALE, head_dim_v=512, backend="triton", **cfg))
            row.update(us=us, tflop_s=shape.flops() / us / 1e6, tb_s=shape.bytes() / us / 1e6)
        except Exception as e:  # a config the GPU cannot run (shared memory, registers) is a result, not a stop
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print_row(shape.name, row)
        rows.append(row)
        return row

    for knobs in sparse_candidates(shape, default):
        if time.monotonic() > stop or budget.left() < 10:
            break
        run(knobs)
    ok = [r for r in rows if "us" in r and r["check"].startswith("ok")]
    if ok and shape.s_q <= 2:
        # decode: the split count on the best block config
        best = min(ok, key=lambda r: r["us"])["config"]
        for splits in (1, 2, 3, 4, 8):
            if splits != best["num_splits"] and time.monotonic() < stop and budget.left() > 10:
                run({**best, "num_splits": splits})
    ok = [r for r in rows if "us" in r and r["check"].startswith("ok")]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    del q, cache, indices, base
    torch.cuda.empty_cache()
    return {"shape": asdict(shape), "kind": "sparse", "default": rows[0] if rows else None, "best": best, "rows": rows}


# -- indexer --

@dataclass(frozen=True)
class IndexerShape:
    name: str
    b: int
    s_q: int
    s_k: int

    def key_bytes(self) -> float:
        return self.b * self.s_k * D_I * 2.0

    def bytes(self) -> float:
        return self.key_bytes() + self.b * self.s_q * self.s_k * 4.0

    def flops(self) -> float:
        return 2.0 * self.b * self.s_q * H_I * D_I * self.s_k


def make_indexer(shape: IndexerShape):
    gen = torch.Generator(device=DEV).manual_seed(1)
    per_req = shape.s_k // PAGE
    table = torch.randperm(shape.b * per_req, device=DEV, generator=gen).view(shape.b, per_req).to(torch.int32)
    k_cache = torch.randn(shape.b * per_req, PAGE, D_I, device=DEV, generator=gen, dtype=DTYPE)
    q = torch.randn(shape.b, shape.s_q, H_I, D_I, device=DEV, generator=gen, dtype=DTYPE)
    weights = torch.randn(shape.b, shape.s_q, H_I, device=DEV, generator=gen) * H_I ** -0.5
    seqlens = torch.full((shape.b,), shape.s_k, dtype=torch.int32, device=DEV)
    return q, weights, k_cache, table, seqlens


INDEXER_CANDIDATES = {
    "decode": [{}, {"block_n": 128}, {"block_n": 128, "num_warps": 8}, {"block_n": 64, "num_stages": 4},
               {"block_n": 256, "num_warps": 8}, {"block_n": 128, "num_stages": 2}, {"block_n": 32}],
    "prefill": [{}, {"block_t": 4}, {"block_t": 4, "num_warps": 8}, {"block_n": 128},
                {"block_n": 128, "block_t": 4, "num_warps": 8}, {"block_t": 1}, {"num_stages": 2}],
}
# radix select: larger chunks than 4096 x 16 warps spill registers on sm_90a (ptxas -v)
SELECT_CANDIDATES = [{"select": "torch"}, {"select": "triton", "block": 4096, "num_warps": 16},
                     {"select": "triton", "block": 2048, "num_warps": 8}, {"select": "triton", "block": 2048, "num_warps": 16},
                     {"select": "triton", "block": 4096, "num_warps": 8}, {"select": "triton", "block": 1024, "num_warps": 4}]


def tune_indexer(shape: IndexerShape, budget: Budget, seconds: float, limits: dict) -> dict:
    stop = time.monotonic() + seconds
    regime = "prefill" if shape.s_q > 8 else "decode"
    case = make_indexer(shape)
    rows, select_rows, base = [], [], None
    for knobs in INDEXER_CANDIDATES[regime]:
        if time.monotonic() > stop or budget.left() < 10:
            break
        cfg = asdict(indexer_mod.resolve_config(shape.b, shape.s_q, H_I, shape.s_k, DEV, **knobs))
        row = {"config": cfg}
        try:
            scores = indexer_mod.indexer_scores(*case, **cfg)
            if base is None:
                base = scores
                n = min(4, shape.s_q)
                ref = reference.indexer_scores(case[0][0, :n], case[1][0, :n],
                                               case[2].view(-1, D_I)[_slots(case[3][0], shape.s_k)])
                visible = torch.arange(shape.s_k, device=DEV)[None, :] \
                    <= shape.s_k - shape.s_q + torch.arange(n, device=DEV)[:, None]
                got = scores[0, :n]
                same = torch.equal(torch.isfinite(got), visible) and \
                    torch.allclose(got[visible], ref[visible], atol=1e-4, rtol=1e-4)
                row["check"] = "ok vs torch reference" if same else "scores differ from the torch reference"
            else:
                same = torch.allclose(scores, base, atol=1e-4, rtol=1e-4)
                row["check"] = "ok vs default" if same else "scores differ from the default config"
            del scores
            us = bench_us(lambda: indexer_mod.indexer_scores(*case, **cfg))
            row.update(us=us, tflop_s=shape.flops() / us / 1e6, tb_s=shape.bytes() / us / 1e6,
                       key_bw_vs_copy=shape.key_bytes() / us / 1e6 / limits.get("copy_tb_s", float("nan")))
        except Exception as e:  # recorded and printed: a config that cannot run is a result
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print_row(shape.name + " scores", row)
        rows.append(row)
    if base is not None:
        ref_top = indexer_mod.scores_to_slots(base, case[3], TOPK)
        for choice in SELECT_CANDIDATES:
            if time.monotonic() > stop or budget.left() < 10:
                break
            fn = indexer_mod._SELECTS[choice["select"]]
            kwargs = {k: v for k, v in choice.items() if k != "select"}
            row = {"config": choice}
            try:
                got = fn(base, case[3], TOPK, **kwargs)
                agree = _overlap(got, ref_top)
                row["check"] = f"ok, slot agreement with torch.topk {agree:.4f}" if agree > 0.99 else \
                    f"slot agreement with torch.topk only {agree:.4f}"
                row["us"] = bench_us(lambda: fn(base, case[3], TOPK, **kwargs))
            except Exception as e:  # recorded and printed, as above
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            print_row(shape.name + " top-k", row)
            select_rows.append(row)
    pick = lambda rs: min([r for r in rs if "us" in r and r["check"].startswith("ok")], key=lambda r: r["us"], default=None)  # noqa: E731
    result = {"shape": asdict(shape), "kind": "indexer", "regime": regime, "default": rows[0] if rows else None,
              "best": pick(rows), "rows": rows, "select_rows": select_rows, "best_select": pick(select_rows)}
    del case, base
    torch.cuda.empty_cache()
    return result


def _overlap(a, b) -> float:
    """Fraction of the entries of a [..., k] found in the same row of b [..., k] (int slot ids)."""
    b_sorted = b.sort(-1).values
    at = torch.searchsorted(b_sorted, a.contiguous()).clamp_max(b.shape[-1] - 1)
    return float((b_sorted.gather(-1, at) == a).float().mean())


def _slots(table_row, n):
    pos = torch.arange(n, device=DEV)
    return table_row[pos // PAGE].long() * PAGE + pos % PAGE


# -- reporting --

def print_row(name: str, row: dict) -> None:
    cfg = " ".join(f"{k}={v}" for k, v in row["config"].items() if v is not None)
    if "error" in row:
        print(f"{name:34s} {cfg:70s} ERROR {row['error']}", flush=True)
        return
    rate = f"{row['tflop_s']:7.1f} TFLOP/s {row['tb_s']:5.2f} TB/s" if "tflop_s" in row else " " * 28
    print(f"{name:34s} {cfg:70s} {row['us']:9.1f} us {rate}  {row['check']}", flush=True)


def tuned_tables(results: list[dict]) -> list[str]:
    sparse_keep = ("block_h", "block_n", "num_warps", "num_stages")
    index_keep = ("block_n", "block_t", "num_warps", "num_stages")
    sparse_t, index_t, select_t = {}, {}, {}
    for r in results:
        if r["kind"] == "sparse" and r["best"]:
            s = r["shape"]
            key = (s["kv"], "prefill" if s["b"] * s["s_q"] >= 1024 else "decode", s["h"])
            sparse_t.setdefault(key, {k: r["best"]["config"][k] for k in sparse_keep})
        if r["kind"] == "indexer":
            key = (r["regime"], H_I)
            if r["best"]:
                index_t[key] = {k: r["best"]["config"][k] for k in index_keep}
            if r["best_select"]:
                select_t[key] = r["best_select"]["config"]
    return [f"# kernels/triton/sparse_mla.py\nTUNED = {sparse_t!r}",
            f"# kernels/triton/indexer.py\nTUNED = {index_t!r}\nTUNED_SELECT = {select_t!r}"]


def _commit() -> str:
    """The commit the device copy was packed from (.peers/GIT_COMMIT, the device has no .git), else git's."""
    stamp = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".peers", "GIT_COMMIT")
    if os.path.exists(stamp):
        with open(stamp) as f:
            return f.read().strip()
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or f"unknown (git: {out.stderr.strip()[:80]})"
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({type(e).__name__})"


def default_tasks(parts: set[str]) -> list[tuple[float, object]]:
    """(share of the budget left, shape), most important first: the targets, then the rest."""
    tasks = []
    if "sparse" in parts:
        tasks += [(0.25, SparseShape("sparse prefill bf16 h128", 1, 4096, 128, 32768, "bf16")),
                  (0.25, SparseShape("sparse decode fp8 b128 s_q2 h128", 128, 2, 128, 32768, "fp8"))]
    if "indexer" in parts:
        tasks += [(0.35, IndexerShape("indexer decode b128 s_k32768", 128, 1, 32768))]
    if "sparse" in parts:
        tasks += [(0.3, SparseShape("sparse decode bf16 b128 s_q2 h128", 128, 2, 128, 32768, "bf16")),
                  (0.4, SparseShape("sparse decode fp8 b64 s_q1 h64", 64, 1, 64, 32768, "fp8")),
                  (0.4, SparseShape("sparse decode bf16 b64 s_q1 h64", 64, 1, 64, 32768, "bf16"))]
    if "indexer" in parts:
        tasks += [(0.6, IndexerShape("indexer prefill 4096 x s_k32768", 1, 4096, 32768))]
    if "sparse" in parts:
        tasks += [(1.0, SparseShape("sparse prefill bf16 h64", 1, 4096, 64, 32768, "bf16"))]
    return tasks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write (rewritten after every shape)")
    p.add_argument("--budget-s", type=float, default=float(os.environ.get("TUNE_SPARSE_BUDGET_S", 200)),
                   help="stop starting new configs after this many seconds (default: $TUNE_SPARSE_BUDGET_S or 200)")
    p.add_argument("--only", default="sparse,indexer", help="comma list of sparse,indexer")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_sparse.py needs a CUDA GPU", file=sys.stderr)
        return 2
    budget = Budget(args.budget_s)
    parts = set(args.only.split(","))
    commit = _commit()
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "commit": commit,
              "budget_s": args.budget_s, "results": []}
    report["limits"] = measure_limits()
    print(f"limits: copy {report['limits']['copy_tb_s']:.2f} TB/s, bf16 matmul "
          f"{report['limits']['matmul_tflop_s']:.0f} TFLOP/s", flush=True)

    tasks = default_tasks(parts)
    for weight, shape in tasks:
        if budget.left() < 15:
            print(f"{shape.name}: skipped, budget spent", flush=True)
            report["results"].append({"shape": asdict(shape), "skipped": "budget"})
            continue
        seconds = max(15.0, weight * budget.left())
        try:
            if isinstance(shape, SparseShape):
                result = tune_sparse(shape, budget, seconds)
            else:
                result = tune_indexer(shape, budget, seconds, report["limits"])
        except Exception as e:  # e.g. out of memory building the inputs: recorded, and the next shape still runs
            traceback.print_exc()
            result = {"shape": asdict(shape), "error": f"{type(e).__name__}: {e}"}
            torch.cuda.empty_cache()
        report["results"].append(result)
        report["tuned_tables"] = tuned_tables([r for r in report["results"] if "kind" in r])
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    print("\n== best per shape (vs default)")
    for r in report["results"]:
        if "kind" not in r:
            continue
        d, b = r["default"], r["best"]
        if b and d and "us" in d:
            print(f"  {r['shape']['name']:34s} default {d['us']:9.1f} us -> best {b['us']:9.1f} us "
                  f"({b.get('tflop_s', 0):.0f} TFLOP/s, {b.get('tb_s', 0):.2f} TB/s)")
        if r["kind"] == "indexer" and r["best_select"]:
            print(f"  {'  top-k':34s} best {r['best_select']['config']} {r['best_select']['us']:.1f} us")
    tables = tuned_tables([r for r in report["results"] if "kind" in r])
    report["tuned_tables"] = tables
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
