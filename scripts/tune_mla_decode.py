#!/usr/bin/env python3
"""Sweep the Triton MLA decode kernel's knobs over the benchmark shapes on a GPU and pick a config per row group.

    python3 scripts/tune_mla_decode.py --out tune_mla_decode.json [--budget-s 230] [--only bf16,fp8]

The kernel's default config is looked up by (query rows per request = s_q * h, bucketed to 16/32/64/
128/256; KV kind), so the sweep runs per such group, on the standard shapes that fall in it (b 128 at
s_k 8192, plus small batches at s_k 32768 where the KV is split). For each candidate config it
  - compiles first, in parallel worker processes (Triton's disk cache hands the binaries to this process),
  - checks the output once against the torch reference (FlashMLA bounds, four requests),
  - times it with triton.testing.do_bench (median; L2 flushed before every call), rotating among
    input sets that together exceed the L2,
and prints one line per (shape, config). Split-KV shapes also try other split counts around the
heuristic's. The JSON (GPU, versions, limits, every row, the best config per group) is rewritten after
every group, so a run cut short keeps what it measured. The last lines printed are the group winners
and a DEFAULT_CONFIGS table to paste into mlaserve/kernels/triton/mla_decode_plan.py.
"""

import argparse
import concurrent.futures as futures
import datetime
import importlib
import json
import math
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from mlaserve.bench import inputs as bench_inputs  # noqa: E402
from mlaserve.bench.limits import measure, time_us  # noqa: E402
from mlaserve.bench.shapes import DenseShape  # noqa: E402
from mlaserve.kernels import reference  # noqa: E402

md = importlib.import_module("mlaserve.kernels.triton.mla_decode")
Config = md.MLADecodeConfig

ROTATE_BYTES = 256 << 20     # input sets per shape cover this much memory, beyond the L2
CHECK_ROWS = 4               # requests compared with the reference per shape


def candidates(rows: int, kv: str) -> list:
    """Configs worth timing for `rows` query rows per request, default first.

    Pruned by ptxas reports for sm_90a (Triton 3.6): these compile without spills or with few, and fit
    the shared memory; 4-warp 64-row blocks (a 256-register accumulator per thread) never do.
    """
    if rows <= 32:
        bh = 16 if rows <= 16 else 32
        c = [Config(bh, 32, 1, 8, 3), Config(bh, 64, 1, 8, 3), Config(bh, 32, 1, 4, 3), Config(bh, 64, 1, 8, 2),
             Config(bh, 32, 1, 8, 4), Config(bh, 32, 2, 8, 3), Config(bh, 64, 2, 8, 2), Config(bh, 32, 2, 4, 3),
             Config(64, 64, 1, 8, 2), Config(64, 32, 1, 8, 3)]
        if bh == 16:
            c += [Config(32, 32, 1, 8, 3)]
        else:
            # two 16-row programs per request, adjacent in the grid: the second read of each KV tile
            # should come from L2, and 16-row tiles ran at 95% of copy bandwidth at h 16
            c += [Config(16, 64, 1, 8, 3), Config(16, 64, 1, 8, 2), Config(16, 32, 1, 8, 3)]
    else:
        c = [Config(64, 64, 1, 8, 2), Config(64, 32, 1, 8, 3), Config(64, 32, 1, 8, 4), Config(64, 64, 2, 8, 2),
             Config(32, 32, 1, 8, 3), Config(32, 64, 1, 8, 2), Config(32, 32, 2, 8, 2)]
        c += [Config(64, 64, 1, 8, 2, lazy_rescale=True)]
        if rows <= 64:
            c += [Config(16, 64, 1, 8, 3), Config(16, 64, 1, 8, 2)]   # as for 32 rows: KV re-read from L2
        if rows >= 128:
            c += [Config(128, 32, 2, 8, 2), Config(128, 32, 2, 8, 2, lazy_rescale=True), Config(128, 16, 2, 8, 2)]
    if kv == "fp8":   # the FP8 path also stages the raw bytes: drop what no longer fits 227 KB of shared memory
        c = [x for x in c if not (x.block_n == 64 and x.num_stages >= 3 and x.block_h <= 32)]
    default = md.default_config(rows, kv == "fp8")
    return [default] + [x for x in dict.fromkeys(c) if x != default]


@dataclass(frozen=True)
class Task:
    """One (shape, config, split count) to compile and time."""
    shape: DenseShape
    config: Config
    num_splits: int
    device: str = "cuda"
    dtype: str = "bfloat16"     # activations; float16 in --smoke runs (the CPU interpreter's bf16 dots are wrong)


def groups(kinds: list[str], smoke: bool = False) -> list[tuple[int, str, list[DenseShape]]]:
    """(rows bucket, kv, tuning shapes), in the order of the targets that matter most."""
    if smoke:   # tiny shapes that exercise the script end to end, splits included
        return [(16, kv, [DenseShape(1, 2, 700, 3, kv)]) for kv in kinds]
    out = []
    for kv in kinds:
        out += [
            (16, kv, [DenseShape(128, 1, 8192, 16, kv), DenseShape(4, 1, 32768, 16, kv)]),
            (128, kv, [DenseShape(128, 1, 8192, 128, kv), DenseShape(4, 1, 32768, 128, kv)]),
            (64, kv, [DenseShape(128, 1, 8192, 64, kv), DenseShape(128, 2, 8192, 32, kv)]),
            (32, kv, [DenseShape(128, 1, 8192, 32, kv), DenseShape(128, 2, 8192, 16, kv)]),
            (256, kv, [DenseShape(128, 2, 8192, 128, kv)]),
        ]
    # the targets first: memory-bound and matrix-bound bf16, memory-bound FP8; then the rest
    first = [(16, "bf16"), (128, "bf16"), (16, "fp8"), (64, "bf16"), (128, "fp8")]
    return sorted(out, key=lambda g: first.index(g[:2]) if g[:2] in first else len(first))


def splits_for(shape: DenseShape, config: Config, device: str) -> int:
    max_pages = math.ceil(shape.s_k / shape.page_size)
    return md.choose_num_splits(shape.b, shape.s_q, shape.h, max_pages, shape.page_size, torch.device(device), config)


# -- parallel compilation: a worker launches the kernel once on tiny inputs with the same specialization --

def _precompile(task: Task) -> tuple[Task, str | None, float]:
    t0 = time.perf_counter()
    try:
        s = task.shape
        max_pages = math.ceil(s.s_k / s.page_size)
        fp8 = s.kv == "fp8"
        dtype, dev = getattr(torch, task.dtype), task.device
        q = torch.zeros(1, s.s_q, s.h, 576, dtype=dtype, device=dev)
        kv = torch.zeros(2, s.page_size, 656 if fp8 else 576, dtype=torch.uint8 if fp8 else dtype, device=dev)
        table = torch.zeros(1, max_pages, dtype=torch.int32, device=dev)
        seqlens = torch.full((1,), s.s_q, dtype=torch.int32, device=dev)
        plan = md.plan_mla_decode(1, s.s_q, s.h, 512, max_pages, s.page_size, fp8, dev,
                                  num_splits=task.num_splits, config=task.config)
        md.mla_decode(q, kv, table, seqlens, 0.1, plan=plan)
        if dev == "cuda":
            torch.cuda.synchronize()
        return task, None, time.perf_counter() - t0
    except Exception as e:  # reported in the row of every shape that uses this config
        return task, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}", time.perf_counter() - t0


def precompile(tasks: list[Task], workers: int, budget_s: float) -> dict[Task, str | None]:
    errors = {}
    unique = list(dict.fromkeys(tasks))
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        pending = [pool.submit(_precompile, t) for t in unique]
        done, not_done = futures.wait(pending, timeout=max(1.0, budget_s))
        for f in not_done:
            f.cancel()
        for f in done:
            task, err, _ = f.result()
            errors[task] = err
    print(f"# compiled {len(errors)}/{len(unique)} kernels in {time.perf_counter() - t0:.0f}s "
          f"with {workers} workers", flush=True)
    return errors


# -- checking and timing --

def flashmla_close(out: torch.Tensor, ref: torch.Tensor, fp8: bool) -> str | None:
    """None if out matches ref within FlashMLA-like bounds, else what is off."""
    out, ref = out.float(), ref.float()
    if out.isnan().any():
        return "NaN in output"
    err = (out - ref).abs()
    bad = (err > 1e-3) & (err > (2 / 128) * ref.abs())
    if bad.any():
        return f"{int(bad.sum())} elements off, worst {float(err.max()):.3g}"
    x, y = out.double().flatten(), ref.double().flatten()
    cos = float(1 - 2 * (x @ y) / (x @ x + y @ y).clamp_min(1e-30))
    if cos > (1e-4 if fp8 else 1e-5):
        return f"cosine distance {cos:.3g}"
    return None


class ShapeRun:
    """Inputs of one shape, its reference on CHECK_ROWS requests, and the timing of configs on it."""

    def __init__(self, shape: DenseShape, limits, device: str, dtype: torch.dtype):
        self.shape = shape
        self.limits = limits
        self.device = torch.device(device)
        self.inputs = bench_inputs.make_dense(shape, self.device, seed=shape.b + shape.s_k + shape.h,
                                              rotate_bytes=ROTATE_BYTES)
        if dtype != torch.bfloat16:   # --smoke on the CPU interpreter
            self.inputs.q = [q.to(dtype) for q in self.inputs.q]
            self.inputs.kv = [kv if kv.dtype == torch.uint8 else kv.to(dtype) for kv in self.inputs.kv]
        p = self.inputs.paging
        self.max_pages = p.block_table.shape[1]
        rows = torch.arange(min(CHECK_ROWS, shape.b), device=self.device)
        self.rows = rows
        self.ref_out, self.ref_lse = reference.mla_decode(
            self.inputs.q[0][rows], self.inputs.kv[0], p.block_table[rows], p.seqlens[rows], self.inputs.scale,
            causal=True, head_dim_v=shape.d_v)

    def run(self, config: Config, num_splits: int) -> dict:
        s, di = self.shape, self.inputs
        p = di.paging
        row = {"shape": s.key, "kv": s.kv, "b": s.b, "s_q": s.s_q, "s_k": s.s_k, "h": s.h,
               "config": asdict(config), "num_splits": num_splits}
        try:
            plan = md.plan_mla_decode(s.b, s.s_q, s.h, s.d_v, self.max_pages, s.page_size, s.kv == "fp8",
                                      self.device, num_splits=num_splits, config=config)
            calls = [lambda q=q, kv=kv: md.mla_decode(q, kv, p.block_table, p.seqlens, di.scale, plan=plan)
                     for q, kv in zip(di.q, di.kv)]
            out, lse = calls[0]()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            problem = flashmla_close(out[self.rows], self.ref_out, s.kv == "fp8")
            lse_err = float((lse[self.rows] - self.ref_lse).abs().max())
            if problem is None and lse_err > 2e-3:
                problem = f"lse err {lse_err:.3g}"
            row["check"] = problem or "ok"
            us = time_us(calls, self.device, warmup_ms=10, rep_ms=60)
        except Exception as e:  # a config that does not fit (shared memory, registers) is a row, not a crash
            row["check"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            return row
        total_k = p.total_tokens
        row["us"] = us
        row["tbps"] = s.bytes(total_k) / us / 1e6
        row["tflops"] = s.flops(total_k) / us / 1e6
        if self.limits.copy_tbps:
            row["bw_frac"] = row["tbps"] / self.limits.copy_tbps
            row["mm_frac"] = row["tflops"] / self.limits.matmul_tflops
        return row


def fmt_config(c: Config) -> str:
    return f"H{c.block_h} N{c.block_n} V{c.v_split} w{c.num_warps} st{c.num_stages}" + (" lazy" if c.lazy_rescale else "")


def print_row(row: dict) -> None:
    c = Config(**row["config"])
    if "us" not in row:
        print(f"  {row['shape']:<24} {row['kv']:<4} {fmt_config(c):<22} sp{row['num_splits']:<3}  {row['check']}",
              flush=True)
        return
    frac = f" ({row['bw_frac']:.0%} bw, {row['mm_frac']:.0%} mm)" if "bw_frac" in row else ""
    print(f"  {row['shape']:<24} {row['kv']:<4} {fmt_config(c):<22} sp{row['num_splits']:<3} {row['us']:8.1f} us "
          f"{row['tbps']:5.2f} TB/s {row['tflops']:6.1f} TFLOP/s{frac}  {row['check']}", flush=True)


def pick(rows: list[dict], shapes: list[DenseShape]) -> tuple[Config | None, dict]:
    """The config with the lowest mean time relative to each shape's best (over configs that ran everywhere)."""
    best = {}
    for r in rows:
        if r.get("check") == "ok" and "us" in r:
            best[r["shape"]] = min(best.get(r["shape"], math.inf), r["us"])
    score = {}
    for r in rows:
        if r.get("check") == "ok" and "us" in r:
            key = json.dumps(r["config"], sort_keys=True)
            score.setdefault(key, {})[r["shape"]] = min(score.get(key, {}).get(r["shape"], math.inf),
                                                        r["us"] / best[r["shape"]])
    keys = {s.key for s in shapes}
    full = {k: sum(v.values()) / len(v) for k, v in score.items() if set(v) == keys}
    if not full:
        return None, {}
    winner = min(full, key=full.get)
    return Config(**json.loads(winner)), {"mean_rel_time": full[winner], "best_us": best}


def environment(device: str) -> dict:
    import triton
    gpu = device == "cuda"
    return {"gpu": torch.cuda.get_device_name(0) if gpu else "none (CPU interpreter)", "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "sms": torch.cuda.get_device_properties(0).multi_processor_count if gpu else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write (rewritten after every group)")
    p.add_argument("--budget-s", type=float, default=230.0, help="stop starting new groups/configs after this long")
    p.add_argument("--only", default="bf16,fp8", help="comma list of KV kinds: bf16,fp8")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="compile processes")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes and two configs in fp16, on the CPU interpreter when there is no GPU: "
                        "checks this script end to end, measures nothing")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not (args.smoke and os.environ.get("TRITON_INTERPRET") == "1"):
        print("tune_mla_decode: needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    kinds = [k for k in args.only.split(",") if k]
    if not set(kinds) <= {"bf16", "fp8"}:
        p.error(f"--only takes bf16,fp8; got {args.only!r}")
    dtype = torch.float16 if args.smoke else torch.bfloat16
    deadline = time.monotonic() + args.budget_s

    limits = measure(torch.device(device), rep_ms=50)
    result = {"env": environment(device), "limits": limits.as_dict(), "rows": [], "best": {}}
    print(f"# {result['env']}", flush=True)
    if limits.copy_tbps:
        print(f"# copy {limits.copy_tbps:.2f} TB/s, bf16 matmul {limits.matmul_tflops:.0f} TFLOP/s", flush=True)

    plan = []
    for rows, kv, shapes in groups(kinds, args.smoke):
        for s in shapes:
            configs = candidates(rows, kv)[:2] if args.smoke else candidates(rows, kv)
            for c in configs:
                n = splits_for(s, c, device)
                plan.append(Task(s, c, n, device, str(dtype).removeprefix("torch.")))
                if n > 1:   # the split count around the heuristic's, on the small-batch shapes
                    plan += [Task(s, c, m, device, str(dtype).removeprefix("torch.")) for m in (max(1, n // 2), 2 * n)]
    compile_errors = precompile(plan, args.workers, budget_s=0.45 * args.budget_s)

    winners = []
    for rows, kv, shapes in groups(kinds, args.smoke):
        if time.monotonic() > deadline:
            print(f"# budget spent: group rows<={rows} {kv} not tuned", flush=True)
            break
        group_rows = []
        print(f"# group rows<={rows} {kv}", flush=True)
        for s in shapes:
            run = ShapeRun(s, limits, device, dtype)
            shape_rows = []
            for task in [t for t in plan if t.shape == s]:
                heuristic = splits_for(s, task.config, device)
                if task.num_splits != heuristic or time.monotonic() > deadline:
                    continue
                row = run.run(task.config, task.num_splits)
                row["heuristic_splits"] = heuristic
                if compile_errors.get(task) and row.get("check") != "ok":
                    row["check"] = compile_errors[task]
                print_row(row)
                shape_rows.append(row)
            # other split counts, for this shape's best config only: does the heuristic pick well?
            best = min((r for r in shape_rows if r.get("check") == "ok" and "us" in r), key=lambda r: r["us"],
                       default=None)
            if best is not None and best["num_splits"] > 1:
                config = Config(**best["config"])
                for task in [t for t in plan if t.shape == s and t.config == config and t.num_splits != best["num_splits"]]:
                    if time.monotonic() > deadline:
                        break
                    row = run.run(task.config, task.num_splits)
                    row["heuristic_splits"] = best["num_splits"]
                    print_row(row)
                    shape_rows.append(row)
            group_rows += shape_rows
            del run
            if device == "cuda":
                torch.cuda.empty_cache()
        result["rows"] += group_rows
        # the winner is judged at the heuristic's split count: that is what the table's config gets
        at_heuristic = [r for r in group_rows if r["num_splits"] == r["heuristic_splits"]]
        winner, info = pick(at_heuristic, shapes)
        key = f"{rows},{kv}"
        result["best"][key] = {"config": asdict(winner) if winner else None, **info}
        winners.append((rows, kv, winner, info))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    print("\n# winners (mean time relative to each shape's best config; 1.00 = best everywhere)")
    for rows, kv, winner, info in winners:
        if winner is None:
            print(f"#  rows<={rows:<3} {kv:<4} no config passed everywhere")
        else:
            print(f"#  rows<={rows:<3} {kv:<4} {fmt_config(winner):<22} {info['mean_rel_time']:.2f}  "
                  + "  ".join(f"{k}: {v:.0f}us" for k, v in info["best_us"].items()))
    print("DEFAULT_CONFIGS = {")
    for rows, kv, winner, _ in sorted(winners, key=lambda w: (w[1], w[0])):
        if winner is not None:
            c = winner
            lazy = ", lazy_rescale=True" if c.lazy_rescale else ""
            print(f"    ({rows}, \"{kv}\"): MLADecodeConfig(block_h={c.block_h}, block_n={c.block_n}, "
                  f"v_split={c.v_split}, num_warps={c.num_warps}, num_stages={c.num_stages}{lazy}),")
    print("}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
