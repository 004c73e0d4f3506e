"""The Hopper (sm_90a) MLA decode kernel in CuTe DSL: one CTA = 64 query rows x one KV split of one request.

Imported only where `nvidia-cutlass-dsl` is installed (mla_decode.py loads it on first launch). The producer's
methods are mla_decode_producer.py's, the consumers' mla_decode_consumer.py's (mixins of MLADecodeSm90); where a CTA
stands in its request (split, visible keys, grid order) is request_rows.py.

Warp roles (384 threads, three warpgroups):
- WG 0, the producer (setmaxnreg 24): warp 0 loads the CTA's Q tile once (TMA, [64, 576]) and then
  one 64-token page per stage into a 2-stage smem ring (TMA, [64, 576] per page, page id read from
  the block table); the other three warps idle out. Where a request has an even number of row tiles
  (h 128), its tiles run as 2-CTA clusters (mla_decode.cluster_size): each CTA's producer loads half of
  the page's rows into both CTAs' smem (TMA multicast), and a stage is free once both CTAs' consumers
  released it (each consumer warp arrives on the empty barrier of every CTA of the cluster).
- WG 1 and WG 2, the consumers (setmaxnreg 240), "seesaw" over the tiles (FlashMLA's Hopper schedule):
  consumer w owns the tiles t with t % 2 == w (so always ring stage w) and holds columns 256w..256w+256
  of O. For its own tile t it computes the whole S = Q K_t^T (wgmma m64n64, K = 576), the softmax
  against the running max m(t-1) that the other consumer published for tile t-1, and publishes m(t)
  and P(t) through smem; both consumers then add P(t) V_t into their O half (the owner with P from
  registers, the other with P from smem). Nothing is computed twice, and while one consumer runs its
  softmax the tensor cores run the other's S and P V: the first slice made both consumers do softmax
  at the same time between two waited wgmmas, leaving the tensor cores idle meanwhile, and its m64n32 S
  (A and B from smem) reads 3 KB of smem per 16 tensor-core clocks, more than smem's 128 B/clock give
  (m64n64: 4 KB per 32 clocks).

  One own tile t of consumer w, in order (t >= 1; consumer 0 skips a-b for t = 0):
    a. wait for P(t-1) (named barrier the other consumer arrives on), read m(t-1)
    b. O_w, l_w rescaled to m(t-1); O_w += P(t-1) V_{t-1,w} (A from smem); wait; release stage t-1
    c. wait KV full(t); S = Q K_t^T
       In clusters (128 rows per request: h 128, h 64 s_q 2), where the MMAs bound the time, b's wgmma is not
       waited for: S is queued right behind it, then b's wait and release come before S's wait (2.3-3.0%
       faster there on the H200, bench/NOTES.md item 44). Elsewhere the release of stage t-1 stays ahead of the
       wait for KV(t), which keeps the next page's load from waiting for this one's.
    d. mask, m(t) = max(m(t-1), rowmax S), P = exp2(S - m(t)), l_w += rowsum P
       (with mla_decode.SPEC_EXP, the default: P = exp2(S - m(t-1)) first, kept in warps whose rows' lazy max does
       not move, seesaw_consumers.speculative_p; 0.7-2.0% faster on the H200, bench/NOTES.md 98)
    e. write P(t), m(t) to smem (and zero V rows past the request's end), fence, arrive "P(t) ready"
    f. O_w rescaled to m(t); issue O_w += P(t) V_{t,w} (A from registers); wait; release stage t
  and after the loop, if the last tile is the other's: a, b.
  One P buffer and one max buffer suffice: P(t) is read only by the other consumer (step b), which
  writes P(t+1) only after its step b waited for that read; m(t) likewise.
  Row sums: each consumer keeps the sums of its own tiles' P, scaled like its O half; at the end both
  are at the final max and are added through smem, each consumer publishing its own as soon as they are final
  (publish_row_sums: the owner of the last tile right after its softmax, the other once rescaled to that tile's
  max, while its last P V runs), so that the first normalizes and stores while the other finishes.

Persistent launches (mla_decode.persistent_clusters: unsplit steps with more work items than clusters fit
the SMs): one CTA, or cluster, per SM, each taking work items (a request's row tiles that share page loads)
until none is left, instead of a grid of one CTA per item. The first item of cluster c is item c; then CTA
0's producer draws tickets from a global counter (the last cluster to finish zeroes it again) and hands
each to the cluster's other CTAs over a one-slot smem channel; every producer hands its items to its
consumers through a 2-slot item pipe (ticket_scheduler.py). The KV ring, the seesaw's ownership (tile
g + t of an item whose CTA ran g tiles before; with KV_SPLIT, whose S follows its owner's order, g is made
even by a pad tile, _pad_tile) and the barriers run on across items; Q is released after the item's last S, so the
next item's Q and first pages load while this one's last P V and epilogue run (in a grid, each SM waits for
a CTA to exit before the next one starts loading). Against the grid on the H200 (bench/NOTES.md items 47, 50):
2.3% faster in the geometric mean of 13 shapes of 128-256 rows a request, from +9.6% to -3.6%. Requests are
taken longest first, so that the last items drawn are the short ones and the SMs finish together when lengths
vary: up to ORDER_MAX_B requests ranked by each CTA's producer warpgroup before its first load (rank_order; ncu
on the H200 put the separate order kernel, work_order.longest_first, at ~5 us a call besides its launch, and
dropping it made b 128 h 128 s_k 4096 steps 0.5-1.1% faster), more in an order computed by that kernel.

Stream-K persistent launches (mla_decode.stream_k_pays: where whole items would leave the clusters idle through a
last round, e.g. b 128 h 128 s_q 2 = 256 items on 66 clusters, 3.88 rounds run as 4): a static schedule
(mlaserve.kernels.triton.stream_k, computed on the GPU each call) gives every cluster the same cost of KV tiles,
cutting items where a share ends. Producer and consumers walk their slot's pieces (stream_k_pieces.py) with no
tickets; the pieces of a cut item count their arrivals, each but the last writes its normalized O and lse to a
workspace entry and flags it, and the last folds them all in slot order (merge_piece), so that the bits do not
depend on which finished first. H200, interleaved against tickets: s_k 32768 s_q 1 / 2 1.025 / 1.037x faster;
s_k 4096 0.976 / 0.999x, where a cut (a piece's fixed cost, the partial's round trip, the merge) costs more than
the idle round's tiles (bench/NOTES.md 58, 61).

The epilogue stores a whole 64-row block's O (or fp32 split partials) 16 bytes at a time after a transpose
within each quad (split_consumers.store_block_16b): from the accumulator's 4-byte column pairs it took 11.5 k
cycles an item on the H200, 4.0 k this way (items of 64 pages: 210 k -> 202 k; bench/NOTES.md 54, where
mla_decode.TRACE's per-item phase clocks measured it).

The rows of a CTA are `m_block * 64 + r` of the request's s_q * h query rows (row = token j * h + head).
Keys each row may see: causal, new token j sees 0 .. seqlen - s_q + j. Only tiles that reach past the
smallest visible length are masked, and the cache rows past the request's end in its last page are
zeroed in smem before P V (a masked P of 0 times a NaN left in an unused slot would still be NaN).
"""


import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from mlaserve.kernels.cutedsl.common import register_split_fits
from mlaserve.kernels.cutedsl.mla_decode import RANK_ORDER_MAX_B as ORDER_MAX_B
from mlaserve.kernels.cutedsl.mla_decode import TRACE_FIELDS, T_C0, T_C1, T_NS0, T_NS1, T_PUB, T_SM
from mlaserve.kernels.cutedsl.mla_decode_consumer import SeesawConsumer
from mlaserve.kernels.cutedsl.mla_decode_producer import SeesawProducer
from mlaserve.kernels.cutedsl.request_rows import grid_request, ordered_tensors, page_split
from mlaserve.kernels.cutedsl.seesaw_consumers import (
    CONSUMER_THREADS, D_QK, D_V, HALF_V, NUM_STAGES, TILE_M, TILE_N, KVParts, KVSplit, tile_state, seesaw_operands,
    seesaw_smem_layouts, seesaw_tiled_mmas)
from mlaserve.kernels.cutedsl.stream_k_pieces import first_piece, piece_of
from mlaserve.kernels.cutedsl.ticket_scheduler import ITEM_STAGES, init_scheduler, next_item, rank_requests

PRODUCER_REGS = 24
CONSUMER_REGS = 240
THREADS = 3 * 128
assert register_split_fits((128, PRODUCER_REGS), (THREADS - 128, CONSUMER_REGS))


class MLADecodeSm90(SeesawProducer, SeesawConsumer):
    """Compiled per (dtype, causal, split, cluster, persistent, trace, store16, streamk, early_sums, rank_order).
    Launched by mla_decode.py through `__call__` (a cute.jit host function)."""

    def __init__(self, dtype, causal: bool, is_split: bool, cluster: int = 1, persistent: bool = False,
                 trace: bool = False, store16: bool = False, streamk: bool = False, early_sums: bool = True,
                 rank_order: bool = False, lazy_rescale: bool = False, fold_scale: bool = False,
                 tree_max: bool = False, spec_exp: bool = False, ordered: bool = False, kv_parts: int = 1,
                 kv_split: bool = False, kv_prefetch: int = 0):
        self.dtype = dtype
        self.causal = causal
        self.is_split = is_split
        self.cluster = cluster        # 1, 2 or 4 CTAs (row tiles of one request and split) share each page's load
        # one CTA (cluster) per SM that takes work items (request, row tiles) from a global ticket counter until
        # none is left, so that an item's Q and first pages load while the one before finishes (unsplit only)
        self.persistent = persistent
        # persistent: record each item's SM, start and end and its phases' clocks (T_*) after the counters
        self.trace = trace
        if persistent and is_split:
            raise ValueError("persistent launches are for unsplit decode steps")
        # O (or the fp32 split partials) in 16-byte stores after a transpose within each quad (store_block_16b)
        self.store16 = store16
        if trace and not persistent:
            raise ValueError("trace is an option of persistent launches")
        # persistent: a static schedule of balanced slots (stream_k.balanced_schedule) instead of tickets, items
        # cut where a slot's share ends and their pieces merged by the last to finish
        self.streamk = streamk
        # each consumer's row sums published once final (publish_row_sums), not exchanged after both P Vs
        self.early_sums = early_sums
        if streamk and not persistent:
            raise ValueError("streamk is a persistent launch's schedule")
        # ticket launches: each CTA ranks the requests by length itself (longest first, rank_requests) instead of
        # reading their order from mPL (work_order.longest_first, a kernel launch of its own before this one)
        self.rank_order = rank_order
        if rank_order and (not persistent or streamk):
            raise ValueError("rank_order is an order of a persistent ticket launch's requests")
        # a row's running max moves only when it rises by more than LAZY_RESCALE_LOG2 (quad_row_max), and O's
        # rescales are skipped in warps where no row moved
        self.lazy_rescale = lazy_rescale
        # S left unscaled: the softmax scale applied in the max's two values and in exp2's FFMA (exp_p)
        self.fold_scale = fold_scale
        # each row's maximum over S folded pairwise (fold_row_max), not as one chain of dependent FMNMX
        self.tree_max = tree_max
        # P exponentiated against the running max before the tile's max is known, kept where the lazy max does not
        # move (seesaw_consumers.speculative_p); built on the lazy rescale and the folded scale
        self.spec_exp = spec_exp
        if spec_exp and not (lazy_rescale and fold_scale):
            raise ValueError("spec_exp takes lazy_rescale and fold_scale")
        # grid launches: the request axis through an int32 order (ordered_tensors)
        self.ordered = ordered
        # each page loaded as kv_parts column parts with a full barrier each, and S = Q K^T issued part by part as
        # they land (mla_decode.KV_PARTS); 1: one barrier a page
        if kv_parts < 1 or D_QK % (64 * kv_parts):
            raise ValueError(f"kv_parts must split the {D_QK} columns into whole 64-column blocks, got {kv_parts}")
        self.kv_parts = kv_parts
        # each page as its rope columns and V's two halves, each freed by the consumer that reads it last, and S(t)
        # issued before the wait for the other consumer's P(t-1) (mla_decode.KV_SPLIT); loads 64-column pieces
        self.kv_split = kv_split
        if kv_split and kv_parts != 1:
            raise ValueError(f"kv_split loads its own parts, got kv_parts={kv_parts}")
        # kv_split's ticket launches start every item on ring stage 0 (a pad tile where the CTA's tiles so far are
        # odd): S's k-blocks go in its owner's order, so a tile's owner must not depend on the dynamic schedule
        self.pad_items = kv_split and persistent and not streamk
        # the producer, before waiting for tile t's stage, prefetches tile t + kv_prefetch - 1's page into L2 (TMA
        # prefetch), so that its read from memory starts before the stage is free (mla_decode.kv_ring); 0: none
        if kv_prefetch < 0:
            raise ValueError(f"kv_prefetch counts tiles ahead, got {kv_prefetch}")
        self.kv_prefetch = kv_prefetch
        # TMA boxes a page is loaded in (one barrier each for kv_parts, grouped by kv_split's parts)
        self.kv_boxes = D_QK // 64 if kv_split else kv_parts
        # mbarriers of the KV ring: full and empty per stage and part (kv_split: rope + two halves a stage)
        self.kv_barriers = NUM_STAGES * 2 * (3 if kv_split else kv_parts)
        if ordered and persistent:
            raise ValueError("ordered is an order of a grid launch's requests (persistent launches have their own)")

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, kv_ptr: cute.Pointer, bt_ptr: cute.Pointer, seqlens_ptr: cute.Pointer,
                 out_ptr: cute.Pointer, lse_ptr: cute.Pointer, po_ptr: cute.Pointer, pl_ptr: cute.Pointer,
                 batch: Int32, s_q: Int32, h: Int32, num_pages: Int32, max_pages: Int32, num_splits: Int32,
                 scale_log2: Float32, stream):
        """q [b, s_q * h, 576]; kv [num_pages * 64, 576]; bt int32 [b, max_pages]; seqlens int32 [b];
        out [b, s_q * h, 512] (q's dtype), lse fp32 [b, s_q * h]; partials (split only) fp32
        [b, num_splits, s_q * h, 512] and [b, num_splits, s_q * h]. Persistent launches pass the scheduler's
        int32 [2] counters in po's place and the order of the requests (int32 [b], work_order.longest_first)
        in pl's (rank_order: pl is unused, b <= ORDER_MAX_B)."""
        rows = s_q * h
        mQ = cute.make_tensor(q_ptr, cute.make_layout((rows, D_QK, batch), stride=(D_QK, 1, rows * D_QK)))
        mKV = cute.make_tensor(kv_ptr, cute.make_layout((num_pages * TILE_N, D_QK), stride=(D_QK, 1)))
        mBT = cute.make_tensor(bt_ptr, cute.make_layout((batch, max_pages), stride=(max_pages, 1)))
        mSeqlens = cute.make_tensor(seqlens_ptr, cute.make_layout(batch))
        # strides that are multiples of D_V said so (assume), so that the epilogue's stores can be vectorized
        rows_dv = cute.assume(rows * D_V, divby=D_V)
        mOut = cute.make_tensor(out_ptr, cute.make_layout((batch, rows, D_V), stride=(rows_dv, D_V, 1)))
        mLse = cute.make_tensor(lse_ptr, cute.make_layout((batch, rows), stride=(rows, 1)))
        if const_expr(self.streamk):
            # the pieces' fp32 partials: [slots, 2, cluster, 64 rows, 512] O, then [slots, 2, cluster, 64] lse
            mPO = cute.make_tensor(po_ptr, cute.make_layout(num_splits * 2 * self.cluster * TILE_M * (D_V + 1)))
        elif const_expr(self.persistent):
            # the scheduler's int32 counters (then, traced, TRACE_FIELDS per item and CTA)
            mPO = cute.make_tensor(po_ptr, cute.make_layout(
                2 + (batch * cute.ceil_div(rows, TILE_M) * TRACE_FIELDS if const_expr(self.trace) else 0)))
        else:
            mPO = cute.make_tensor(po_ptr, cute.make_layout(
                (batch, num_splits, rows, D_V),
                stride=(cute.assume(num_splits * rows * D_V, divby=D_V), rows_dv, D_V, 1)))
        if const_expr(self.streamk):
            # the schedule (W, I, CONT) and the pieces' flags (arrivals per cut item, partial ready per piece)
            # (traced: then 2 unused and TRACE_FIELDS per piece and CTA, at most items + slots pieces)
            mPL = cute.make_tensor(pl_ptr, cute.make_layout(
                3 * num_splits + 2 + 3 * num_splits * self.cluster
                + (2 + (batch * cute.ceil_div(rows, TILE_M) // self.cluster + num_splits) * self.cluster * TRACE_FIELDS
                   if const_expr(self.trace) else 0)))
        elif const_expr(self.persistent):
            mPL = cute.make_tensor(pl_ptr, cute.make_layout(batch))     # the order in which requests are taken
        else:
            mPL = cute.make_tensor(pl_ptr, cute.make_layout((batch, num_splits, rows),
                                                            stride=(num_splits * rows, rows, 1)))
        if const_expr(self.ordered):
            mLse, mPO = ordered_tensors(mLse, mPO, lse_ptr, po_ptr, batch, self.is_split)

        _, sQ_layout, sKV_layout, sP_layout = seesaw_smem_layouts(self.dtype)

        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(tma_op, mQ, sQ_layout, (TILE_M, D_QK))
        if const_expr(self.kv_boxes > 1):
            # one column part of a page (of a cluster CTA's share of its rows): rows 0.. and columns 0.. of a stage's
            # [64, 576] layout, whole 64-column pieces of the 128-byte swizzle
            box = (TILE_N // self.cluster, D_QK // self.kv_boxes)
            part = cute.composition(cute.slice_(sKV_layout, (None, None, 0)),
                                    cute.make_layout(box, stride=(1, TILE_N)))
            op = tma_op if const_expr(self.cluster == 1) else cpasync.CopyBulkTensorTileG2SMulticastOp()
            tma_kv, mKV_tma = cpasync.make_tiled_tma_atom(op, mKV, part, box)
        elif const_expr(self.cluster == 1):
            tma_kv, mKV_tma = cpasync.make_tiled_tma_atom(
                tma_op, mKV, cute.slice_(sKV_layout, (None, None, 0)), (TILE_N, D_QK))
        else:
            # each CTA of a cluster loads its share of the page's rows, [64 / cluster, 576], into every CTA's
            # smem; a share sits in a stage like rows 0.. of the [64, 576] layout (nine pieces, one per 64
            # columns, each a whole number of the 128-byte swizzle's 1 KB periods)
            part = cute.composition(cute.slice_(sKV_layout, (None, None, 0)),
                                    cute.make_layout((TILE_N // self.cluster, D_QK), stride=(1, TILE_N)))
            tma_kv, mKV_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SMulticastOp(), mKV, part, (TILE_N // self.cluster, D_QK))

        tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_rs = seesaw_tiled_mmas(self.dtype)

        @cute.struct
        class PersistentStorage:
            kv_mbar: cute.struct.MemRange[cutlass.Int64, self.kv_barriers]
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            item_mbar: cute.struct.MemRange[cutlass.Int64, ITEM_STAGES * 2]
            chan_mbar: cute.struct.MemRange[cutlass.Int64, 2]     # cluster rank 0 -> r: full (in r), empty (in 0)
            item_slot: cute.struct.MemRange[Int32, ITEM_STAGES]
            chan_slot: cute.struct.MemRange[Int32, 2]
            arrivals: cute.struct.MemRange[Int32, 2]              # stream-K: a piece's arrival count, broadcast
            row_max: cute.struct.MemRange[Float32, TILE_M]
            row_sum: cute.struct.MemRange[Float32, TILE_M * 4]
            order: cute.struct.MemRange[cutlass.Int16, ORDER_MAX_B]  # rank_order: the requests, longest first
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]

        if const_expr(self.persistent):
            # num_splits carries the number of clusters launched
            self.shared_storage = PersistentStorage
            grid = (self.cluster, num_splits, 1)
        else:
            self.shared_storage = self._grid_storage(self.kv_barriers, sQ_layout, sKV_layout, sP_layout)
            grid = (cute.ceil_div(rows, TILE_M), num_splits, batch)
        self.kernel(tma_q, mQ_tma, tma_kv, mKV_tma, mBT, mSeqlens, mOut, mLse, mPO, mPL,
                    s_q, h, rows, num_splits, scale_log2, sQ_layout, sKV_layout, sP_layout,
                    tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_rs).launch(
            grid=grid, block=[THREADS, 1, 1], cluster=[self.cluster, 1, 1],
            smem=self.shared_storage.size_in_bytes(),
            stream=stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ_tma: cute.Tensor, tma_kv: cute.CopyAtom, mKV_tma: cute.Tensor,
               mBT: cute.Tensor, mSeqlens: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor,
               mPO: cute.Tensor, mPL: cute.Tensor, s_q: Int32, h: Int32, rows: Int32, num_splits: Int32,
               scale_log2: Float32, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               tiled_mma_pv_rs: cute.TiledMma):
        """Persistent launches: mPO is the scheduler's int32 [2] (next ticket, clusters done), mPL the order of
        the requests (item i is row-tile pair i % pairs of request mPL[i // pairs]), num_splits the number of
        clusters launched."""
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()
        m_block, split, batch = bx, by, grid_request(bz, mLse, mPO, self.ordered, self.is_split)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // 128)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_kv)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        item_pipe = None
        if const_expr(self.persistent and not self.streamk):
            item_pipe = init_scheduler(storage, tidx, self.cluster)
        # 8 consumer warps each arrive once on a stage's empty barrier (one elected lane per warp): both
        # consumers read every tile's V. In a cluster, lane r of each warp arrives on CTA r's barrier: a
        # stage is free once every CTA's consumers are done with it, since every CTA's load writes into all.
        if const_expr(self.kv_split):
            # each part is freed by one consumer warpgroup (4 warps a CTA of the cluster): the rope's NUM_STAGES
            # barrier pairs, then the halves' 2 * NUM_STAGES
            one_consumer = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.cluster * CONSUMER_THREADS // 64)
            kv_pipe = KVSplit(*(pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.kv_mbar.data_ptr() + offset, num_stages=stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread), consumer_group=one_consumer,
                tx_count=TILE_N * cols * self.dtype.width // 8,
                cta_layout_vmnk=cute.make_layout((1, self.cluster, 1, 1)))
                for offset, stages, cols in ((0, NUM_STAGES, D_QK - D_V), (2 * NUM_STAGES, 2 * NUM_STAGES, HALF_V))))
        else:
            kv_pipes = [pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.kv_mbar.data_ptr() + part * NUM_STAGES * 2, num_stages=NUM_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         self.cluster * CONSUMER_THREADS // 32),
                tx_count=TILE_N * (D_QK // self.kv_parts) * self.dtype.width // 8,
                cta_layout_vmnk=cute.make_layout((1, self.cluster, 1, 1))) for part in range(self.kv_parts)]
            kv_pipe = kv_pipes[0] if const_expr(self.kv_parts == 1) else KVParts(tuple(kv_pipes))
        q_pipe, sQ, sKV, sP, sMax, sSum = self._q_pipe_and_smem(storage, sQ_layout, sKV_layout, sP_layout)
        if const_expr(not self.persistent):
            seqlen = mSeqlens[batch]
            start, n_tiles = page_split(seqlen, split, num_splits)

        order = mPL
        if const_expr(self.rank_order):
            order = storage.order.get_tensor(cute.make_layout(ORDER_MAX_B))
        if wg == 0:
            # ---------------- producer ----------------
            if const_expr(self.rank_order):
                rank_requests(mSeqlens, storage, order, tidx, warp_idx)
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                rank = 0
                sKV_load = sKV
                if const_expr(self.cluster > 1):
                    rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
                    sKV_load = cute.local_tile(sKV, (TILE_N // self.cluster, D_QK, NUM_STAGES), (rank, 0, 0))
                # [64 / c, 576, c * pages] for clusters of c CTAs: CTA r loads tile c * p + r of page p
                gKV = cute.local_tile(mKV_tma, (TILE_N // self.cluster, D_QK), (None, 0))
                if const_expr(self.kv_boxes > 1):
                    # [rows, 576 / boxes, stage, box] and [rows, 576 / boxes, c * pages, box]
                    box = (TILE_N // self.cluster, D_QK // self.kv_boxes)
                    parts = cute.local_tile(sKV, (*box, 1), (rank, None, None))   # [rows, cols, 1, part, stage]
                    sKV_load = cute.make_tensor(parts.iterator, cute.select(parts.layout, mode=[0, 1, 4, 3]))
                    gKV = cute.local_tile(mKV_tma, box, (None, None))
                tKVs, tKVg = cpasync.tma_partition(tma_kv, 0, cute.make_layout(1), cute.group_modes(sKV_load, 0, 2),
                                                   cute.group_modes(gKV, 0, 2))
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, NUM_STAGES)
                # the helpers hand kv_state back: the tracer carries loop state through names rebound in this
                # body, not through the attributes a helper's loop changed (producer_tail needs the final state)
                if const_expr(not self.persistent):
                    kv_state = self._produce_item(tma_q, mQ_tma, tma_kv, tKVs, tKVg, sQ, mBT, q_pipe, kv_pipe, q_state,
                                                  kv_state, batch, m_block, start, n_tiles, rank)
                elif const_expr(self.streamk):
                    # the slot's pieces, as the consumers walk them (stream_k_pieces)
                    item, lo, pos, w1, i_end = first_piece(mPL, by, num_splits)
                    mTrace = self._stream_k_trace(mPL, num_splits)
                    piece = mPL[num_splits + 1 + by] + by      # the slot's first piece's trace index
                    while item < i_end:
                        batch_i, m_block_i, seqlen_i, n_i, hi = piece_of(mSeqlens, item, lo, pos, w1, rank,
                                                                         self.cluster)
                        slot = piece * self.cluster + rank
                        if const_expr(self.trace):
                            if cute.arch.lane_idx() == 0:
                                self._trace(mTrace, slot, T_PUB, cute.arch.clock())
                        kv_state = self._produce_item(tma_q, mQ_tma, tma_kv, tKVs, tKVg, sQ, mBT, q_pipe, kv_pipe,
                                                      q_state, kv_state, batch_i, m_block_i, lo * TILE_N, hi - lo,
                                                      rank, mTrace, slot)
                        q_state.advance()
                        piece = piece + 1
                        pos = pos + hi - lo
                        item = item + 1
                        lo = Int32(0)
                else:
                    kv_state = self._produce_items(tma_q, mQ_tma, tma_kv, tKVs, tKVg, sQ, mBT, mSeqlens, mPO, order,
                                                   q_pipe, kv_pipe, item_pipe, q_state, kv_state, storage, rows,
                                                   rank, by, num_splits)
                if const_expr(self.cluster > 1):
                    # the other CTAs' consumers arrive on this CTA's barriers: wait for their last arrivals
                    # before exiting (an arrival on the smem of an exited CTA is undefined)
                    kv_pipe.producer_tail(kv_state)
        else:
            # ---------------- consumers ----------------
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            cw = wg - 1                  # owns tiles t % 2 == cw (ring stage cw) and columns 256cw.. of O
            ctid = tidx % 128
            ops = seesaw_operands(tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_rs, ctid, cw, sQ, sKV, sP)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            if const_expr(not self.persistent):
                self._consume_item(kv_pipe, q_pipe, q_state, ops, tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_rs, sKV,
                                   sMax, sSum, mOut, mLse, mPO, mPL, cw, ctid, seqlen, start, n_tiles, 0, batch,
                                   split, m_block, s_q, h, rows, scale_log2)
            elif const_expr(self.streamk):
                rank = 0
                if const_expr(self.cluster > 1):
                    rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
                item, lo, pos, w1, i_end = first_piece(mPL, by, num_splits)
                mTrace = self._stream_k_trace(mPL, num_splits)
                piece = mPL[num_splits + 1 + by] + by      # the slot's first piece's trace index (traced launches)
                g = Int32(0)             # tiles of this CTA's earlier pieces (the ring's and the seesaw's count)
                while item < i_end:
                    batch_i, m_block_i, seqlen_i, n_i, hi = piece_of(mSeqlens, item, lo, pos, w1, rank, self.cluster)
                    ops[8].fill(0.0)     # acc_o
                    slot = piece * self.cluster + rank
                    self._trace_item(mTrace, slot, cw, ctid, True)
                    self._consume_item(kv_pipe, q_pipe, q_state, ops, tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_rs,
                                       sKV, sMax, sSum, mOut, mLse, mPO, mPL, cw, ctid, seqlen_i, lo * TILE_N, hi - lo,
                                       g, batch_i, 0, m_block_i, s_q, h, rows, scale_log2, slot,
                                       (item, lo, hi, n_i, by, num_splits, rank, storage), mTrace)
                    self._trace_item(mTrace, slot, cw, ctid, False)
                    q_state.advance()
                    piece = piece + 1
                    g = g + hi - lo
                    pos = pos + hi - lo
                    item = item + 1
                    lo = Int32(0)
            else:
                item_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ITEM_STAGES)
                pairs = cute.ceil_div(rows, TILE_M) // self.cluster
                rank = 0
                if const_expr(self.cluster > 1):
                    rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
                n_items = cute.size(mSeqlens) * pairs
                item, item_state = next_item(item_pipe, item_state, storage)
                g = Int32(0)             # tiles of this CTA's earlier items (the ring's and the seesaw's count)
                while item < n_items:
                    batch_i = Int32(order[item // pairs])
                    m_block_i = (item % pairs) * self.cluster + rank
                    seqlen_i = mSeqlens[batch_i]
                    n_tiles_i = (seqlen_i + TILE_N - 1) // TILE_N
                    if const_expr(self.pad_items):
                        pad = (g % 2) * cutlass.min(n_tiles_i, 1)
                        for _ in cutlass.range(pad, unroll=1):
                            self._pad_tile(kv_pipe, tile_state(g), cw)
                        g = g + pad
                    ops[8].fill(0.0)     # acc_o
                    slot = item * self.cluster + rank     # this CTA's part of the item (traced launches)
                    self._trace_item(mPO, slot, cw, ctid, True)
                    self._consume_item(kv_pipe, q_pipe, q_state, ops, tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_rs,
                                       sKV, sMax, sSum, mOut, mLse, mPO, mPL, cw, ctid, seqlen_i, 0, n_tiles_i, g,
                                       batch_i, 0, m_block_i, s_q, h, rows, scale_log2, slot)
                    self._trace_item(mPO, slot, cw, ctid, False)
                    q_state.advance()
                    g = g + n_tiles_i
                    item, item_state = next_item(item_pipe, item_state, storage)

    # -- what the grid kernels share (this one and the FP8 seesaw, mla_decode_fp8_seesaw_kernel.py) --

    def _grid_storage(self, kv_barriers: int, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
                      sP_layout: cute.ComposedLayout, extra_words: int = 1):
        """The smem of a grid launch: kv_barriers mbarriers of the KV ring, Q's pair, the row statistics, `extra_words`
        words for the kernel's own use (the FP8 seesaw's block-table rings; one unused word where a kernel needs none,
        which sits in the padding before Q's 1024-byte alignment, so that nothing moves), Q, the ring and P."""

        @cute.struct
        class SharedStorage:
            kv_mbar: cute.struct.MemRange[cutlass.Int64, kv_barriers]
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            row_max: cute.struct.MemRange[Float32, TILE_M]
            row_sum: cute.struct.MemRange[Float32, TILE_M * 4]
            extra: cute.struct.MemRange[Int32, extra_words]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]

        return SharedStorage

    def _q_pipe_and_smem(self, storage, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
                         sP_layout: cute.ComposedLayout) -> tuple:
        """Q's TMA pipeline (one stage, the consumers' 8 warps free it) and the smem tensors over `storage`: (q_pipe,
        sQ, sKV, sP, row maxima, row sums [row, consumer, item parity])."""
        q_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.q_mbar.data_ptr(), num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_THREADS // 32),
            tx_count=TILE_M * D_QK * self.dtype.width // 8)
        return (q_pipe, storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
                storage.sKV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner),
                storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner),
                storage.row_max.get_tensor(cute.make_layout(TILE_M)),
                storage.row_sum.get_tensor(cute.make_layout((TILE_M, 2, 2))))

    # -- stream-K launches: a static schedule of balanced slots (mlaserve.kernels.triton.stream_k) --

    def _stream_k_trace(self, mSched: cute.Tensor, n_slots: Int32):
        """Traced stream-K launches: the trace in the schedule's buffer after its flags, as a tensor that _trace
        indexes like the ticket launches' (2 values before the first piece's fields); None untraced."""
        if const_expr(not self.trace):
            return None
        return cute.make_tensor(mSched.iterator + (3 * n_slots + 2 + 3 * n_slots * self.cluster),
                                cute.make_layout(cute.size(mSched) - (3 * n_slots + 2 + 3 * n_slots * self.cluster)))

    # -- persistent launches: traces and the ticket producer (the scheduler's parts: ticket_scheduler.py) --

    @cute.jit
    def _trace(self, mSched: cute.Tensor, slot: Int32, field: int, value: Int32):
        """Traced launches: field `field` of item-and-CTA `slot` (TRACE_FIELDS) after the scheduler's counters."""
        mSched[2 + slot * TRACE_FIELDS + field] = value

    @cute.jit
    def _trace_item(self, mSched: cute.Tensor, slot: Int32, cw: Int32, ctid: Int32, start: cutlass.Constexpr[bool]):
        """Traced launches, consumer 0's first thread: an item's (stream-K: a piece's) SM, start time and clock
        (`start`), or its end time and clock. Nothing untraced."""
        if const_expr(self.trace):
            if cw == 0 and ctid == 0:
                if const_expr(start):
                    self._trace(mSched, slot, T_SM, cute.arch.smid())
                    self._trace(mSched, slot, T_NS0, cute.arch.globaltimer_lo())
                    self._trace(mSched, slot, T_C0, cute.arch.clock())
                else:
                    self._trace(mSched, slot, T_NS1, cute.arch.globaltimer_lo())
                    self._trace(mSched, slot, T_C1, cute.arch.clock())
