"""Check and time the keys-on-M Gluon decode (mlaserve/kernels/triton/mla_decode_gluon_narrow.py, <= 32 query
rows per request) on a Hopper GPU, on bf16 and FP8 caches.

    python scripts/gluon_narrow_check.py            # correctness shapes (PASS/FAIL each), then timings
    python scripts/gluon_narrow_check.py --quick    # the correctness shapes only
    NARROW_KERNELS=mlaserve.kernels.triton.mla_decode_gluon_narrow,other.module python scripts/gluon_narrow_check.py
                                                    # variants of the kernel (each module's mla_decode_gluon_narrow),
                                                    # each checked and timed beside the others
    NARROW_VARIANTS=bf16,fp8 NARROW_SHAPES="b128 s_q1 h16 s_k8192" python scripts/gluon_narrow_check.py
                                                    # what and where to time (kinds below, shapes in timings())
    NARROW_POOL=256 python scripts/gluon_narrow_check.py --timings-only
                                                    # the kernels' own per-page chain: pages from L2

Inputs, poisoning and tolerances are scripts/cutedsl_check.py's: NaN in unused bf16 slots; every unused FP8
slot's 656 bytes 0xFF (NaN e4m3, NaN scales, NaN k_pe). FP8 results are compared with the reference (float64)
on the format's values (the bf16 nearest e4m3 x scale). Timings replay a CUDA graph over input copies spanning
256 MB, beside the tl kernel on the same caches.
"""

import importlib
import os
import sys
from dataclasses import replace

import torch
import triton

from cutedsl_check import SCALE, make_case, make_fp8_case
import gluon_check
from gluon_check import check_shapes
from mlaserve import ops
from mlaserve.kernels import fp8_format

tk = importlib.import_module("mlaserve.kernels.triton.mla_decode")
KERNELS = {m.rsplit(".", 1)[-1]: importlib.import_module(m) for m in os.environ.get(
    "NARROW_KERNELS", "mlaserve.kernels.triton.mla_decode_gluon_narrow").split(",")}
# kinds timed per kernel: bf16 | fp8 (the entry's default: the dequantizing warpgroup) | fp8:inline (FP8 dequantized
# in place by two compute warpgroups)
VARIANTS = os.environ.get("NARROW_VARIANTS", "bf16,fp8,fp8:inline").split(",")
# NARROW_POOL=N: every block-table entry drawn from N pages (L2-resident after the first touch: the kernel's own
# per-page chain, as scripts/chain_rate.py measures it) instead of each request's own pages
POOL = int(os.environ.get("NARROW_POOL", "0"))
CONFIGS = {16: tk.MLADecodeConfig(block_h=16, block_n=64, num_stages=2),
           32: tk.MLADecodeConfig(block_h=32, block_n=64, num_stages=2)}


def run(q, kv, table, seqlens, causal=True, num_splits=None, gk=None, **opts):
    b, s_q, h, _ = q.shape
    plan = tk.plan_mla_decode(b, s_q, h, 512, table.shape[1], 64, kv.dtype == torch.uint8, q.device,
                              num_splits=num_splits, config=CONFIGS[16 if s_q * h <= 16 else 32])
    out = torch.empty(b, s_q, h, 512, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=q.device)
    (gk or next(iter(KERNELS.values()))).mla_decode_gluon_narrow(q, kv, table, seqlens, SCALE, causal, plan, out,
                                                                  lse, **opts)
    return out, lse


def check() -> int:
    cases = [([1], 1, 16, True, None), ([64], 1, 16, True, 1), ([65], 2, 8, True, 1), ([4096], 1, 16, True, None),
             ([777, 1, 64, 3000], 2, 8, True, None), ([777, 1, 64, 3000], 1, 16, False, 1),
             ([5, 300, 64, 129], 1, 16, True, 3), ([2000, 0, 70, 4096], 1, 16, True, 4),
             ([1000 + 31 * i for i in range(128)], 1, 16, True, None), ([100, 1, 3000], 3, 5, True, None),
             # 17-32 rows: N = 32
             ([777, 1, 64, 3000], 1, 32, True, None), ([777, 1, 64, 3000], 2, 16, True, 2),
             ([2000, 0, 70, 4096], 3, 10, False, 3), ([1000 + 31 * i for i in range(64)], 1, 32, True, None)]
    failed = 0
    for name, gk in KERNELS.items():
        print(f"-- {name}, bf16", flush=True)
        failed += check_shapes(cases, lambda lens, s_q, h, seed: make_case(lens, s_q, h, torch.bfloat16, seed),
                               lambda *a, gk=gk: run(*a, gk=gk), lambda kv: kv.double())
        print(f"-- {name}, FP8", flush=True)
        failed += check_shapes(cases, make_fp8_case, lambda *a, gk=gk: run(*a, gk=gk),
                               lambda kv: fp8_format.dequantize(kv).double())
        print(f"-- {name}, FP8 dequantized by the compute warpgroups (in place)", flush=True)
        failed += check_shapes(cases, make_fp8_case,
                               lambda *a, gk=gk: run(*a, gk=gk, dequant_warpgroup=False),
                               lambda kv: fp8_format.dequantize(kv).double())
    return failed


def timings() -> None:
    copy_bytes = 256 << 20
    shapes = [(128, 1, 16, s_k) for s_k in (4096, 8192, 32768)] + [(128, 2, 8, 8192)]
    shapes += [(b, 1, 16, 32768) for b in (1, 4, 16)]
    shapes += [(128, 1, 32, s_k) for s_k in (4096, 32768)] + [(128, 2, 16, 8192), (4, 1, 32, 32768)]
    if os.environ.get("NARROW_SHAPES"):   # e.g. "b128 s_q1 h16 s_k8192,b4 s_q1 h16 s_k32768"
        want = os.environ["NARROW_SHAPES"].split(",")
        shapes = [sh for sh in shapes if "b{} s_q{} h{} s_k{}".format(*sh) in want]
    for b, s_q, h, s_k in shapes:
        pages = b * s_k // 64
        n = 1 if POOL else max(1, min(8, -(-copy_bytes // (pages * 64 * 576 * 2))))
        sets = []
        for _ in range(n):
            kv16 = torch.randn(pages, 64, 576, device="cuda", dtype=torch.bfloat16)
            sets.append((torch.randn(b, s_q, h, 576, device="cuda", dtype=torch.bfloat16), kv16,
                         ops.quantize_kv_fp8(kv16),
                         (torch.randint(0, POOL, (b, pages // b), device="cuda", dtype=torch.int32) if POOL else
                          torch.randperm(pages, device="cuda", dtype=torch.int32).view(b, -1)),
                         torch.full((b,), s_k, device="cuda", dtype=torch.int32)))
        tl = {fp8: replace(tk.default_config(s_q * h, fp8), gluon=False) for fp8 in (False, True)}
        res = {}
        for name in (*KERNELS, "tl"):
            for kind in (VARIANTS if name in KERNELS else ("bf16", "fp8")):
                fp8 = kind != "bf16"
                opts = {"dequant_warpgroup": False} if kind == "fp8:inline" else {}

                def step():
                    for q, kv16, kv8, table, seqlens in sets:
                        kv = kv8 if fp8 else kv16
                        if name in KERNELS:
                            run(q, kv, table, seqlens, gk=KERNELS[name], **opts)
                        else:
                            tk.mla_decode(q, kv, table, seqlens, SCALE, config=tl[fp8])
                step()
                torch.cuda.synchronize()
                res[f"{name}-{kind}"] = triton.testing.do_bench_cudagraph(step, rep=100) * 1e3 / n
        first = next(iter(KERNELS))
        print(f"b{b} s_q{s_q} h{h} s_k{s_k}: " + "  ".join(f"{k} {v:7.1f} us" for k, v in res.items())
              + f"  | {first}-bf16 vs tl-bf16 {res['tl-bf16'] / res[first + '-bf16']:.2f}x"
              + "".join(f"  {k} vs {first}-bf16 {res[first + '-bf16'] / v:.2f}x" for k, v in res.items()
                        if k.split("-")[-1] != "bf16" and not k.startswith("tl")),
              flush=True)


if __name__ == "__main__":
    sys.exit(gluon_check.main(__doc__, check, timings))
