"""Time the KV split counts around the planner's choice at the small batches, for one MLA decode backend.

    python scripts/split_sweep.py --backend cutedsl     # the CuTe DSL kernel (mlaserve/kernels/cutedsl)
    python scripts/split_sweep.py --backend triton      # the Triton kernel (mlaserve/kernels/triton)
    python scripts/split_sweep.py --backend triton --fp8

b 1/4/16 x h 128/64/16 at s_k 32768 (bf16 KV unless --fp8), s_q 1, page 64: every count that puts 0.5 .. 3
waves of programs on the SMs (one program per SM as the wave unit), the counts that fill exactly one wave,
and the planner's, each timed by CUDA-graph replay (launch overhead would hide tens of microseconds here)
rotating among copies of q and the cache that together span 256 MB, so that, as in `mlaserve bench kernels`,
the 60 MB L2 never holds the KV a call reads (one b1 request of 32768 tokens is 37.7 MB).
One line per shape, `count:us` pairs, then the planner's pick and the best. Each count's output is checked
against the planner's (max abs difference <= 2e-2; splits only change the summation order).
"""

import argparse
import importlib
import itertools
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cutedsl_check import SCALE, make_case, make_fp8_case  # noqa: E402


def _backend(name: str):
    """(plan(b, s_q, h, max_pages, kv_fp8, device, num_splits) -> plan, decode(q, kv, table, seqlens, plan),
    programs per split(b, s_q, h, kv_fp8)) of the backend's kernel module."""
    if name == "cutedsl":
        mod = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
        plan_mod = mod
        block_h = lambda rows, kv_fp8: mod.TILE_M          # noqa: E731
        v_split = lambda rows, kv_fp8: 1                   # noqa: E731
    else:
        mod = importlib.import_module("mlaserve.kernels.triton.mla_decode")
        plan_mod = importlib.import_module("mlaserve.kernels.triton.mla_decode_plan")
        block_h = lambda rows, kv_fp8: plan_mod.default_config(rows, kv_fp8).block_h   # noqa: E731
        v_split = lambda rows, kv_fp8: plan_mod.default_config(rows, kv_fp8).v_split   # noqa: E731

    def plan(b, s_q, h, max_pages, kv_fp8, device, num_splits=None):
        return plan_mod.plan_mla_decode(b, s_q, h, 512, max_pages, 64, kv_fp8, device, num_splits=num_splits)

    def decode(q, kv, table, seqlens, p):
        return mod.mla_decode(q, kv, table, seqlens, SCALE, plan=p)

    def programs(b, s_q, h, kv_fp8):
        rows = s_q * h
        return b * math.ceil(rows / block_h(rows, kv_fp8)) * v_split(rows, kv_fp8)

    return plan, decode, programs


def sweep(backend: str, kv_fp8: bool) -> None:
    import triton.testing
    plan, decode, programs_of = _backend(backend)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for h in (128, 64, 16):
        for b in (1, 4, 16):
            s_k = 32768
            if kv_fp8:
                q, kv, table, seqlens = make_fp8_case([s_k] * b, 1, h, 0)
            else:
                q, kv, table, seqlens = make_case([s_k] * b, 1, h, torch.bfloat16, 0)
            programs = programs_of(b, 1, h, kv_fp8)
            chosen = plan(b, 1, h, table.shape[1], kv_fp8, q.device).num_splits
            counts = {chosen} | {max(1, min(128, round(k * sms / programs))) for k in (0.5, 0.75, 1, 1.5, 2, 3)}
            counts |= {n for n in range(1, 129) if programs * n in (sms - 4, sms, 2 * sms)}
            ref = decode(q, kv, table, seqlens, plan(b, 1, h, table.shape[1], kv_fp8, q.device))[0].float()
            copies = [(q, kv)] + [(q.clone(), kv.clone()) for _ in range(min(7, (256 << 20) // kv.nbytes))]
            times, worst = {}, 0.0
            for n in sorted(counts):
                p = plan(b, 1, h, table.shape[1], kv_fp8, q.device, num_splits=n)
                out = decode(q, kv, table, seqlens, p)[0]
                worst = max(worst, (out.float() - ref).abs().max().item())
                turn = itertools.cycle(copies)      # each captured call reads the next copy

                def call():
                    q_i, kv_i = next(turn)
                    return decode(q_i, kv_i, table, seqlens, p)
                times[n] = triton.testing.do_bench_cudagraph(call, rep=100) * 1e3
            best = min(times, key=times.get)
            print(f"splits {backend} {'fp8' if kv_fp8 else 'bf16'} b{b} h{h} s_k{s_k} programs {programs}: "
                  + "  ".join(f"{n}:{t:.1f}" for n, t in sorted(times.items()))
                  + f"  | planner {chosen} {times[chosen]:.1f} us, best {best} {times[best]:.1f} us"
                  + ("" if worst <= 2e-2 else f"  MISMATCH max abs diff {worst:.3g}"), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("cutedsl", "triton"), required=True)
    ap.add_argument("--fp8", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    sweep(args.backend, args.fp8)
    return 0


if __name__ == "__main__":
    sys.exit(main())
