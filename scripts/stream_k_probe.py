"""The stream-K persistent CuTe decode against the ticket launch (and FlashInfer): the schedule on the GPU against
its Python reference and the slots' costs, the schedule kernel alone, then CUDA-graph replays of the benchmark's
inputs timed in interleaved rounds.

    python scripts/stream_k_probe.py --shapes "b128 h128 sq2 sk4096,b128 h128 sk32768" --flashinfer
"""

import argparse
import importlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mlaserve.bench import inputs as bench_inputs  # noqa: E402
from mlaserve.bench import peers, runners  # noqa: E402
from mlaserve.bench.limits import capture_graphs, interleaved_us, ratio_median, time_us  # noqa: E402
from mlaserve.kernels.triton import stream_k  # noqa: E402
from scripts.decode_ab import parse_shape  # noqa: E402

cd = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
RULE_TILES = cd.STREAM_K_MIN_TILES


def rule(items: int, slots: int, max_pages: int) -> str:
    """What stream_k_pays picks at the module's threshold (the probe sets it to 0 to time stream-K everywhere)."""
    probe_tiles, cd.STREAM_K_MIN_TILES = cd.STREAM_K_MIN_TILES, RULE_TILES
    pays = cd.stream_k_pays(items, slots, max_pages)
    cd.STREAM_K_MIN_TILES = probe_tiles
    return "stream-k" if pays else "tickets"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="b128 h128 sq2 sk4096,b128 h128 sq2 sk8192,b128 h128 sq2 sk16384,"
                                        "b128 h128 sq2 sk32768,b128 h128 sk4096,b128 h128 sk8192,b128 h128 sk32768,"
                                        "b128 h64 sq2 sk4096,b128 h128 sq2 sk8192 var,b128 h128 sk4096 var")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--flashinfer", action="store_true", help="FlashInfer in the rounds too")
    args = ap.parse_args()
    dev = torch.device("cuda")
    cd.STREAM_K_MIN_TILES = 0     # stream-K timed everywhere; what the rule would take printed
    for spec in args.shapes.split(","):
        shape = parse_shape(spec)
        inputs = bench_inputs.make_dense(shape, dev, seed=shape.b + shape.h, rotate_bytes=256 << 20)
        prep = runners.prepare_ops("cutedsl", shape, inputs)
        rows = shape.s_q * shape.h
        cluster = cd.cluster_size(rows, False)
        slots = cd.persistent_clusters(shape.b, rows, False, False, cluster, dev)
        pairs = -(-rows // 64) // cluster
        lens = inputs.paging.seqlens
        got = stream_k.balanced_schedule(lens, pairs, slots, cd.STREAM_K_OVERHEAD).cpu().tolist()
        want = stream_k.reference_schedule(lens.cpu().tolist(), pairs, slots, cd.STREAM_K_OVERHEAD)
        tiles = stream_k.item_tiles(lens.cpu().tolist(), pairs)
        cost = [sum(hi - lo + cd.STREAM_K_OVERHEAD for _, lo, hi in p) for p in stream_k.pieces(want, slots, tiles)]
        print(f"{spec}: {slots} slots x {cluster} CTAs, {len(tiles)} items; schedule on GPU == reference: "
              f"{got == want}; slot cost max {max(cost)} min {min(cost)}; whole items "
              f"{-(-len(tiles) // slots)} rounds; the rule (>= {RULE_TILES} tiles) takes "
              f"{rule(len(tiles), slots, inputs.paging.block_table.shape[1])}", flush=True)
        cd.STREAM_K = False
        tickets = capture_graphs(prep.calls)
        out_t = prep.calls[0]()[0].float()
        cd.STREAM_K = True
        streamk = capture_graphs(prep.calls)
        out_s = prep.calls[0]()[0].float()
        sched_only = [lambda: stream_k.balanced_schedule(lens, pairs, slots, cd.STREAM_K_OVERHEAD,
                                                         flags=3 * slots * cluster)]
        sched_us = time_us(capture_graphs(sched_only), dev)
        runs = {"tickets": tickets, "stream-k": streamk}
        if args.flashinfer:
            fprep = peers.prepare("flashinfer", shape, inputs)
            for call in fprep.calls:
                call()
            runs["flashinfer"] = capture_graphs(fprep.calls)
        times = interleaved_us(runs, dev, args.rounds)
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = {k: ratio_median(times, k, "stream-k") for k in runs if k != "stream-k"}
        print(f"   schedule kernel {sched_us:.1f} us; interleaved medians ({args.rounds} rounds): "
              + "  ".join(f"{k} {v:.1f} us" for k, v in med.items())
              + "; median per-round ratio to stream-k: " + "  ".join(f"{k} {v:.3f}x" for k, v in ratio.items())
              + f"; max |stream-k - tickets| {(out_s - out_t).abs().max().item():.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
