"""Time launch configs of the split combine (mlaserve/kernels/triton/mla_decode.py `combine_config`) inside whole
decode calls, timed as `mlaserve bench kernels` times them (inputs rotating over 256 MB, one CUDA graph per input
set, L2 cleared before each replay, median), so that the partials come from the split kernel as they do in use.

    python scripts/combine_sweep.py                                  # the default shapes below
    python scripts/combine_sweep.py --shapes "cutedsl b4 h128,triton b1 h16"

Shapes: "BACKEND bB hH [sqN] [skS]" (s_q 1, s_k 32768 unless given), BACKEND cutedsl or triton (its kernels
through mlaserve.ops, as the benchmark calls them). One line per (shape, config): µs, and the max abs difference
of the output from the default config's (the splits' summation order is the same, so <= 1e-2); the default is
marked `*`; then the best of each shape.
"""

import argparse
import importlib
import itertools
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mlaserve.bench import inputs as bench_inputs  # noqa: E402
from mlaserve.bench import runners  # noqa: E402
from mlaserve.bench.limits import capture_graphs, time_us  # noqa: E402
from mlaserve.bench.shapes import DenseShape  # noqa: E402

md = importlib.import_module("mlaserve.kernels.triton.mla_decode")

DEFAULT_SHAPES = "cutedsl b4 h128,cutedsl b1 h128,cutedsl b4 h64,triton b1 h16,triton b4 h16"
MAX_TILE = 16384      # fp32 elements of one [rows, splits, columns] load per program


def candidates(total_rows: int, num_splits: int, d_v: int) -> list:
    """Rows x columns per program, splits per load (8 // rows, as the default, or all at once), warps."""
    block_s = triton.next_power_of_2(num_splits)
    out = []
    for r, c, w in itertools.product((1, 2, 4, 8, 16), (128, 512), (4, 8)):
        if r > triton.next_power_of_2(total_rows):
            continue
        for chunk in sorted({max(1, 8 // r), block_s}):
            if r * chunk * c <= MAX_TILE and (w == 4 or r * chunk * c >= 8192):
                out.append(md.CombineConfig(r, c, chunk, w))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    default_rule = md.combine_config
    for spec in args.shapes.split(","):
        words = spec.split()
        backend, b, h = words[0], int(words[1][1:]), int(words[2][1:])
        s_q = next((int(w[2:]) for w in words if w.startswith("sq")), 1)
        s_k = next((int(w[2:]) for w in words if w.startswith("sk")), 32768)
        shape = DenseShape(b, s_q, s_k, h, "bf16")
        inputs = bench_inputs.make_dense(shape, dev, seed=b + h, rotate_bytes=256 << 20)
        seen = {}

        def recording(total_rows, num_splits, d_v):
            seen["args"] = (total_rows, num_splits, d_v)
            return default_rule(total_rows, num_splits, d_v)

        md.combine_config = recording
        prep = runners.prepare_ops(backend, shape, inputs)
        first = prep.calls[0]()[0].float()
        torch.cuda.synchronize()
        if "args" not in seen:
            print(f"{spec}: one split, no combine", flush=True)
            md.combine_config = default_rule
            continue
        default = default_rule(*seen["args"])
        rows, splits = seen["args"][:2]
        best = None
        for cfg in [default] + [c for c in candidates(rows, splits, seen["args"][2]) if c != default]:
            md.combine_config = lambda *a, cfg=cfg: cfg
            try:
                diff = float((prep.calls[0]()[0].float() - first).abs().max())
                us = time_us(capture_graphs(prep.calls), dev)
            except Exception as e:   # a config that fails to compile or launch: say so, try the next
                print(f"{spec} {tuple(cfg)}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            print(f"{spec} rows {rows} splits {splits} R{cfg.block_r:<2d} C{cfg.block_c:<3d} S{cfg.split_chunk:<3d} "
                  f"w{cfg.num_warps} {us:8.1f} us{' *' if cfg == default else '  '} diff {diff:.1e}"
                  f"{'  BAD' if diff > 1e-2 else ''}", flush=True)
            if best is None or us < best[0]:
                best = (us, cfg)
        print(f"BEST {spec}: {tuple(best[1])} {best[0]:.1f} us", flush=True)
        md.combine_config = default_rule
    return 0


if __name__ == "__main__":
    sys.exit(main())
