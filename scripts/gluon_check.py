"""Check and time the Gluon MLA decode (mlaserve/kernels/triton/mla_decode_gluon.py, 64-row blocks, bf16 and FP8
KV) on a Hopper GPU.

    python scripts/gluon_check.py            # correctness shapes (PASS/FAIL each), then timings beside the tl kernel
    python scripts/gluon_check.py --quick    # the correctness shapes only
    GLUON_FP8=0 python scripts/gluon_check.py --timings-only   # bf16 timings only (FP8 KV is timed by default)

Inputs, poisoning (NaN in unused slots, out-of-range block-table entries past a request's pages) and
tolerances are scripts/cutedsl_check.py's. The timings replay a CUDA graph that runs the kernel on copies
of q and the cache spanning 256 MB, as `mlaserve bench kernels` rotates inputs, so that small batches do
not read their KV from L2; they decide which row counts the triton backend gives to the Gluon kernel.
"""

import argparse
import importlib
import os
import sys
from dataclasses import replace

import torch
import triton

from cutedsl_check import SCALE, compare, make_case, make_fp8_case
from mlaserve import ops
from mlaserve.kernels import fp8_format, reference

tk = importlib.import_module("mlaserve.kernels.triton.mla_decode")
GLUON = tk.MLADecodeConfig(block_h=64, block_n=64, num_stages=2, gluon=True)
FP8_TIMINGS = os.environ.get("GLUON_FP8", "1") == "1"   # GLUON_FP8=0: bf16 timings only


def run(q, kv, table, seqlens, causal=True, num_splits=None, config=GLUON):
    return tk.mla_decode(q, kv, table, seqlens, SCALE, causal, num_splits=num_splits, config=config)


def check_shapes(cases, make, run_case, values) -> int:
    """One PASS/FAIL line per case (lens, s_q, h, causal, splits); -> the number failed. make(lens, s_q, h, seed)
    gives the inputs, run_case(q, kv, table, seqlens, causal, splits) the kernel's (out, lse), and the reference
    runs in float64 on values(kv)."""
    failed = 0
    for seed, (lens, s_q, h, causal, splits) in enumerate(cases):
        q, kv, table, seqlens = make(lens, s_q, h, seed)
        name = f"b{len(lens)} s_q{s_q} h{h} causal={causal} s_k {min(lens)}..{max(lens)} splits={splits or 'auto'}"
        try:
            out, lse = run_case(q, kv, table, seqlens, causal, splits)
            torch.cuda.synchronize()
            ok, err, why = compare(out, lse, *reference.mla_decode(q.double(), values(kv), table, seqlens, SCALE,
                                                                    causal=causal))
        except Exception as e:      # a launch or compile error is this shape's FAIL line
            ok, err, why = False, float("nan"), f"{type(e).__name__}: {str(e)[:300]}"
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {name}  max abs err {err:.2e}  {why}", flush=True)
    return failed


def check() -> int:
    cases = [([1], 1, 64, True, None), ([64], 1, 64, True, 1), ([65], 1, 128, True, 1), ([4096], 1, 128, True, None),
             ([777, 1, 64, 3000], 2, 64, True, None), ([777, 1, 64, 3000], 2, 128, False, 1),
             ([5, 300, 64, 129], 1, 128, True, 3), ([2000, 0, 70, 4096], 1, 64, True, 4),
             ([1000 + 31 * i for i in range(128)], 1, 128, True, None), ([4096] * 132, 2, 64, True, None),
             # rows that are not a multiple of 64: padded tiles, rows past s_q * h never stored
             ([100, 1, 3000], 1, 16, True, None), ([100, 1, 3000, 65], 1, 32, True, 2),
             ([5, 700, 4000], 3, 20, True, None),
             ([129, 2, 64], 3, 128, True, None), ([3000] * 5, 2, 8, True, None)]
    failed = check_shapes(cases, lambda lens, s_q, h, seed: make_case(lens, s_q, h, torch.bfloat16, seed), run,
                          lambda kv: kv.double())
    print("-- FP8 KV (each page dequantized into a bf16 tile; the reference on the format's values)", flush=True)
    return failed + check_shapes(cases, make_fp8_case, run, lambda kv: fp8_format.dequantize(kv).double())


def timing_sets(b, s_q, h, s_k, fp8, copy_bytes=256 << 20):
    """Input copies spanning `copy_bytes` of bf16 cache (at most 8), so that graph replays read HBM, not L2:
    [(q, bf16 cache, its FP8 packing or None, block table of shuffled pages, lengths s_k)]."""
    pages = b * s_k // 64
    sets = []
    for _ in range(max(1, min(8, -(-copy_bytes // (pages * 64 * 576 * 2))))):
        kv16 = torch.randn(pages, 64, 576, device="cuda", dtype=torch.bfloat16)
        sets.append((torch.randn(b, s_q, h, 576, device="cuda", dtype=torch.bfloat16), kv16,
                     ops.quantize_kv_fp8(kv16) if fp8 else None,
                     torch.randperm(pages, device="cuda", dtype=torch.int32).view(b, s_k // 64),
                     torch.full((b,), s_k, device="cuda", dtype=torch.int32)))
    return sets


def timings() -> None:
    copy_bytes = 256 << 20
    shapes = [(128, 1, 128, s_k) for s_k in (4096, 32768)] + [(128, 2, 128, 8192)]
    shapes += [(128, 1, h, s_k) for h in (64, 32) for s_k in (4096, 8192, 32768)]
    shapes += [(b, 1, h, 32768) for b in (1, 4, 16) for h in (128, 64)]
    if os.environ.get("GLUON_SHAPES"):   # e.g. "b128 s_q1 h64 s_k8192,b4 s_q1 h128 s_k32768"
        shapes = [sh for sh in shapes if "b{} s_q{} h{} s_k{}".format(*sh) in os.environ["GLUON_SHAPES"].split(",")]
    for b, s_q, h, s_k in shapes:
        sets = timing_sets(b, s_q, h, s_k, FP8_TIMINGS, copy_bytes)
        n = len(sets)
        # do_bench_cudagraph runs on a stream of its own, which does not wait for the default stream's work: the
        # inputs must be complete first (without this, a kernel read a block table and lengths still being
        # written and faulted at b128 h64 s_k 8192 once the FP8 copies made the set-up long)
        torch.cuda.synchronize()
        flops = 2 * b * s_q * h * s_k * (576 + 512)
        nbytes = b * s_k * 576 * 2 + b * s_q * h * (576 + 512) * 2
        res = {}
        kinds = [("gluon", GLUON, False), ("tl", replace(tk.default_config(s_q * h, False), gluon=False), False)]
        if FP8_TIMINGS:
            kinds += [("gluon-fp8", GLUON, True), ("tl-fp8", replace(tk.default_config(s_q * h, True), gluon=False),
                                                   True)]
        for name, config, fp8 in kinds:
            def step():
                for q, kv16, kv8, table, seqlens in sets:
                    run(q, kv8 if fp8 else kv16, table, seqlens, config=config)
            us = triton.testing.do_bench_cudagraph(step, rep=100) * 1e3 / n
            res[name] = us
        print(f"b{b} s_q{s_q} h{h} s_k{s_k}: " + "  ".join(
            f"{k} {v:7.1f} us {nbytes / v / 1e6:5.2f} TB/s {flops / v / 1e6:6.1f} TFLOP/s" for k, v in res.items()
            if not k.endswith("fp8"))
            + "  " + "  ".join(f"{k} {v:7.1f} us" for k, v in res.items() if k.endswith("fp8"))
            + f"  gluon/tl {res['tl'] / res['gluon']:.2f}x"
            + (f"  gluon-fp8 vs gluon(bf16) {res['gluon'] / res['gluon-fp8']:.2f}x, vs tl-fp8 "
               f"{res['tl-fp8'] / res['gluon-fp8']:.2f}x" if FP8_TIMINGS else ""), flush=True)


def main(doc: str = __doc__, check_fn=None, timings_fn=None) -> int:
    """The command line of this script and of gluon_narrow_check.py: checks, then timings unless --quick."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the checks only")
    ap.add_argument("--timings-only", action="store_true", help="no checks")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    failed = 0 if args.timings_only else (check_fn or check)()
    print(f"{failed} failed", flush=True)
    if not args.quick:   # timed even after a FAIL: a fast wrong kernel is worth fixing, a slow one is not
        (timings_fn or timings)()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
