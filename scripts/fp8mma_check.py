"""Check and time the FP8-MMA decode (mlaserve/kernels/triton/mla_decode_gluon_fp8mma.py, <= 16 query rows per
request, FP8 cache) on a Hopper GPU, beside the keys-on-M Gluon kernel's FP8 (dequantizing warpgroup) and bf16.

    python scripts/fp8mma_check.py              # correctness shapes (PASS/FAIL each, against both value sets), timings
    python scripts/fp8mma_check.py --quick      # the correctness shapes only
    FP8MMA_KERNELS=mlaserve.kernels.triton.mla_decode_gluon_fp8mma,other.module python scripts/fp8mma_check.py
                                                # variants (each module's mla_decode_gluon_fp8mma), checked and timed

The kernel computes on e4m3 * scale exactly; the reference is run on those exact values (float64) and, for
comparison, on the format's bf16-rounded values (fp8_format.dequantize), which the dequantizing kernels use.
Inputs and poisoning are scripts/cutedsl_check.py's (every unused FP8 slot's 656 bytes 0xFF). Timings replay a
CUDA graph over input copies spanning 256 MB.
"""

import importlib
import os
import sys
from types import SimpleNamespace

import torch
import triton

from cutedsl_check import make_fp8_case
import gluon_check
from gluon_check import check_shapes, timing_sets
import gluon_narrow_check as narrow
from mlaserve.kernels import fp8_format

KERNELS = {m.rsplit(".", 1)[-1]: importlib.import_module(m) for m in os.environ.get(
    "FP8MMA_KERNELS", "mlaserve.kernels.triton.mla_decode_gluon_fp8mma").split(",")}


def run(q, kv, table, seqlens, causal=True, num_splits=None, fm=None):
    """gluon_narrow_check.run's call (16-row plan, out, lse) into the FP8-MMA kernel of module fm."""
    fm = fm or next(iter(KERNELS.values()))
    return narrow.run(q, kv, table, seqlens, causal, num_splits,
                      gk=SimpleNamespace(mla_decode_gluon_narrow=fm.mla_decode_gluon_fp8mma))


def check() -> int:
    cases = [([1], 1, 16, True, None), ([64], 1, 16, True, 1), ([65], 2, 8, True, 1), ([4096], 1, 16, True, None),
             ([777, 1, 64, 3000], 2, 8, True, None), ([777, 1, 64, 3000], 1, 16, False, 1),
             ([5, 300, 64, 129], 1, 16, True, 3), ([2000, 0, 70, 4096], 1, 16, True, 4),
             ([1000 + 31 * i for i in range(128)], 1, 16, True, None), ([100, 1, 3000], 3, 5, True, None),
             ([130, 200, 64, 3000], 1, 1, True, 2), ([8192] * 4, 1, 16, True, 1)]
    failed = 0
    for i, (name, fm) in enumerate(KERNELS.items()):
        print(f"-- {name}, reference on the exact values", flush=True)
        failed += check_shapes(cases, make_fp8_case, lambda *a, fm=fm: run(*a, fm=fm),
                               lambda kv: fp8_format.dequantize(kv, torch.float64, exact=True))
        if i == 0:
            print(f"-- {name}, reference on the format's bf16-rounded values (information)", flush=True)
            check_shapes(cases, make_fp8_case, lambda *a, fm=fm: run(*a, fm=fm),
                         lambda kv: fp8_format.dequantize(kv).double())
    return failed


def timings() -> None:
    copy_bytes = 256 << 20
    shapes = [(128, 1, 16, s_k) for s_k in (4096, 8192, 32768)] + [(128, 2, 8, 8192)]
    shapes += [(b, 1, 16, 32768) for b in (1, 4, 16)]
    if os.environ.get("FP8MMA_SHAPES"):
        want = os.environ["FP8MMA_SHAPES"].split(",")
        shapes = [sh for sh in shapes if "b{} s_q{} h{} s_k{}".format(*sh) in want]
    for b, s_q, h, s_k in shapes:
        sets = timing_sets(b, s_q, h, s_k, True, copy_bytes)
        n = len(sets)
        res = {}
        for name in (*KERNELS, "narrow-fp8", "narrow-bf16"):
            def step():
                for q, kv16, kv8, table, seqlens in sets:
                    if name in KERNELS:
                        run(q, kv8, table, seqlens, fm=KERNELS[name])
                    else:
                        narrow.run(q, kv8 if name == "narrow-fp8" else kv16, table, seqlens)
            print(f"  timing {name}", flush=True)
            step()
            torch.cuda.synchronize()
            res[name] = triton.testing.do_bench_cudagraph(step, rep=100) * 1e3 / n
        bytes8 = b * s_k * 656
        print(f"b{b} s_q{s_q} h{h} s_k{s_k}: " + "  ".join(f"{k} {v:7.1f} us" for k, v in res.items()) + "  |"
              + "".join(f"  {k} {bytes8 / res[k] / 1e6:.2f} TB/s {res['narrow-fp8'] / res[k]:.2f}x narrow-fp8 "
                        f"{res['narrow-bf16'] / res[k]:.2f}x bf16" for k in KERNELS), flush=True)


if __name__ == "__main__":
    sys.exit(gluon_check.main(__doc__, check, timings))
