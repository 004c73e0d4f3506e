"""Diagnosis of the persistent CuTe decode's bimodal times (bench/NOTES.md 53).

1. Timing, interleaved in one process and timed as `mlaserve bench kernels` times them: the default launch (every
   cluster slot of the GPU, cluster c's first item is item c) against 2 and 6 fewer clusters and against the
   ordinary grid; each shape on --sets input sets allocated at different addresses (the bimodality showed from
   process to process, with the same inputs at other addresses).
2. Traces (--trace): each item's SM, start and end (globaltimer ns, SM clock) and the clocks of its phases from
   eager launches (mla_decode.TRACE), summarized per launch: span, how late the clusters start, item times, the SM
   clock rate, gaps between a cluster's items, how long SMs sit idle at the end; then the phases of an item in
   thousands of SM clocks (medians). Raw traces go to $OUT/traces.pt.

On the H200 (bench/NOTES.md 54) the bimodal times were the SM clock: 1350-1720 MHz from launch to launch, the
cycles per item within 2%.

    python scripts/persistent_clusters_ab.py --trace
"""

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mlaserve.bench import inputs as bench_inputs  # noqa: E402
from mlaserve.bench import runners  # noqa: E402
from mlaserve.bench.limits import capture_graphs, time_us  # noqa: E402
from mlaserve.bench.shapes import DenseShape  # noqa: E402

cd = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
DEFAULT = cd.persistent_clusters
SK_MIN_TILES = cd.STREAM_K_MIN_TILES
SHAPES = ((128, 2, 32768, 64), (128, 1, 32768, 128), (128, 1, 16384, 128), (128, 2, 4096, 128), (128, 1, 4096, 128))
VARIANTS = ("all", "minus2", "minus6", "grid", "store4", "grid-store4", "tickets", "sk")
FIELDS = cd.TRACE_FIELDS
# mla_decode_kernel.T_*: SM, ns start / end, clock start / end, per consumer w at 5 + 4w: Q ready, first own tile
# done, own tiles done, epilogue start; the producer's hand-over, Q load issued, first page issued
SM, NS0, NS1, C0, C1, Q, FIRST, LOOP, EPI, PUB, QLOAD, PAGE0, SUMS = 0, 1, 2, 3, 4, 5, 6, 7, 8, 13, 14, 15, 16


def use(variant: str) -> None:
    """Set the module's launch choice (read at launch, so captured with each graph); "store4": O stored in the
    accumulator's 4-byte pairs (mla_decode.STORE_16B off); "tickets": whole items from the ticket counter; "sk":
    the stream-K schedule wherever a launch is persistent (mla_decode.stream_k_pays' threshold 0)."""
    cd.PERSISTENT = not variant.startswith("grid")
    cd.STORE_16B = not variant.endswith("store4")
    cd.STREAM_K = variant != "tickets"
    cd.STREAM_K_MIN_TILES = 0 if variant == "sk" else SK_MIN_TILES
    fewer = {"minus2": 2, "minus6": 6}.get(variant, 0)
    cd.persistent_clusters = (lambda *a: max(DEFAULT(*a) - fewer, 0) if DEFAULT(*a) else 0) if fewer else DEFAULT


def max_active_clusters(size: int) -> int:
    """The driver's count of co-resident clusters of `size` CTAs (the DSL's HardwareInfo)."""
    hw = importlib.import_module("cutlass.utils").HardwareInfo(torch.cuda.current_device())
    return hw.get_max_active_clusters(size)


def _rows(trace: torch.Tensor) -> torch.Tensor:
    """The trace's rows that an item or piece wrote (its end time set)."""
    t = trace[2:].view(-1, FIELDS).to(torch.int64)
    return t[t[:, NS1] != 0]


def summarize(trace: torch.Tensor) -> str:
    """One line about one traced launch: [items (stream-K: pieces) x cluster, FIELDS] int32 (SM, t0 ns, t1 ns, c0,
    c1); rows no piece wrote (stream-K's room for more pieces than it cut) left out."""
    t = _rows(trace)
    sm, t0, t1, c0, c1 = t[:, :5].unbind(1)
    base = t0.min()
    t0, t1 = (t0 - base) % (1 << 32), (t1 - base) % (1 << 32)     # globaltimer_lo wraps every 4.3 s
    dur = (t1 - t0).double()
    mhz = ((c1 - c0) % (1 << 32)).double() / dur * 1e3
    span = t1.max().item()
    firsts, idle_end, gaps = [], [], []
    for s in sm.unique().tolist():
        on = (sm == s).nonzero().flatten()
        order = on[t0[on].argsort()]
        firsts.append(t0[order[0]].item())
        idle_end.append(span - t1[order[-1]].item())
        gaps += (t0[order[1:]] - t1[order[:-1]]).tolist()
    firsts = torch.tensor(firsts, dtype=torch.float64)
    idle_end = torch.tensor(idle_end, dtype=torch.float64)
    gap = torch.tensor(gaps or [0], dtype=torch.float64)
    return (f"span {span / 1e3:7.1f} us  SMs {len(firsts)}  first start med/max {firsts.median() / 1e3:5.1f}/"
            f"{firsts.max() / 1e3:6.1f} us (>10us late: {(firsts > 1e4).sum().item()})  item us min/med/max "
            f"{dur.min() / 1e3:6.1f}/{dur.median() / 1e3:6.1f}/{dur.max() / 1e3:6.1f}  MHz min/med/max "
            f"{mhz.min():4.0f}/{mhz.median():4.0f}/{mhz.max():4.0f}  gap med/max {gap.median() / 1e3:4.1f}/"
            f"{gap.max() / 1e3:5.1f} us  idle at end med/max {idle_end.median() / 1e3:6.1f}/{idle_end.max() / 1e3:6.1f} us")


def phases(trace: torch.Tensor) -> str:
    """An item's phases (medians over the items and CTAs that are not an SM's first, in thousands of SM clocks,
    relative to the consumers' start)."""
    t = _rows(trace)
    later = torch.ones(len(t), dtype=torch.bool)
    for s in t[:, SM].unique():
        on = (t[:, SM] == s).nonzero().flatten()
        later[on[((t[on, NS0] - t[:, NS0].min()) % (1 << 32)).argmin()]] = False
    t = t[later]

    def before(a: int, b: int) -> float:     # how long a came before b (negative: after); clocks wrap at 2^32
        d = (t[:, b] - t[:, a]) % (1 << 32)
        d = torch.where(d >= 1 << 31, d - (1 << 32), d)
        return d.double().median().item() / 1e3

    def since(a: int, b: int) -> float:      # how long after b a came (negative: before)
        return before(b, a) if (t[:, a] != 0).any() else -1.0
    parts = [f"{len(t)} later items: item {since(C1, C0):6.1f}"]
    for w in (0, 1):
        o = 4 * w
        parts.append(f"c{w}: Q {since(Q + o, C0):5.2f} first {since(FIRST + o, Q + o):5.2f} loop "
                     f"{since(LOOP + o, Q + o):6.1f} tail {since(EPI + o, LOOP + o):5.2f}")
    parts.append(f"epilogue c0 {since(C1, EPI):5.2f} (sums {since(SUMS, EPI):5.2f})  producer: hand-over {before(PUB, C0):5.2f} before, Q load "
                 f"{before(QLOAD, C0):5.2f} before, page 0 {before(PAGE0, C0):5.2f} before the start")
    return "  ".join(parts)


def epilogues_by_place(trace: torch.Tensor) -> str:
    """Consumer 0's epilogue (thousands of SM clocks, medians) of each SM's first piece, its middle ones and its
    last: in a stream-K launch the first is a cut item's continuation (it writes its partial) and the last its
    first piece (it merges), where whole items have the plain epilogue."""
    t = _rows(trace)
    epi = ((t[:, C1] - t[:, EPI]) % (1 << 32)).double() / 1e3
    first, middle, last = [], [], []
    for s in t[:, SM].unique():
        on = (t[:, SM] == s).nonzero().flatten()
        on = on[((t[on, NS0] - t[:, NS0].min()) % (1 << 32)).argsort()]
        first.append(epi[on[0]])
        middle += epi[on[1:-1]].tolist()
        last.append(epi[on[-1]])
    med = lambda x: torch.tensor(x or [float("nan")], dtype=torch.float64).median().item()  # noqa: E731
    return f"epilogue of an SM's first / middle / last piece {med(first):5.2f} / {med(middle):5.2f} / {med(last):5.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", type=int, default=2, help="input sets per shape, at different addresses")
    ap.add_argument("--trace", action="store_true", help="also trace eager launches (static and dynamic first)")
    ap.add_argument("--shapes", default="", help="indices into SHAPES, comma-separated (default: all)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="launches to time, comma-separated")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "SMs",
          torch.cuda.get_device_properties(dev).multi_processor_count, flush=True)
    torch.zeros(1, device=dev)     # the primary context, current on this thread: the driver query needs it
    try:
        print("max active clusters of 1 / 2 CTAs (driver):", max_active_clusters(1), max_active_clusters(2),
              flush=True)
    except RuntimeError as e:
        print("max active clusters: the driver query failed:", e, flush=True)
    traces = {}
    gen = torch.Generator().manual_seed(1)
    variants = args.variants.split(",")
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    for b, s_q, s_k, h in shapes:
        shape = DenseShape(b, s_q, s_k, h, "bf16")
        for rep in range(args.sets):
            # a pad of random size first, so that each set's pages land at other addresses
            pad = torch.empty(int(torch.randint(1, 1 << 30, (1,), generator=gen)), dtype=torch.uint8, device=dev)
            inputs = bench_inputs.make_dense(shape, dev, seed=b + h + rep, rotate_bytes=256 << 20)
            prep = runners.prepare_ops("cutedsl", shape, inputs)
            graphs = {}
            for v in variants:
                use(v)
                for call in prep.calls:
                    call()
                torch.cuda.synchronize()
                graphs[v] = capture_graphs(prep.calls)
            use("all")
            reference = prep.calls[0]()[0]
            times = {v: [] for v in variants}
            for _ in range(3):
                for v, g in graphs.items():
                    times[v].append(time_us(g, dev))
            differ = []
            for v in variants:
                use(v)
                if not torch.equal(reference, prep.calls[0]()[0]):
                    differ.append(v)
            use("all")
            print(f"{shape.key:24s} set {rep} " + "  ".join(f"{v} {min(t):7.1f}" for v, t in times.items())
                  + " us" + (f"  OUTPUTS DIFFER: {differ}" if differ else ""), flush=True)
            if args.trace:
                cd.TRACE = True
                for v in ("tickets", "sk"):
                    use(v)
                    prep.calls[0]()
                    for i in range(2):
                        prep.calls[0]()
                        torch.cuda.synchronize()
                        trace = traces[f"{shape.key} set {rep} {v} {i}"] = cd.last_trace.cpu()
                        print(f"  trace {v} {i}: {summarize(trace)}\n    {phases(trace)}\n    "
                              f"{epilogues_by_place(trace)}", flush=True)
                cd.TRACE = False
                use("all")
            del graphs, prep, inputs, pad
            torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out and traces:
        torch.save(traces, os.path.join(out, "traces.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
