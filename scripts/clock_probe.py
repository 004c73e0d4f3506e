"""Backends' calls on one shape run back to back as the benchmark times them (the L2 cleared before each call), with
the GPU's SM clock and power read through NVML meanwhile: whether a kernel's time under sustained load differs from a
single call's because the clock drops under it (power), or for a reason of its own.

    python3 scripts/clock_probe.py --shape "b128 h128 sk4096" --backends cutedsl,flashmla --seconds 3

Per backend: the median time of a call, the SM clock and board power (medians of samples every 10 ms), and a single
call's time after a second of idle.
"""

import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mlaserve.bench import limits  # noqa: E402
from scripts.ncu_profile import prepare  # noqa: E402


def sample_nvml(stop: threading.Event, out: list) -> None:
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    while not stop.is_set():
        out.append((pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                    pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0))
        time.sleep(0.01)


def timed_calls(fn, flush: torch.Tensor, seconds: float) -> list[float]:
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        batch = []
        for _ in range(20):
            flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            batch.append((a, b))
        torch.cuda.synchronize()
        times += [a.elapsed_time(b) * 1e3 for a, b in batch]
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="b128 h128 sk4096")
    ap.add_argument("--backends", default="cutedsl,flashmla")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    for backend in args.backends.split(","):
        prepared = prepare(backend, args.shape, dev, 0)
        prepared.calls[0]()
        replay = (limits.capture_graphs(prepared.calls[:1]) or prepared.calls[:1])[0]
        torch.cuda.synchronize()
        time.sleep(1.0)
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        torch.cuda.synchronize()
        single = a.elapsed_time(b) * 1e3
        samples: list = []
        stop = threading.Event()
        sampler = threading.Thread(target=sample_nvml, args=(stop, samples))
        sampler.start()
        times = timed_calls(replay, flush, args.seconds)
        stop.set()
        sampler.join()
        late = samples[len(samples) // 3:]          # past the first third: the clock has settled
        clock = statistics.median(s[0] for s in late) if late else float("nan")
        power = statistics.median(s[1] for s in late) if late else float("nan")
        print(f"{backend:10s} {args.shape}: sustained {statistics.median(times[len(times) // 3:]):8.1f} us "
              f"(first calls {statistics.median(times[:10]):8.1f}), single after idle {single:8.1f} us, "
              f"SM clock {clock:.0f} MHz, power {power:.0f} W, {len(times)} calls", flush=True)
        del prepared, replay
        torch.cuda.empty_cache()
        time.sleep(2.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
