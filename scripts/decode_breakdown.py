"""Where a decode call's time goes: its kernels one by one (CUDA profiler), beside the call timed as
`mlaserve bench kernels` times it (CUDA-graph replay, L2 cleared before each call, median).

    python scripts/decode_breakdown.py                                   # cutedsl, flashinfer, triton at b4 h128
    python scripts/decode_breakdown.py --backends cutedsl,flashinfer --shapes "b4 h128,b128 h128 sk8192"

Shapes: "bB hH [sqN] [skS] [var]" (s_q 1, s_k 32768, fixed lengths unless given), bf16 KV unless "fp8" is a word.
Per (shape, backend): the graph-replay time, then each kernel's mean duration in the profiled replays (L2
cleared before each, as in the timing), their sum, and the replay time left over (launch gaps, idle GPU).
"""

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mlaserve.bench import inputs as bench_inputs  # noqa: E402
from mlaserve.bench import peers, runners  # noqa: E402
from mlaserve.bench.limits import capture_graphs, time_us  # noqa: E402
from mlaserve.bench.shapes import DenseShape  # noqa: E402
from mlaserve.ops.registry import BACKENDS  # noqa: E402

ROTATE_BYTES = 256 << 20


def parse_shape(spec: str) -> DenseShape:
    words = spec.split()
    b, h = int(words[0][1:]), int(words[1][1:])
    s_q = next((int(w[2:]) for w in words if w.startswith("sq")), 1)
    s_k = next((int(w[2:]) for w in words if w.startswith("sk")), 32768)
    return DenseShape(b, s_q, s_k, h, "fp8" if "fp8" in words else "bf16", varlen="var" in words)


def kernel_times(replays, device, reps: int) -> tuple[dict[str, float], float]:
    """Mean µs per replay of each kernel name (L2 cleared before each replay, its kernel left out)."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    for r in replays:
        r()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            flush.zero_()
            replays[i % len(replays)]()
        torch.cuda.synchronize()
    total = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and "elementwise" not in ev.name \
                and "fill" not in ev.name.lower():
            total[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return {name: us / reps for name, us in total.items()}, sum(total.values()) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="cutedsl,flashinfer,triton")
    ap.add_argument("--shapes", default="b4 h128")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for spec in args.shapes.split(","):
        shape = parse_shape(spec)
        inputs = bench_inputs.make_dense(shape, dev, seed=shape.b + shape.h, rotate_bytes=ROTATE_BYTES)
        for name in args.backends.split(","):
            try:
                prep = runners.prepare_ops(name, shape, inputs) if name in BACKENDS else peers.prepare(name, shape,
                                                                                                       inputs)
                for call in prep.calls:
                    call()
                torch.cuda.synchronize()
                replays = capture_graphs(prep.calls)
                if replays is None:
                    print(f"{spec} {name}: not capturable, skipped", flush=True)
                    continue
                us = time_us(replays, dev)
                per_kernel, summed = kernel_times(replays, dev, args.reps)
            except Exception as e:   # one backend failing should not lose the others' lines
                print(f"{spec} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            print(f"{spec} [{shape.kv}] {name}: replay {us:.1f} us; kernels {summed:.1f} us; left over "
                  f"{us - summed:.1f} us", flush=True)
            for kname, kus in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
                print(f"    {kus:8.1f} us  {kname[:110]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
