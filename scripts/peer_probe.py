"""Run one peer on one shape, once, checked against the torch reference: for finding where a peer library faults or
hangs (run each case in its own process, under `timeout`, with CUDA_LAUNCH_BLOCKING=1).

    python3 scripts/peer_probe.py flashmla "dense 2 1 256 16 bf16" "sparse decode 2 1 4096 128 fp8"
    python3 scripts/peer_probe.py --time flashmla "dense 128 1 4096 128 bf16"   # then as the benchmark times it:
                                                                 # CUDA graphs, do_bench, the L2 cleared each call

A case: "dense B S_Q S_K H KV [var]" or "sparse PHASE B S_Q S_KV H KV [TOPK]". Prints one PASS / FAIL / SKIP line a case.
"""

import sys
import time

import torch

from mlaserve.bench import limits, peers, runners
from mlaserve.bench.inputs import make_dense, make_sparse
from mlaserve.bench.shapes import DenseShape, SparseShape


def parse(case: str):
    f = case.split()
    if f[0] == "dense":
        return DenseShape(int(f[1]), int(f[2]), int(f[3]), int(f[4]), f[5], varlen=len(f) > 6 and f[6] == "var")
    topk = int(f[7]) if len(f) > 7 else 2048
    return SparseShape(f[1], int(f[2]), int(f[3]), int(f[4]), int(f[5]), topk=topk, kv=f[6])


def main(argv) -> int:
    timed = argv[:1] == ["--time"]
    argv = argv[1:] if timed else argv
    name, cases = argv[0], argv[1:]
    device = torch.device("cuda")
    reason = peers.unavailable_reason(name, device)
    if reason is not None:
        print(f"SKIP {name}: {reason}")
        return 0
    bad = 0
    for case in cases:
        shape = parse(case)
        make = make_dense if isinstance(shape, DenseShape) else make_sparse
        inputs = make(shape, device, 0, 0)
        subset = runners.pick_subset(shape.b, shape.s_q, device)
        ref = runners.reference(shape, inputs, subset)
        try:
            prepared = peers.prepare(name, shape, inputs)
        except runners.Unsupported as e:
            print(f"SKIP {case}: {e}")
            continue
        t0 = time.perf_counter()
        result = prepared.calls[0]()
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
        want = ref if prepared.reference is None else prepared.reference(subset)
        chk = runners.check(shape, runners.take_subset(shape, result, subset), want)
        bad += not chk["ok"]
        print(f"{'PASS' if chk['ok'] else 'FAIL'} {case}: first call {took * 1e3:.1f} ms, rel {chk.get('rel_err')}, "
              f"lse {chk.get('lse_err')} {chk.get('reason', '')}", flush=True)
        if timed:
            replays = limits.capture_graphs(prepared.calls)
            print(f"  captured: {replays is not None}", flush=True)
            us = limits.time_us(replays or prepared.calls, device)
            torch.cuda.synchronize()
            print(f"  timed: {us:.1f} us", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
