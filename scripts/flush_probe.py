"""What the benchmark's L2 clearing costs a timed decode call: the same CUDA-graph replay timed right after
clearing the L2 by writing a 256 MB buffer (as triton.testing.do_bench and `bench kernels` do: it leaves the L2
full of dirty lines, which are written back to HBM while the timed kernel reads), after clearing it by reading the
buffer (clean lines, nothing to write back), and with no clearing.

    python scripts/flush_probe.py --backend triton --shapes "b1 h128 sk32768,b128 h16 sk4096,b128 h16 sk4096 fp8"

Shapes as scripts/decode_ab.py reads them. Per shape: the median of --rounds interleaved rounds for each way, in
microseconds; write - read is what the write-back of the dirty lines adds to a call's time.
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mlaserve.bench import inputs as bench_inputs  # noqa: E402
from mlaserve.bench import runners  # noqa: E402
from mlaserve.bench.limits import capture_graphs  # noqa: E402
from scripts.decode_ab import parse_shape  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--shapes", default="b1 h128 sk32768,b1 h16 sk32768,b128 h16 sk4096,b128 h16 sk4096 fp8,"
                                        "b128 h16 sk32768,b128 h16 sk32768 fp8")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--flush-mb", type=int, default=256)
    args = ap.parse_args()
    dev = torch.device("cuda")
    flush = torch.ones(args.flush_mb << 20, dtype=torch.int8, device=dev)
    sink = torch.empty((), dtype=torch.int64, device=dev)
    ways = {"write": lambda: flush.zero_(), "read": lambda: torch.sum(flush, dim=0, dtype=torch.int64, out=sink),
            "none": lambda: None}
    print(torch.cuda.get_device_name(), "torch", torch.__version__, f"backend {args.backend}", flush=True)
    for spec in args.shapes.split(","):
        shape = parse_shape(spec)
        inputs = bench_inputs.make_dense(shape, dev, seed=0, rotate_bytes=256 << 20)
        prep = runners.prepare_ops(args.backend, shape, inputs)
        for call in prep.calls:
            call()
        torch.cuda.synchronize()
        replays = capture_graphs(prep.calls)
        times = {w: [] for w in ways}
        for r in range(args.rounds):
            marks = []
            for w, clear in ways.items():
                clear()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                replays[r % len(replays)]()
                e1.record()
                marks.append((w, e0, e1))
            torch.cuda.synchronize()
            for w, e0, e1 in marks:
                times[w].append(1e3 * e0.elapsed_time(e1))
        med = {w: statistics.median(v) for w, v in times.items()}
        print(f"{spec:28s} after a written flush {med['write']:8.1f} us  a read flush {med['read']:8.1f} us  "
              f"none {med['none']:8.1f} us  write - read {med['write'] - med['read']:6.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
