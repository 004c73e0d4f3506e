"""Paged MLA decode for Hopper in CuTe DSL: host side (the kernels' switches, compile cache, launch).

The kernel (mla_decode_kernel.py) gives each CTA 64 query rows — heads and new tokens packed as
in the Triton kernel, row = token j * h + head — and one KV split of one request, with a TMA
producer warpgroup and two consumer warpgroups that take alternate tiles' QK and softmax and each
keep half of O (FlashMLA's "seesaw"; see its docstring for why). Splits are combined by the Triton
`combine_splits` (Triton runs wherever this kernel does), so there is one combine in the repo.

Checks and planning live in decode_plan.py. This module takes the planning names the `triton` attention
backend calls into its namespace (`plan_mla_decode`, `default_config`, `decode_config`, `choose_num_splits`,
`workspace_numel`), so the `cutedsl_mla` backend reuses that backend's planning and graph code on this module.

Supported here (anything else raises ValueError naming the values): q bf16/fp16 [b, s_q, h, 576]
with any s_q and h, KV in q's dtype [pages, 64, 576] or, with bf16 q, the FP8 format uint8
[pages, 64, 656] (at most 32 query rows a request with splits of >= 48 pages: the bytes turned into f16 in
registers, mla_decode_fp8_f16_kernel.py, keys on wgmma's M side; shorter splits: FP8 wgmma on the e4m3 bytes
at <= 16 rows when FP8_F16 is off, mla_decode_fp8_mma_kernel.py, else dequantized to bf16 in smem,
mla_decode_fp8_narrow_kernel.py; for more rows the bf16 seesaw consumers on a ring a loader warpgroup fills from
registers, mla_decode_fp8_seesaw_kernel.py), head_dim_v 512.
`nvidia-cutlass-dsl` is imported on the first launch only: checks and plans work without it.
"""

import importlib
import time

import torch
import triton

from mlaserve.kernels import fp8_format
from mlaserve.kernels.cutedsl.common import COMPILE_ADDRESS, cute_dtype, gmem_pointers
from mlaserve.kernels.cutedsl.decode_plan import (  # noqa: F401 (the planning names the triton backend calls)
    CONFIG, HEAD_DIM_V, PAGE_SIZE, TILE_M, check_supported, choose_num_splits, cluster_size, decode_config,
    default_config, plan_mla_decode, plan_num_splits, scheduler_counters, stream_k_buffers)
from mlaserve.kernels.triton.mla_decode_plan import MLADecodeConfig, MLADecodePlan, workspace_numel  # noqa: F401
from mlaserve.kernels.triton.mla_decode_plan import _num_sms
from mlaserve.kernels.triton import stream_k
from mlaserve.kernels.triton.work_order import grid_order, longest_first

_LOG2E = 1.4426950408889634

# seconds spent compiling each specialization, by compile key (dtype, causal, split, KV kind "16bit"/"fp8",
# CTAs per cluster)
compile_seconds: dict[tuple, float] = {}
_compiled: dict[tuple, object] = {}

# -- FP8 KV (the mla_decode_fp8_*_kernel.py kernels): uint8 [pages, 64, 656], bf16 q and out --

def _fp8_pointers(addresses, ordered: bool = False, split: bool = False) -> list:
    """The FP8 kernel's 9 pointers (q, kv as int32 words, k_pe as bf16 from byte 528, block_table, seqlens,
    out, lse, partial out, partial lse) from the tensors' 8 addresses (None: stand-ins for compiling).
    The k_pe pointer is kv + 528, still 16-byte aligned (TMA needs it). Ordered launches pass the requests'
    int32 order in partial out's place (unsplit) or lse's (split)."""
    cutlass = importlib.import_module("cutlass")
    q, kv, *rest = [COMPILE_ADDRESS if a is None else a for a in addresses]
    kinds = ((cutlass.BFloat16, 16), (cutlass.Int32, 16), (cutlass.BFloat16, 16), (cutlass.Int32, 4),
             (cutlass.Int32, 4), (cutlass.BFloat16, 16), (cutlass.Int32 if ordered and split else cutlass.Float32, 4),
             (cutlass.Int32, 4) if ordered and not split else (cutlass.Float32, 4), (cutlass.Float32, 4))
    return gmem_pointers(kinds, (q, kv, kv + fp8_format.ROPE_OFFSET, *rest))


PERSISTENT = True
# persistent launches, and FP8 grids of more than one wave, take requests longest first (False: in batch order;
# for A/B runs)
LONGEST_FIRST = True
# LONGEST_FIRST for the other grids too (the 16-bit grid, the keys-on-M FP8 and FP8-MMA kernels, beside the FP8
# seesaw's unsplit one) and for split grids (the order rides in lse's place there): where a grid runs more than one
# wave, as the host-length splits' two a request do (decode_plan.BALANCE_SPLITS_MAX_ROWS), its requests longest
# first. On the H200 (bench/NOTES.md 105; decode_ab GRID_ORDER_ALL, b128 lengths 8192 +- 50% split in two): h16
# bf16 1.199x, FP8 1.225x (32k: 1.238x)
GRID_ORDER_ALL = True
# persistent ticket launches of at most RANK_ORDER_MAX_B requests rank them by length in the kernel (each CTA, before
# its first load) instead of in a kernel launch of their own before it (work_order.longest_first: ~5 us a call on the
# H200 under ncu, besides its launch). Interleaved on the H200, kernel / order kernel: b 128 h 128 s_k 4096 s_q 1 / 2
# 1.011 / 1.007x, variable lengths 1.011x, h 64 s_q 2 1.008x, longer steps level (bench/NOTES.md 62). False: the
# order kernel (for A/B runs)
RANK_ORDER = True
RANK_ORDER_MAX_B = 256     # the kernel's smem holds the order as int16, in padding before sQ
# a diagnostic of persistent launches (scripts/persistent_clusters_ab.py --trace): each item's SM, start and end and
# the clocks of its phases, left in `last_trace` after each launch (eager calls only); also of the f16-register FP8
# kernel's unsplit launches in batch order (scripts/fp8_f16_trace.py: mla_decode_fp8_f16_kernel.TRACE_FIELDS a CTA)
TRACE = False
# 16-bit KV and the FP8 seesaw: O (or the fp32 split partials) stored 16 bytes at a time after a transpose
# within each quad (False: the accumulator's 4/8-byte pairs, or value by value; for A/B runs)
STORE_16B = True
# the keys-on-M FP8 kernel at 32 rows: two bf16 tiles and one raw stage (the loader frees it as soon as the page's
# bytes are in its registers) against one tile and two raw stages. On the H200, b128 s_k 4k-32k and b16 s_k 32768:
# 1.07-1.12x faster, and the FP8 GPU tests pass on it (bench/NOTES.md 65, 67)
FP8_N32_TWO_TILES = True
# FP8 KV at more than 32 rows (h64, h128): the 16-bit kernel's seesaw consumers on a ring that a register-path loader
# fills with each page's bf16 values (mla_decode_fp8_seesaw_kernel.py). Grid launches, one CTA a row tile. On an H100
# (bench/NOTES.md 156; decode_ab, --sustain-ms 20, b128): h64 4k / 16k / 32k 1.059 / 1.145 / 1.113x, h128 4k / 16k
# 1.109 / 1.118x, s_q2 h64 / h128 4k 1.106 / 1.130x, b16 h128 32k (split) 1.150x the 64-row FP8 kernel it replaced
# (dequantizing into bf16 tiles, consumers splitting S by keys and O by columns; removed after NOTES 157).
# its loader's global loads: groups of FP8_SEESAW_GROUP_ROWS rows a warp, FP8_SEESAW_AHEAD groups ahead of the one it
# converts (5 registers a row: fp8_register_loader.py)
FP8_SEESAW_GROUP_ROWS = 4
FP8_SEESAW_AHEAD = 3
# ... and whether its warp 0 asks L2 for the bytes of the page after next (a bulk prefetch a page)
FP8_SEESAW_PREFETCH = True
# ... and whether its warps take the pages' block-table entries from rings in smem (each warp's lane 0 copying one
# entry a page by cp.async, 8 pages ahead), where a read of each page's entry from global memory at the page's start
# held all four warps for its trip (fp8_register_loader; bench/NOTES.md 160). H100, b128, 15 rounds: 1.007-1.015x
# at h64 4k-32k and h128 s_q 1-2 8k (NOTES 161)
FP8_SEESAW_BT_SMEM = True
# FP8 KV at <= 16 rows where each split spans at least CONFIG.fp8_mma_min_pages pages: the keys-on-M kernel with FP8
# wgmma on the e4m3 bytes (mla_decode_fp8_mma_kernel.py) instead of the one that dequantizes them into bf16 tiles
# (mla_decode_fp8_narrow_kernel.py). On the H200 (bench/NOTES.md 69, 72), after 6fb790e: against the bf16-tile
# kernel, a request (split) of 64 pages 1.044x (b128 h16 s_k 4096; s_q2 h8 1.047x), 48 pages 1.008x, 32 pages
# 0.958x (b128 h16 s_k 2048; b8 h16 32k's 32-page splits 1.006x), 16 pages 0.90x (b4 h16 32k), 8 pages 0.80x, hence
# the bound of 48; b16 h16 32k (64-page splits) 1.075x
FP8_MMA = True
# FP8 KV at <= 32 rows: the keys-on-M kernel that turns each page's e4m3 bytes into f16 in the consumers' registers
# and multiplies them there with f16 wgmma (mla_decode_fp8_f16_kernel.py; no bf16 tile in smem, no hi / lo parts),
# in place of the FP8-MMA and bf16-tile kernels, where each split spans at least CONFIG.fp8_mma_min_pages pages (its
# Q is built per split, as the FP8-MMA kernel's). On an H100 (bench/NOTES.md 126; decode_ab, --sustain-ms 20): b128
# h32 8k / 32k 1.064 / 1.127x, h16 s_q2 8k 1.067x, h16 4k / 8k / 32k 1.018 / 1.013 / 1.007x, h32 4k 0.996x, b16 h32
# / h16 32k 1.026 / 1.018x; with fewer pages a split 0.95-0.99x (b4 h32 32k, b1 h16 32k), which the bound keeps out
FP8_F16 = True
# The f16-register FP8 kernel's start: Q's global reads issued before the first pages' TMA loads instead of after
# them (where they queue behind the whole grid's first pages: ~21 MB at b128), and in unsplit launches those pages'
# block-table entries read beside the request's length instead of after it. The same bits. On an H100 (bench/NOTES.md
# 134; decode_ab, --sustain-ms 20, off/on): b128 h16 4k / 8k 1.014 / 1.008x, h32 4k / 8k 1.013 / 1.009x, b16 h32 32k
# (split) 1.012x: ~2 us a call (False: for A/B runs)
FP8_EARLY_START = True
# The f16-register FP8 kernel's end: both consumers merge, normalize and store half of O^T each (each stashes the
# other's half in its own stages), instead of consumer 0 all of it while consumer 1 waits. The same bits (consumer 1
# writes its merge's fma out: consumer_ends.merge_stash). On an H100 (bench/NOTES.md 136; decode_ab, --sustain-ms 20,
# off/on): b128 h16 4k / 8k 1.003 / 1.003x, h32 4k / 8k 1.003 / 1.006x, b16 h32 32k (split) 1.001x (False: for A/B)
FP8_SPLIT_EPILOGUE = True
# The f16-register FP8 kernel's start: each consumer asks for its second page once its first has landed, instead of
# both at the start. On the H200 (bench/NOTES.md 168, 174) a consumer's first page lands ~8.4 us after the start at
# b128 h16 8k: the grid's 4 pages a CTA (21 MB) share the memory, while the consumers, not the memory, set the pace
# afterwards. The same bits (GPU test). On an H100 (NOTES 178; decode_ab off/on, --sustain-ms 20): b128 h32 4k / 8k
# 1.016 / 1.009x, b16 h32 32k 1.014x, b128 h16 4k / 8k 1.002 / 1.000x (False: for A/B)
FP8_F16_STAGGER = True
# The f16-register FP8 kernel at 16 rows: S^T from the pages' exact e4m3 values, one accumulator per 128-column scale
# group, each group's product times its keys' scales in fp32 after the wgmmas (32 FFMA a page and thread), instead of
# every K value times its scale in f16 (128 HMUL2; K read as e4m3 * scale rounded to f16). At 32 rows the four
# accumulators do not fit the registers. Not the same bits: K's values are read exactly (the f16 reading of K missed
# the exact entries' lse by up to ~3e-3 at 4x wider logits, bench/NOTES.md 144). As fast, on an H100
# (bench/NOTES.md 150; decode_ab, --sustain-ms 20): b128 h16 4k / 8k / 32k 1.001 / 1.001 / 1.002x, b16 h16 32k
# (split) 1.003x, b128 h8 s_q2 4k 1.002x (False: for A/B runs)
FP8_F16_GROUP_S = True
# The keys-on-M FP8 kernels (FP8-MMA, narrow) read each refill's block-table entry a page before the refill, where
# a read at the refill held the refilling warp (and the page's chain behind it) for the read's latency. On the H200
# (bench/NOTES.md 71): N 32 (h32 s_q1, h16 s_q2) 1.05x, FP8-MMA 1.005-1.01x; the 64-row kernel does not (0.97-0.99x)
BT_AHEAD = True
# The FP8-MMA kernel's Q read in 16-byte loads (the 16 threads of a row take its 16-byte chunks) and stored as
# 8-byte hi / lo pieces, and O stored as bf16 pairs (fp32 pairs for split partials), against scalar loads and
# stores value by value (False: for A/B runs). On the H200 (bench/NOTES.md 75): b128 h16 4k/8k 1.020/1.012x,
# b16 h16 32k 1.017x, the same bits
FP8_MMA_VEC_IO = True
# The FP8-MMA kernel refills a page's stage right after its last V^T fragment is read (before the last two tiles'
# P V are folded into O^T) against after the page (False: for A/B runs). On the H200 (bench/NOTES.md 75):
# 1.001-1.006x at every FP8-MMA shape measured
FP8_MMA_EARLY_REFILL = True
# 16-bit KV: each consumer publishes its row sums once they are final, so that the one that ran an item's last tile
# normalizes and stores while the other still adds that tile's P V (True), or both exchange them after both P Vs
# (False). Off: interleaved on the H200 (20-round single calls and back-to-back turns alike) the exchange after was
# 0.1-1.8% faster at every 128-row shape, the same bits (bench/NOTES.md 61); the early form stays for the FP8 kernel
# and for A/B runs
EARLY_SUMS = False
# 16-bit KV, switches of the seesaw consumers (False: for A/B runs): LAZY_RESCALE, a row's running max moves only
# when it rises by more than split_consumers.LAZY_RESCALE_LOG2 and O's rescale is skipped in warps where no row
# moved; FOLD_SCALE, S left unscaled, the softmax scale applied in exp2's FFMA; TREE_MAX, each row's max over S
# folded pairwise instead of as one chain of dependent FMNMX. On the H200 (bench/NOTES.md 93) LAZY_RESCALE was
# 0.8-2.3% faster at the 128-row shapes of 128 requests, TREE_MAX 0.2-1.1%, FOLD_SCALE 0-0.3%, the three together
# 1.9-2.7% at 4k-8k. (Measured slower and removed (NOTES 93, 96): S's first k-blocks before the other consumer's P,
# 10-14%; P into smem by stmatrix, 0-0.8%; 6 of 32 exponentials by a cubic on the FMA pipe, 0.4-2.1%.)
LAZY_RESCALE = True
FOLD_SCALE = True
TREE_MAX = True
# 16-bit KV, on top of LAZY_RESCALE and FOLD_SCALE: each thread's P exponentiated against the running max while the
# tile's max is still being found, kept in warps where the lazy max does not move (seesaw_consumers.speculative_p),
# so that the MUFU stream of the owner's softmax starts right after S. On the H200 (bench/NOTES.md 98, sustained
# clock) 0.7-2.0% faster at b128 h128 / h64 (s_q 1 and 2), level at b4 (False: for A/B runs)
SPEC_EXP = True
# 16-bit KV, the page's ring (kv_ring picks one by a request's rows):
# - KV_SPLIT: each page as its rope columns and V's two halves, each freed by the one consumer that reads it last
#   (the rope after S, a half after its consumer's P V), and S(t) issued before the wait for the other consumer's
#   P(t-1), its rope and own half first (mla_decode_consumer.SeesawConsumer._seesaw_split): FlashMLA's schedule
#   issues the next tile's S while the softmax runs and refills each piece of a page once read (bench/NOTES.md 107).
#   Taken where a request has at least KV_SPLIT_MIN_ROWS query rows. S's k-blocks go in its owner's order, so ticket
#   launches start every item on ring stage 0 (a pad tile where needed: mla_decode_producer.SeesawProducer._pad_tile),
#   which makes tile t of an item consumer t % 2's whatever the schedule (bench/NOTES.md 111).
# - else KV_PARTS column parts (3: 192 columns each), each on a full barrier of its own, S = Q K^T issued part by
#   part as they land (seesaw_consumers.issue_mma_by_part), as FlashMLA waits on each 64-column piece; 1: one
#   barrier a page. The same bits as one barrier a page.
# On an H100 (bench/NOTES.md 110; decode_ab --sustain-ms 20, two runs of 10 and 20 rounds, b128): KV_SPLIT 1.037 /
# 1.048x at h128 s_q2 4k (256 rows), 1.00-1.01x at h128 s_q1, 0.976-0.978x at 64 rows (h64 8k, h16 4k);
# KV_PARTS = 3 1.033-1.035x at h128 s_q1 4k, 1.023-1.027x 8k, 1.027-1.031x h64 s_q2, 1.006-1.008x h128 s_q2, level
# at 64 rows; KV_PARTS = 9 0.986-1.002x. With KV_PREFETCH (below) KV_SPLIT also leads at 128 rows (NOTES 114:
# 1.063-1.083x over KV_PARTS, both prefetching 2 ahead; 1.02-1.05x over KV_PARTS without), hence 128. At b9b3925
# against KV_PARTS without the prefetch (NOTES 116, same process): b128 h128 4k 1.048x, the split grids b16 / b4 /
# b1 h128 32k 1.051 / 1.017 / 0.995x; from 64 rows (with the prefetch) 0.911-0.922x at h64, h32 s_q2, h16 s_q4.
KV_SPLIT = True
KV_SPLIT_MIN_ROWS = 128
KV_PARTS = 3
# 16-bit KV: the producer, before it waits for tile t's stage, prefetches the page of tile t + prefetch - 1 into
# L2 (a TMA prefetch: its read from memory starts a tile or more before the stage is free, and the load then reads
# L2). Where pages land late (h128 s_q1 on an H100 streams ~80% of the copy bandwidth; KV_SPLIT's parts are freed
# later) the refill's latency is on the consumers' chain (bench/NOTES.md 112). KV_PREFETCH for KV_SPLIT's ring,
# KV_PARTS_PREFETCH for KV_PARTS's; 0: none. On an H100 (NOTES 114, decode_ab --sustain-ms 20, 10 rounds, b128):
# on KV_SPLIT's ring 1.041-1.064x at 2 ahead (1.043-1.056x at 1, 1.031-1.062x at 3) over h128 s_q2 4k/8k and
# h64 s_q4; on KV_PARTS's 0.972-0.997x at 1 and 2, 0.943-0.954x at 3 (128 rows), 0.980-0.992x at 1 (64 rows).
KV_PREFETCH = 2
KV_PARTS_PREFETCH = 0
# traced persistent launches, per item and CTA (int32; clocks are the SM's): SM, start and end ns, start and end
# clock (consumer 0); then per consumer w at 5 + 4w: Q ready, first own tile done, own tiles done, epilogue start;
# then the producer's clock at the item's hand-over, its Q load issued and its first page issued; consumer 0's clock
# once the row sums are exchanged
T_SM, T_NS0, T_NS1, T_C0, T_C1, T_Q, T_FIRST, T_LOOP, T_EPI, T_PUB, T_QLOAD, T_PAGE0, T_SUMS = (
    0, 1, 2, 3, 4, 5, 6, 7, 8, 13, 14, 15, 16)
TRACE_FIELDS = 17     # int32 per item and CTA of a trace (the T_* above name them)
last_trace: torch.Tensor | None = None
# persistent launches: a static schedule that gives every cluster the same share of the step's KV tiles, cutting
# items where a share ends and merging their pieces in the kernel (stream_k.balanced_schedule), instead of whole
# items drawn from a ticket counter (False); traced, each piece is a row of last_trace
STREAM_K = True
STREAM_K_OVERHEAD = 2  # a piece's fixed cost in KV tiles (the traces: ~7.5 k cycles against ~3.0 k a tile)
STREAM_K_MIN_TILES = 10  # ... taken where whole items would leave at least this many tiles a slot idle


def stream_k_pays(items: int, slots: int, max_pages: int) -> bool:
    """Whether a persistent launch of `items` work items on `slots` clusters takes the balanced schedule: where
    whole items, ceil(items / slots) rounds of them, would leave the slots idle for at least STREAM_K_MIN_TILES
    tiles of the longest request the block table holds (max_pages). A cut costs a piece's fixed cost, the
    partial's round trip through L2 and the merge, ~12 us a slot on the H200 (bench/NOTES.md 58): interleaved
    against tickets, b 128 h 128 s_k 32768 s_q 1 / 2: 1.025 / 1.043x faster (0.06 / 0.12 of an item idle, 31 /
    61 tiles); s_k 4096: 0.956 / 0.993x (4 / 8 tiles)."""
    idle = -(-items // slots) - items / slots
    return idle * max_pages >= STREAM_K_MIN_TILES


def persistent_clusters(b: int, rows: int, kv_fp8: bool, split: bool, cluster: int, device: torch.device) -> int:
    """Clusters of a persistent launch (0: an ordinary grid). Unsplit 16-bit KV steps with more work items
    (request, cluster of row tiles) than clusters fit the SMs at once: one cluster per SM (pair), each taking
    items until none is left, so that an item's Q and first pages load while the one before it finishes.
    Split steps fill one wave by construction and gain nothing.

    Interleaved A/B against the grid in one process on the H200 (scripts/decode_ab.py, 13 shapes of 128-256
    rows per request, b 128, s_k 4k-32k, fixed and variable lengths): 2.3% faster in the geometric mean, from 9.6%
    faster (h 64 s_q 2 s_k 16384) to 3.6% slower (h 128 s_q 2 s_k 16384, variable lengths); bench/NOTES.md 50."""
    if not PERSISTENT or kv_fp8 or split:
        return 0
    items = b * triton.cdiv(rows, TILE_M) // cluster
    fit = _num_sms(device) // cluster
    return fit if items > fit else 0


def fp8_narrow_cols(rows: int) -> int:
    """The FP8 kernel with the keys on wgmma's M side (mla_decode_fp8_narrow_kernel.py) takes requests of
    at most 32 query rows, padded to 16 or 32 (wgmma N); 0: the FP8 seesaw's 64-row tiles
    (mla_decode_fp8_seesaw_kernel.py)."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 0


def uses_fp8_mma(kv_fp8: bool, rows: int, max_pages: int, num_splits: int) -> bool:
    """Whether a step takes the FP8-MMA kernel: FP8 KV, <= 16 query rows a request, and each split spanning at
    least CONFIG.fp8_mma_min_pages pages (host shapes only: the block table's columns and the plan's splits).
    triton's rule for its own FP8-MMA kernel (mla_decode_plan.uses_fp8_mma) has since moved with its other
    kernel (bench/NOTES.md 84); this one was measured against the CuTe bf16-tile kernel (NOTES 72)."""
    return (FP8_MMA and kv_fp8 and fp8_narrow_cols(rows) == 16 and CONFIG.fp8_mma_min_pages > 0
            and max_pages >= CONFIG.fp8_mma_min_pages * num_splits)


def uses_fp8_f16(kv_fp8: bool, rows: int, max_pages: int, num_splits: int) -> bool:
    """Whether a step takes the f16-register FP8 kernel (FP8_F16): FP8 KV at <= 32 query rows a request, each
    split spanning at least CONFIG.fp8_mma_min_pages pages (host shapes only, as uses_fp8_mma)."""
    return (FP8_F16 and kv_fp8 and fp8_narrow_cols(rows) > 0 and CONFIG.fp8_mma_min_pages > 0
            and max_pages >= CONFIG.fp8_mma_min_pages * num_splits)


def f16_group_s(narrow: int) -> bool:
    """Whether the f16-register FP8 kernel of `narrow` columns takes its S^T by scale group (FP8_F16_GROUP_S)."""
    return FP8_F16_GROUP_S and narrow == 16


def kv_ring(rows: int) -> tuple[int, bool, int]:
    """The 16-bit kernel's KV ring for requests of `rows` query rows: (column parts a page, KV_SPLIT's ring, pages
    prefetched ahead into L2)."""
    if KV_SPLIT and rows >= KV_SPLIT_MIN_ROWS:
        return 1, True, KV_PREFETCH
    return KV_PARTS, False, KV_PARTS_PREFETCH


def _kernel(dtype: torch.dtype, causal: bool, split: bool, kv_fp8: bool = False, cluster: int = 1, narrow: int = 0,
            persistent: bool = False, ordered: bool = False, trace: bool = False, store16: bool = False,
            streamk: bool = False, early_sums: bool = True, rank_order: bool = False, fp8_mma: bool = False,
            rows: int = TILE_M, fp8_f16: bool = False):
    """The compiled kernel for one specialization (compiled on first use, then cached). `narrow` (FP8 only):
    16 or 32 for the keys-on-M kernels of that many query rows, 0 for the FP8 seesaw (64-row tiles).
    `persistent` (16-bit KV, unsplit): one CTA per SM taking work items until none is left; `streamk` its static
    balanced schedule.
    `ordered` (grid launches): the grid's request axis through an order of the requests.
    `fp8_mma` (FP8, narrow 16): the kernel with FP8 wgmma on the e4m3 bytes (uses_fp8_mma chooses it).
    `rows` (16-bit KV): a request's query rows, which pick the KV ring (kv_ring). `fp8_f16` (FP8, narrow): the
    kernel that multiplies the pages' bytes as f16 in registers (uses_fp8_f16 chooses it)."""
    key = (dtype, causal, split, ("fp8" + (f"-n{narrow}" if narrow else "")) if kv_fp8 else "16bit", cluster)
    if persistent:
        key += ("persistent",)
    if ordered:
        key += ("ordered",)
    if trace:
        key += ("trace",)
    if store16:
        key += ("store16",)
    if streamk:
        key += ("streamk",)
    if not early_sums:
        key += ("late-sums",)
    if rank_order:
        key += ("rank-order",)
    if kv_fp8 and narrow == 32 and not FP8_N32_TWO_TILES:
        key += ("one-tile",)
    if kv_fp8 and not narrow:
        key += ("fp8-seesaw", f"groups={FP8_SEESAW_GROUP_ROWS}x{FP8_SEESAW_AHEAD}", f"prefetch={FP8_SEESAW_PREFETCH}",
                f"bt-smem={FP8_SEESAW_BT_SMEM}")
    if fp8_mma:
        if not (kv_fp8 and narrow == 16):
            raise ValueError(f"the FP8-MMA kernel takes FP8 KV at 16 rows, got kv_fp8={kv_fp8}, narrow={narrow}")
        key += ("fp8-mma",)
    if fp8_f16:
        if not (kv_fp8 and narrow) or fp8_mma:
            raise ValueError(f"the FP8 f16 kernel takes FP8 KV at 16 or 32 rows, got kv_fp8={kv_fp8}, "
                             f"narrow={narrow}, fp8_mma={fp8_mma}")
        key += ("fp8-f16",) + (("early-start",) if FP8_EARLY_START else ()) + (
            ("split-epilogue",) if FP8_SPLIT_EPILOGUE else ()) + (("group-s",) if f16_group_s(narrow) else ()) + (
            ("stagger",) if FP8_F16_STAGGER else ())
    if kv_fp8 and narrow and not BT_AHEAD:
        key += ("bt-at-refill",)
    if fp8_mma and not FP8_MMA_VEC_IO:
        key += ("scalar-io",)
    if fp8_mma and FP8_MMA_EARLY_REFILL:
        key += ("early-refill",)
    seesaw = {} if kv_fp8 and narrow else {
        "lazy_rescale": LAZY_RESCALE, "fold_scale": FOLD_SCALE, "tree_max": TREE_MAX, "spec_exp": SPEC_EXP}
    if not kv_fp8:
        seesaw["kv_parts"], seesaw["kv_split"], seesaw["kv_prefetch"] = kv_ring(rows)
    key += tuple(f"{name}={value}" for name, value in seesaw.items() if value)
    fn = _compiled.get(key)
    if fn is None:
        cutlass = importlib.import_module("cutlass")
        cute = importlib.import_module("cutlass.cute")
        cuda = importlib.import_module("cuda.bindings.driver")
        # compile-time stand-ins: only the pointers' types and alignments matter
        scalars = (*(cutlass.Int32(1) for _ in range(6)), cutlass.Float32(1.0), cuda.CUstream(0))
        t0 = time.perf_counter()
        if fp8_f16:
            kmod = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode_fp8_f16_kernel")
            fn = cute.compile(kmod.MLADecodeFP8F16Sm90(causal=causal, is_split=split, n=narrow, ordered=ordered,
                                                       early_start=FP8_EARLY_START,
                                                       split_epilogue=FP8_SPLIT_EPILOGUE, trace=trace,
                                                       group_s=f16_group_s(narrow), stagger=FP8_F16_STAGGER),
                              *_fp8_pointers((None,) * 8, ordered, split), *scalars)
        elif fp8_mma:
            kmod = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode_fp8_mma_kernel")
            fn = cute.compile(kmod.MLADecodeFP8MmaSm90(causal=causal, is_split=split, bt_ahead=BT_AHEAD,
                                                          vec_io=FP8_MMA_VEC_IO, early_refill=FP8_MMA_EARLY_REFILL,
                                                          ordered=ordered),
                              *_fp8_pointers((None,) * 8, ordered, split), *scalars)
        elif kv_fp8 and not narrow:
            kmod = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode_fp8_seesaw_kernel")
            fn = cute.compile(kmod.MLADecodeFP8SeesawSm90(causal=causal, is_split=split, ordered=ordered,
                                                          store16=store16, group_rows=FP8_SEESAW_GROUP_ROWS,
                                                          groups_ahead=FP8_SEESAW_AHEAD,
                                                          prefetch=FP8_SEESAW_PREFETCH,
                                                          bt_smem=FP8_SEESAW_BT_SMEM, **seesaw),
                              *_fp8_pointers((None,) * 8, ordered, split), *scalars)
        elif kv_fp8 and narrow:
            kmod = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode_fp8_narrow_kernel")
            tiles = 2 if narrow == 16 or FP8_N32_TWO_TILES else 1
            fn = cute.compile(kmod.MLADecodeFP8NarrowSm90(causal=causal, is_split=split, n=narrow, tiles=tiles,
                                                          bt_ahead=BT_AHEAD, ordered=ordered),
                              *_fp8_pointers((None,) * 8, ordered, split), *scalars)
        else:
            kmod = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode_kernel")
            fn = cute.compile(kmod.MLADecodeSm90(cute_dtype(dtype), causal=causal, is_split=split, cluster=cluster,
                                                 persistent=persistent, trace=trace, store16=store16,
                                                 streamk=streamk, early_sums=early_sums, rank_order=rank_order,
                                                 ordered=ordered, **seesaw),
                              *_pointers(dtype, (None,) * 8, persistent, streamk, ordered, split), *scalars)
        compile_seconds[key] = time.perf_counter() - t0
        _compiled[key] = fn
    return fn


def _pointers(dtype: torch.dtype, addresses, persistent: bool = False, streamk: bool = False, ordered: bool = False,
              split: bool = False) -> list:
    """Global-memory pointers for the kernel's 8 tensor arguments (q, kv, block_table, seqlens, out, lse,
    partial out, partial lse) from their addresses (None: a stand-in for compiling). q, kv and out are
    16-byte aligned (TMA needs it; mla_decode checks q and kv), partial out 8-byte (the epilogue stores
    fp32 pairs; mla_decode checks it), the rest 4-byte. Persistent launches pass the scheduler's int32
    counters in partial out's place and the requests' int32 order in partial lse's; stream-K launches the
    pieces' fp32 partials (16-byte aligned) and the int32 schedule; ordered grids the requests' int32 order in
    partial out's place (unsplit) or lse's (split)."""
    cutlass = importlib.import_module("cutlass")
    elem = cute_dtype(dtype)
    if streamk:
        tail = ((cutlass.Float32, 16), (cutlass.Int32, 4))
    elif persistent:
        tail = ((cutlass.Int32, 4), (cutlass.Int32, 4))
    elif ordered and not split:
        tail = ((cutlass.Int32, 4), (cutlass.Float32, 4))
    else:
        tail = ((cutlass.Float32, 8), (cutlass.Float32, 4))
    lse_kind = (cutlass.Int32 if ordered and split else cutlass.Float32, 4)
    kinds = ((elem, 16), (elem, 16), (cutlass.Int32, 4), (cutlass.Int32, 4), (elem, 16), lse_kind, *tail)
    return gmem_pointers(kinds, addresses)


def mla_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal=True, head_dim_v=512,
               num_splits: int | None = None, plan: MLADecodePlan | None = None):
    """Absorbed MLA over a paged latent cache (semantics of mlaserve.kernels.reference.mla_decode).

    q [b, s_q, h, 576] bf16/fp16; kv_cache [pages, 64, 576] in q's dtype, or uint8 [pages, 64, 656] (FP8,
    bf16 q only); block_table int32 [b, max_pages];
    cache_seqlens int32 [b]. Returns out [b, s_q, h, 512] in q's dtype and lse float32 [b, s_q, h]
    (natural log; -inf and out 0 for rows with no visible key). Without `plan`, one is made here.
    """
    global last_trace
    check_supported(q.shape, q.dtype, kv_cache.shape, kv_cache.dtype, head_dim_v)
    b, s_q, h, _ = q.shape
    if plan is None:
        plan = plan_mla_decode(b, s_q, h, head_dim_v, block_table.shape[1], kv_cache.shape[1],
                               kv_cache.dtype == torch.uint8, q.device,
                               num_splits=num_splits)
    elif b > plan.max_batch or plan.rows != s_q * h or plan.head_dim_v != head_dim_v or plan.config != CONFIG:
        raise ValueError(f"plan for <= {plan.max_batch} requests x {plan.rows} rows, head_dim_v {plan.head_dim_v} "
                         f"(config {plan.config}) does not fit q {tuple(q.shape)} with head_dim_v {head_dim_v}")
    if q.device.type != "cuda":
        raise ValueError(f"the cutedsl MLA decode runs on CUDA tensors (a Hopper GPU), got {q.device}")
    if not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be contiguous, got strides {kv_cache.stride()}")
    q = q.contiguous()
    block_table = block_table.contiguous()
    cache_seqlens = cache_seqlens.contiguous()
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary for TMA, got address {t.data_ptr():#x}")
    out = torch.empty(b, s_q, h, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=q.device)
    if b == 0:
        return out, lse
    split = plan.num_splits > 1
    kv_fp8 = kv_cache.dtype == torch.uint8
    cluster = cluster_size(s_q * h, kv_fp8)
    po, pl = (plan.partial_out, plan.partial_lse) if split else (lse, lse)  # unused pointers when not split
    grid_y = plan.num_splits
    clusters = persistent_clusters(b, s_q * h, kv_fp8, split, cluster, q.device)
    pairs = triton.cdiv(s_q * h, TILE_M) // cluster     # a request's work items (pairs of row tiles in clusters)
    streamk = bool(clusters) and STREAM_K and stream_k_pays(b * pairs, clusters, block_table.shape[1])
    rank_order = False
    if streamk:
        sched, po = stream_k_buffers(q.device)
        flags = 3 * clusters * cluster
        if TRACE:
            # the schedule, its flags, then 2 unused values and TRACE_FIELDS per piece and CTA (at most items + slots
            # pieces), as the ticket launches' trace after their counters
            sched = torch.zeros(stream_k.schedule_numel(clusters, flags) + 2
                                + (b * pairs + clusters) * cluster * TRACE_FIELDS, dtype=torch.int32, device=q.device)
            last_trace = sched[stream_k.schedule_numel(clusters, flags):]
        pl = stream_k.balanced_schedule(cache_seqlens, pairs, clusters, STREAM_K_OVERHEAD, flags=flags, out=sched)
        grid_y = clusters
    elif clusters:
        po, grid_y = scheduler_counters(q.device), clusters
        if TRACE:
            po = last_trace = torch.zeros(2 + b * triton.cdiv(s_q * h, TILE_M) * TRACE_FIELDS, dtype=torch.int32,
                                          device=q.device)
        rank_order = LONGEST_FIRST and RANK_ORDER and b <= RANK_ORDER_MAX_B
        if rank_order:
            pl = cache_seqlens     # unused: each CTA ranks the requests itself
        else:
            pl = (longest_first(cache_seqlens) if LONGEST_FIRST
                  else torch.arange(b, dtype=torch.int32, device=q.device))
    narrow = fp8_narrow_cols(s_q * h) if kv_fp8 else 0
    order = None
    if LONGEST_FIRST and not clusters and (GRID_ORDER_ALL or kv_fp8 and not narrow and not split):
        # a grid of more than one wave: its requests longest first (the order in po's place, or lse's split)
        order = grid_order(cache_seqlens, b * (1 if narrow else triton.cdiv(s_q * h, TILE_M)), plan.num_splits)
    if po.data_ptr() % 8:
        raise ValueError(f"the plan's partial_out must start on an 8-byte boundary, got address {po.data_ptr():#x}")
    cutlass = importlib.import_module("cutlass")
    cuda = importlib.import_module("cuda.bindings.driver")
    lse_slot = order if order is not None and split else lse
    po_slot = order if order is not None and not split else po
    f16_kernel = uses_fp8_f16(kv_fp8, s_q * h, block_table.shape[1], plan.num_splits)
    f16_trace = TRACE and f16_kernel and not split and order is None
    if f16_trace:
        kmod = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode_fp8_f16_kernel")
        po_slot = last_trace = torch.zeros(b, kmod.TRACE_FIELDS, dtype=torch.int32, device=q.device)
    addresses = [t.data_ptr() for t in (q, kv_cache, block_table, cache_seqlens, out, lse_slot, po_slot, pl)]
    traced = bool(clusters) and TRACE or f16_trace
    fn = _kernel(q.dtype, bool(causal), split, kv_fp8, cluster, narrow, bool(clusters), order is not None,
                 traced, STORE_16B and not narrow and (not split or po.data_ptr() % 16 == 0),
                 streamk, EARLY_SUMS or kv_fp8, rank_order,
                 uses_fp8_mma(kv_fp8, s_q * h, block_table.shape[1], plan.num_splits) and not f16_kernel, s_q * h,
                 f16_kernel)
    fn(*(_fp8_pointers(addresses, order is not None, split) if kv_fp8
         else _pointers(q.dtype, addresses, bool(clusters), streamk, order is not None, split)),
       cutlass.Int32(b), cutlass.Int32(s_q), cutlass.Int32(h), cutlass.Int32(kv_cache.shape[0]),
       cutlass.Int32(block_table.shape[1]), cutlass.Int32(grid_y), cutlass.Float32(softmax_scale * _LOG2E),
       cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream))
    if split:
        from mlaserve.kernels.triton.mla_decode import combine_splits
        combine_splits(plan, out, lse)
    return out, lse


