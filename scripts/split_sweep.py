"""Time KV split counts (and, for the Triton kernel, configs) of one MLA decode backend, exactly as
`mlaserve bench kernels` times them: its inputs rotating over 256 MB (so that the 60 MB L2 never holds the KV
a call reads; one b1 request of 32768 tokens is 37.7 MB), one CUDA graph per input set, `time_us` (L2 cleared
before each replay, median).

    python scripts/split_sweep.py --backend cutedsl     # the CuTe DSL kernel (mlaserve/kernels/cutedsl)
    python scripts/split_sweep.py --backend triton      # the Triton backend's kernels (mlaserve/kernels/triton)
    python scripts/split_sweep.py --backend triton --fp8
    python scripts/split_sweep.py --backend triton --configs --shapes "b4 h16,b1 h16"
    python scripts/split_sweep.py --backend triton --shapes "b128 h64 sk4096 var"
    python scripts/split_sweep.py --backend triton --shapes "b1 h16" --counts 33,44,66   # these counts only
    python scripts/split_sweep.py --backend cutedsl --fp8 --fp8-f16-any-split --shapes "b128 h16 sk4096" --counts 1,2,3

Shapes: "bB hH [skS] [var]" (s_q 1, page 64, s_k 32768 and fixed lengths unless given); by default b 1/4/16 x
h 128/64/16. Small batches try the counts that put 0.5 .. 3 waves of programs on the SMs, those that fill
exactly one wave, and the planner's; large batches (programs >= half the SMs) 1-8 splits, which only balance
unequal lengths. One line per (shape, config, count): µs and TB/s, the planner's pick marked `*`; then the
best of each shape. Every run's output is compared with the first's (max abs difference <= 2e-2; splits only
change the summation order).
"""

import argparse
import importlib
import importlib.util
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mlaserve.bench import inputs as bench_inputs  # noqa: E402
from mlaserve.bench.limits import capture_graphs, time_us  # noqa: E402
from mlaserve.bench.shapes import DenseShape  # noqa: E402

DEFAULT_SHAPES = ",".join(f"b{b} h{h}" for h in (128, 64, 16) for b in (1, 4, 16))


def _backend(name: str):
    """(module with plan_mla_decode and mla_decode, config -> (query rows per program, programs per block of
    rows)) of the backend's kernel."""
    if name == "cutedsl":
        mod = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
        return mod, lambda config: (mod.TILE_M, 1)
    mod = importlib.import_module("mlaserve.kernels.triton.mla_decode")
    return mod, lambda config: (config.block_h, config.v_split)


def _triton_configs(rows: int, kv_fp8: bool) -> list:
    """The default config, then the tl configs worth trying at <= 16 rows (others: the default only)."""
    md = importlib.import_module("mlaserve.kernels.triton.mla_decode")
    C = md.MLADecodeConfig
    extra = [C(16, 64, 1, 8, 3), C(16, 32, 1, 4, 3), C(16, 32, 1, 4, 2), C(16, 32, 1, 8, 2), C(16, 64, 1, 4, 2),
             C(16, 16, 1, 4, 3)] if rows <= 16 else []
    default = md.default_config(rows, kv_fp8)
    return [default] + [c for c in extra if c != default]


def _tag(config, default) -> str:
    if config is None or config == default:
        return "default"
    return f"H{config.block_h} N{config.block_n} w{config.num_warps} st{config.num_stages}"


def sweep(backend: str, kv_fp8: bool, shapes: str, configs: bool, only_counts: list[int] | None = None) -> None:
    mod, blocks = _backend(backend)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for spec in shapes.split(","):
        words = spec.split()
        b, h = int(words[0][1:]), int(words[1][1:])
        s_k = next((int(w[2:]) for w in words if w.startswith("sk")), 32768)
        shape = DenseShape(b, 1, s_k, h, "fp8" if kv_fp8 else "bf16", varlen="var" in words)
        di = bench_inputs.make_dense(shape, dev, seed=b + h, rotate_bytes=256 << 20)
        p = di.paging
        max_pages = p.block_table.shape[1]
        nbytes = shape.bytes(p.total_tokens)
        default = mod.default_config(h, kv_fp8)
        tried = _triton_configs(h, kv_fp8) if configs and backend == "triton" else [default]
        best, first = None, None
        for config in tried:
            rows_per, v_split = blocks(config)
            programs = b * math.ceil(h / rows_per) * v_split
            planned = mod.plan_mla_decode(b, 1, h, 512, max_pages, 64, kv_fp8, dev, config=config).num_splits
            if programs >= sms // 2:
                counts = [1, 2, 3, 4, 6, 8]
            else:
                counts = {planned} | {max(1, min(128, round(k * sms / programs))) for k in (0.5, 0.75, 1, 1.5, 2, 3)}
                counts |= {n for n in range(1, 129) if programs * n in (sms - 4, sms, 2 * sms)}
            if only_counts:
                counts = set(only_counts)
            for n in sorted(set(counts) | {planned}):
                plan = mod.plan_mla_decode(b, 1, h, 512, max_pages, 64, kv_fp8, dev, num_splits=n, config=config)
                calls = [lambda q=q, kv=kv: mod.mla_decode(q, kv, p.block_table, p.seqlens, di.scale, plan=plan)
                         for q, kv in zip(di.q, di.kv)]
                out = calls[0]()[0].float()
                torch.cuda.synchronize()
                first = out if first is None else first
                diff = float((out - first).abs().max())
                us = time_us(capture_graphs(calls), dev)
                tag = _tag(config, default)
                print(f"{backend} {shape.key} {shape.kv} {tag:18s} splits {n:4d}{'*' if n == planned else ' '} "
                      f"{us:7.1f} us {nbytes / us / 1e6:5.2f} TB/s  diff {diff:.1e}{'  BAD' if diff > 2e-2 else ''}",
                      flush=True)
                if best is None or us < best[0]:
                    best = (us, tag, n)
        print(f"BEST {backend} {shape.key} {shape.kv}: {best[1]} splits {best[2]} {best[0]:.1f} us", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("cutedsl", "triton"), required=True)
    ap.add_argument("--fp8", action="store_true", help="FP8 KV (the 656-byte format)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help='comma list of "bB hH [skS] [var]"')
    ap.add_argument("--configs", action="store_true", help="triton: also the tl configs worth trying at <= 16 rows")
    ap.add_argument("--counts", default="", help="comma list of split counts to time instead of the default ones "
                                                 "(the planner's is always timed)")
    ap.add_argument("--fp8-f16-any-split", action="store_true",
                    help="cutedsl FP8 at <= 32 rows: the f16-register kernel however few pages a split has "
                         "(mla_decode.uses_fp8_f16 otherwise takes it from CONFIG.fp8_mma_min_pages a split)")
    args = ap.parse_args()
    if args.fp8_f16_any_split:
        # the GPU tests' stand-in (scripts/cutedsl_check.py), so that both run one rule
        cd = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
        spec = importlib.util.spec_from_file_location(
            "cutedsl_check", os.path.join(os.path.dirname(os.path.abspath(__file__)), "cutedsl_check.py"))
        check = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(check)
        cd.uses_fp8_f16 = check.fp8_f16_any_split(cd)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    sweep(args.backend, args.fp8, args.shapes, args.configs, [int(c) for c in args.counts.split(",") if c])
    return 0


if __name__ == "__main__":
    sys.exit(main())
