"""What bounds a decode kernel: its time per page when the pages come from HBM against when they come from L2.

    python scripts/chain_rate.py                 # triton backend's default kernels, bf16 and FP8 KV
    python scripts/chain_rate.py --pool 256      # the L2 case draws every block-table entry from 256 pages

Each shape runs twice on the same kernel and plan: "hbm", every request on its own random pages (what the
benchmark times), and "l2", every block-table entry drawn from a pool of --pool pages, so that after the first
touch the pages come from L2 and the time is the kernel's own per-page chain (issue, latency, smem). When the
two times are close the kernel is chain-bound and more bandwidth would not help; when "l2" is much faster it
is bandwidth-bound. Printed per shape: microseconds per call and per page per program (pages each program
streams = s_k / 64 / splits, programs in one wave). CUDA-graph replay, as scripts/gluon_narrow_check.py times.
"""

import argparse
import importlib

import torch
import triton

from mlaserve import ops

tk = importlib.import_module("mlaserve.kernels.triton.mla_decode")


def time_case(b, s_q, h, s_k, fp8, pool, pages_total):
    torch.manual_seed(0)
    n_pages = b * s_k // 64
    kv16 = torch.randn(pages_total, 64, 576, device="cuda", dtype=torch.bfloat16)
    kv = ops.quantize_kv_fp8(kv16) if fp8 else kv16
    q = torch.randn(b, s_q, h, 576, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.full((b,), s_k, device="cuda", dtype=torch.int32)
    plan = tk.plan_mla_decode(b, s_q, h, 512, s_k // 64, 64, fp8, q.device)
    res = {}
    for mode in ("hbm", "l2"):
        if mode == "hbm":
            table = torch.randperm(pages_total, device="cuda", dtype=torch.int32)[:n_pages].view(b, -1)
        else:
            table = torch.randint(0, pool, (b, s_k // 64), device="cuda", dtype=torch.int32)
        step = lambda: tk.mla_decode(q, kv, table, seqlens, 576 ** -0.5, plan=plan)
        step()
        torch.cuda.synchronize()
        res[mode] = triton.testing.do_bench_cudagraph(step, rep=100) * 1e3
    per_prog = s_k // 64 / plan.num_splits
    cfg = plan.config
    kind = ("gluon-narrow" if cfg.block_h in (16, 32) else "gluon") if cfg.gluon else "tl"
    print(f"b{b} s_q{s_q} h{h} s_k{s_k} {'fp8 ' if fp8 else 'bf16'} {kind:12s} splits {plan.num_splits:3d}: "
          f"hbm {res['hbm']:8.1f} us ({res['hbm'] / per_prog:5.2f} us/page)  "
          f"l2 {res['l2']:8.1f} us ({res['l2'] / per_prog:5.2f} us/page)  hbm/l2 {res['hbm'] / res['l2']:.2f}",
          flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", type=int, default=256)
    ap.add_argument("--s-k", type=int, default=16384)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for h, s_q in ((16, 1), (32, 1), (64, 1), (128, 1)):
        for fp8 in (False, True):
            time_case(128, s_q, h, args.s_k, fp8, args.pool, 128 * args.s_k // 64)


if __name__ == "__main__":
    main()
