"""Time Triton decode configs x KV split counts, exactly as `mlaserve bench kernels` times them (its inputs
rotating over 256 MB, one CUDA graph per input set, `time_us`: L2 cleared before each replay, median), so
that the numbers compare with the benchmark's rows.

    python scripts/small_batch_sweep.py [--shapes "b4 h16,b1 h16"] [--default-only]
    python scripts/small_batch_sweep.py --default-only --shapes "b128 h64 sk4096 var"

Small batches try split counts from 16 to 128 and the one-wave counts; large batches (one wave or more of
programs without splitting) 1-8 splits, which only balance unequal lengths. One line per (shape, config,
split count): µs and TB/s; the planner's pick is marked; the fastest of each shape printed last. Each run's
output is compared with the first's (max abs difference <= 2e-2).
"""

import argparse
import importlib
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mlaserve.bench import inputs as bench_inputs  # noqa: E402
from mlaserve.bench.limits import capture_graphs, time_us  # noqa: E402
from mlaserve.bench.shapes import DenseShape  # noqa: E402

md = importlib.import_module("mlaserve.kernels.triton.mla_decode")
C = md.MLADecodeConfig
CONFIGS = {16: [None, C(16, 64, 1, 8, 3), C(16, 32, 1, 4, 3), C(16, 32, 1, 4, 2), C(16, 32, 1, 8, 2), C(16, 64, 1, 4, 2),
                C(16, 16, 1, 4, 3)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="b4 h16,b1 h16,b16 h16",
                    help='comma list of "bB hH [skS] [var]" (s_k 32768 and fixed lengths unless given)')
    ap.add_argument("--default-only", action="store_true", help="time the default config only")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for spec in args.shapes.split(","):
        words = spec.split()
        b, h = int(words[0][1:]), int(words[1][1:])
        s_k = next((int(w[2:]) for w in words if w.startswith("sk")), 32768)
        shape = DenseShape(b, 1, s_k, h, varlen="var" in words)
        di = bench_inputs.make_dense(shape, dev, seed=b + h, rotate_bytes=256 << 20)
        p = di.paging
        max_pages = p.block_table.shape[1]
        nbytes = shape.bytes(p.total_tokens)
        best, first = None, None
        for config in [None] if args.default_only else CONFIGS[h]:
            cfg = config or md.default_config(h, False)
            planned = md.choose_num_splits(b, 1, h, max_pages, 64, dev, cfg)
            programs = b * math.ceil(h / cfg.block_h)
            counts = sorted({planned, sms // programs, 2 * sms // programs, 16, 24, 32, 48, 64, 96, 128} - {0})
            if programs >= sms // 2:       # large batches: a few splits, for balance across unequal lengths
                counts = [1, 2, 3, 4, 6, 8]
            for n in counts:
                plan = md.plan_mla_decode(b, 1, h, 512, max_pages, 64, False, dev, num_splits=n, config=cfg)
                calls = [lambda q=q, kv=kv: md.mla_decode(q, kv, p.block_table, p.seqlens, di.scale, plan=plan)
                         for q, kv in zip(di.q, di.kv)]
                out, _ = calls[0]()
                torch.cuda.synchronize()
                if first is None:
                    first = out.float()
                diff = float((out.float() - first).abs().max())
                us = time_us(capture_graphs(calls), dev)
                tag = "default" if config is None else f"H{cfg.block_h} N{cfg.block_n} w{cfg.num_warps} st{cfg.num_stages}"
                print(f"{shape.key} {tag:18s} splits {n:4d}{'*' if n == planned else ' '} {us:7.1f} us "
                      f"{nbytes / us / 1e6:5.2f} TB/s  diff {diff:.1e}{'  BAD' if diff > 2e-2 else ''}", flush=True)
                if best is None or us < best[0]:
                    best = (us, tag, n)
        print(f"BEST {shape.key}: {best[1]} splits {best[2]} {best[0]:.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
