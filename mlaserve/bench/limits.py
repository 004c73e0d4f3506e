"""The GPU's two ceilings, measured in the same run as the kernels they judge, and the timer.

Copy bandwidth: a 2 GiB device-to-device copy, counting bytes read plus bytes written.
Matrix rate: an 8192^3 bf16 matmul on random data (zeros run faster and would flatter the kernels).
Both are medians of `triton.testing.do_bench`, which clears the L2 before every timed call.
"""

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

COPY_BYTES = 2 << 30
MATMUL_N = 8192


@dataclass(frozen=True)
class Limits:
    copy_tbps: float | None       # TB/s, read + written bytes
    matmul_tflops: float | None   # bf16 dense, random data
    note: str

    def as_dict(self) -> dict:
        return {"copy_tbps": self.copy_tbps, "matmul_tflops": self.matmul_tflops, "note": self.note}


def time_us(fns: list[Callable[[], object]], device: torch.device, warmup_ms: float = 10,
            rep_ms: float = 50) -> float:
    """Median time of one call in µs, rotating among `fns` (one per input set, so L2 never holds the inputs).

    CUDA: `triton.testing.do_bench` (events around each call, L2 cleared before each). CPU: wall clock
    over a few calls, so that the CPU test exercises the same path.
    """
    calls = [0]

    def fn():
        f = fns[calls[0] % len(fns)]
        calls[0] += 1
        return f()

    if device.type == "cuda":
        import triton.testing
        return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 20):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def interleaved_us(runs: dict[str, list[Callable[[], object]]], device: torch.device, rounds: int = 30,
                   flush_bytes: int = 256 << 20, sustain_ms: float = 0) -> dict[str, list[float]]:
    """Each run's time of one call in µs per round: the runs take turns, one call each a round (rotating among a
    run's calls, one per input set), the order rotating from round to round.

    On the H200 the SM clock moves by up to ±10% from launch to launch (bench/NOTES.md 54), so two configs timed
    one after the other can differ by more than what is being measured; in turns, each round's calls run at
    about the same clock, and the median over rounds of a run's time divided by another's (`ratio_median`)
    compares them. CUDA: L2 cleared before each call, events around it; CPU: wall clock.

    sustain_ms > 0: each turn is `time_us` over back-to-back calls instead (sustain_ms of warm-up, then as
    long again timed, as `bench kernels` times), so that the GPU runs at the clock its power limit holds under
    load rather than at the higher one a single call after a pause gets.
    """
    names = list(runs)
    times: dict[str, list[float]] = {k: [] for k in names}
    if sustain_ms > 0:
        for r in range(rounds):
            for k in names[r % len(names):] + names[:r % len(names)]:
                times[k].append(time_us(runs[k], device, sustain_ms, sustain_ms))
        return times
    cuda = device.type == "cuda"
    flush = torch.empty(flush_bytes, dtype=torch.int8, device=device) if cuda else None
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        marks = []
        for k in order:
            fn = runs[k][r % len(runs[k])]
            if cuda:
                flush.zero_()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                marks.append((k, e0, e1))
            else:
                t0 = time.perf_counter()
                fn()
                times[k].append(1e6 * (time.perf_counter() - t0))
        if cuda:
            torch.cuda.synchronize()
            for k, e0, e1 in marks:
                times[k].append(1e3 * e0.elapsed_time(e1))
    return times


def ratio_median(times: dict[str, list[float]], run: str, base: str) -> float:
    """The median over rounds of run's time / base's time (interleaved_us's rounds)."""
    return statistics.median(a / b for a, b in zip(times[run], times[base]))


def ratio_quartiles(times: dict[str, list[float]], run: str, base: str) -> tuple[float, float]:
    """The first and third quartiles over rounds of run's time / base's time: the spread of ratio_median's rounds,
    by which an A/B's effect can be told from its noise (a single round: that round's ratio twice)."""
    ratios = sorted(a / b for a, b in zip(times[run], times[base]))
    if len(ratios) < 2:
        return ratios[0], ratios[0]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q1, q3


def capture_graphs(fns: list[Callable[[], object]]) -> list[Callable[[], object]] | None:
    """Each call captured in its own CUDA graph, as replays; None when a call cannot be captured.

    Timing replays takes the host's launch cost out of the numbers, as a server that captures its
    decode step sees it (METHOD.md: many small launches are timed through graph replay). Calls must
    be warm (compiled, planned) before this.
    """
    replays = []
    side = torch.cuda.Stream()
    for fn in fns:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()                                   # allocations of the call come from the side stream first
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except Exception:   # a host sync or an uncapturable op: the caller times the calls eagerly instead
            torch.cuda.synchronize()
            return None
        replays.append(graph.replay)
    return replays


def measure(device: torch.device, rep_ms: float = 100) -> Limits:
    """Copy bandwidth and bf16 matmul rate of `device`; on a CPU nothing is measured (and the note says so)."""
    if device.type != "cuda":
        return Limits(None, None, f"not measured: no CUDA device (ran on {device.type}); ratios to limits omitted")
    gen = torch.Generator(device=device).manual_seed(0)
    src = torch.randn(COPY_BYTES // 2, dtype=torch.bfloat16, device=device, generator=gen)
    dst = torch.empty_like(src)
    copy_us = time_us([lambda: dst.copy_(src)], device, rep_ms=rep_ms)
    del src, dst
    a = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=device, generator=gen)
    b = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=device, generator=gen)
    mm_us = time_us([lambda: a @ b], device, rep_ms=rep_ms)
    del a, b
    torch.cuda.empty_cache()
    return Limits(copy_tbps=2 * COPY_BYTES / copy_us / 1e6, matmul_tflops=2 * MATMUL_N ** 3 / mm_us / 1e6,
                  note=f"copy: {COPY_BYTES >> 30} GiB device-to-device, read+written bytes; "
                       f"matmul: bf16 {MATMUL_N}^3 on random data; medians of triton.testing.do_bench")
