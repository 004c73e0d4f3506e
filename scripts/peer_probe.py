"""Run peers (or mlaserve's own backends) on one shape, once each, checked against the torch reference: for finding
where a library faults or hangs (run each case in its own process, under `timeout`, with CUDA_LAUNCH_BLOCKING=1), or
which one writes where it should not (several backends in one process, in the order given, as the benchmark runs
them; under compute-sanitizer's memcheck).

    python3 scripts/peer_probe.py flashmla "dense 2 1 256 16 bf16" "sparse decode 2 1 4096 128 fp8"
    python3 scripts/peer_probe.py --time flashmla "dense 128 1 4096 128 bf16"   # then as the benchmark times it:
                                                                 # CUDA graphs, do_bench, the L2 cleared each call
    python3 scripts/peer_probe.py --time cutedsl,flashmla "dense 128 1 4096 16 bf16"

A case: "dense B S_Q S_K H KV [var]" or "sparse PHASE B S_Q S_KV H KV [TOPK]". Prints one PASS / FAIL / SKIP line a
case and backend, and a CHANGED line where a backend's calls changed the inputs that all of them share (q, the cache,
the block table, the lengths: compared bit for bit with copies taken before the first backend ran).
"""

import sys
import time

import torch

from mlaserve.bench import kernels as bench_kernels
from mlaserve.bench import limits, runners
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
    names, cases = argv[0].split(","), argv[1:]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bad = 0
    for case in cases:
        shape = parse(case)
        make = make_dense if isinstance(shape, DenseShape) else make_sparse
        inputs = make(shape, device, 0, 0)
        subset = runners.pick_subset(shape.b, shape.s_q, device)
        ref = runners.reference(shape, inputs, subset)
        shared = _shared_tensors(inputs)
        before = {k: t.clone() for k, t in shared.items()}
        for name in names:
            bad += _probe(name, shape, case, inputs, subset, ref, device, timed)
            _sync(device)
            changed = [k for k, t in shared.items() if not _same_bits(t, before[k])]
            if changed:
                bad += 1
                print(f"CHANGED {case}: after {name}: {', '.join(changed)}", flush=True)
    return 1 if bad else 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _shared_tensors(inputs) -> dict[str, torch.Tensor]:
    """The tensors every backend reads and none may write, by name."""
    out = {}
    for field in ("q", "kv"):
        for i, t in enumerate(getattr(inputs, field, [])):
            out[f"{field}[{i}]"] = t
    paging = getattr(inputs, "paging", None)
    if paging is not None:
        out["block_table"], out["seqlens"] = paging.block_table, paging.seqlens
    indices = getattr(inputs, "indices", None)
    if indices is not None:
        out["indices"] = indices
    return out


def _probe(name: str, shape, case: str, inputs, subset, ref, device, timed: bool) -> int:
    """One backend's first call on the case, checked (and timed as the benchmark times it): 1 when it failed."""
    reason = bench_kernels.unavailable_reason(name, shape.suite, device)
    if reason is not None:
        print(f"SKIP {name}: {reason}")
        return 0
    try:
        prepared = bench_kernels.prepare(name, shape, inputs)
    except runners.Unsupported as e:
        print(f"SKIP {name} {case}: {e}")
        return 0
    t0 = time.perf_counter()
    result = prepared.calls[0]()
    _sync(device)
    took = time.perf_counter() - t0
    want = ref if prepared.reference is None else prepared.reference(subset)
    chk = runners.check(shape, runners.take_subset(shape, result, subset), want)
    print(f"{'PASS' if chk['ok'] else 'FAIL'} {name} {case}: first call {took * 1e3:.1f} ms, "
          f"rel {chk.get('rel_err')}, lse {chk.get('lse_err')} {chk.get('reason', '')}", flush=True)
    if timed:
        replays = limits.capture_graphs(prepared.calls)
        print(f"  captured: {replays is not None}", flush=True)
        us = limits.time_us(replays or prepared.calls, device)
        _sync(device)
        print(f"  timed: {us:.1f} us", flush=True)
    return int(not chk["ok"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
