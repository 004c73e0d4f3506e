"""The Hopper (sm_90a) MLA decode kernel in CuTe DSL: one CTA = 64 query rows x one KV split of one request.

Imported only where `nvidia-cutlass-dsl` is installed (mla_decode.py loads it on first launch).

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
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from mlaserve.kernels.cutedsl.common import register_split_fits
from mlaserve.kernels.cutedsl.mla_decode import RANK_ORDER_MAX_B as ORDER_MAX_B
from mlaserve.kernels.cutedsl.mla_decode import TRACE_FIELDS
from mlaserve.kernels.cutedsl.seesaw_consumers import (
    BAR_P_READY, BAR_SUM, CONSUMER_THREADS, D_QK, D_V, HALF_V, NUM_STAGES, TILE_M, TILE_N, KVParts, KVSplit,
    issue_k_blocks, issue_mma, issue_mma_by_part, tile_state,
    other_tile_pv, other_tile_pv_issue, publish_row_sums, seesaw_operands, seesaw_tiled_mmas, speculative_p,
    take_row_sums)
from mlaserve.kernels.cutedsl.split_consumers import (exp_p, finish_rows, fold_row_max, quad_row_max, scale_rows,
                                                      rescale_rows, store_dense_block, store_dense_lse)
from mlaserve.kernels.cutedsl.stream_k_pieces import first_piece, merge_piece, piece_of
from mlaserve.kernels.cutedsl.ticket_scheduler import (ITEM_STAGES, fetch_ticket, init_scheduler, next_item,
                                                       publish_item, rank_requests)

PRODUCER_REGS = 24
CONSUMER_REGS = 240
THREADS = 3 * 128
assert register_split_fits((128, PRODUCER_REGS), (THREADS - 128, CONSUMER_REGS))
BAR_WG = 4            # + w: consumer w's own 128 threads (V rows it zeroed, before its own wgmma reads them)
# traced persistent launches, per item and CTA (int32; clocks are the SM's): SM, start and end ns, start and end
# clock (consumer 0); then per consumer w at 5 + 4w: Q ready, first own tile done, own tiles done, epilogue start;
# then the producer's clock at the item's hand-over, its Q load issued and its first page issued; consumer 0's clock
# once the row sums are exchanged
T_SM, T_NS0, T_NS1, T_C0, T_C1, T_Q, T_FIRST, T_LOOP, T_EPI, T_PUB, T_QLOAD, T_PAGE0, T_SUMS = (
    0, 1, 2, 3, 4, 5, 6, 7, 8, 13, 14, 15, 16)


def page_split(seqlen: Int32, split: Int32, num_splits: Int32):
    """This split's tokens of the dense decode kernels: the request's length cut into num_splits runs of
    whole pages -> (first token, pages to read; 0 for a split past the end)."""
    split_len = ((seqlen + num_splits - 1) // num_splits + TILE_N - 1) // TILE_N * TILE_N
    start = split * split_len
    end = cutlass.min(start + split_len, seqlen)
    return start, cutlass.max((end - start + TILE_N - 1) // TILE_N, 0)


def visible_keys(seqlen: Int32, s_q: Int32, h: Int32, row: Int32, causal: bool) -> Int32:
    """The keys query row `row` (= new token j * h + head) may see: the request's seqlen, or causally the
    first seqlen - s_q + 1 + j."""
    v = seqlen
    if causal:
        v = seqlen - s_q + 1 + row // h
    return cutlass.min(v, seqlen)


def ordered_tensors(mLse: cute.Tensor, mPO: cute.Tensor, lse_ptr: cute.Pointer, po_ptr: cute.Pointer, batch: Int32,
                    is_split: bool) -> tuple:
    """Ordered grid launches (work_order.grid_order: requests longest first): the int32 order [b] of the grid's
    request axis rides in lse's place in split launches (they write partial lse only) and in partial out's in
    unsplit ones (no partials) -> (mLse, mPO) with that one the order. The kernel reads its request as
    order[block z]."""
    if is_split:
        return cute.make_tensor(lse_ptr, cute.make_layout(batch)), mPO
    return mLse, cute.make_tensor(po_ptr, cute.make_layout(batch))


def grid_request(bz: Int32, mLse: cute.Tensor, mPO: cute.Tensor, ordered: bool, is_split: bool) -> Int32:
    """The request a grid CTA of block z takes: z, or order[z] in ordered launches (ordered_tensors)."""
    if not ordered:
        return bz
    return mLse[bz] if is_split else mPO[bz]


def s_part_blocks(w: int, first: bool) -> tuple:
    """kv_split: the k-blocks (16 columns each) of S's part issued by consumer w, as a static tuple: first the rope's
    (columns 512..575) and V half w's, then V's other half."""
    per_half = HALF_V // 16
    own = tuple(range(w * per_half, (w + 1) * per_half))
    if first:
        return tuple(range(D_V // 16, D_QK // 16)) + own
    return tuple(range((1 - w) * per_half, (2 - w) * per_half))


def first_masked_key(seqlen: Int32, s_q: Int32, causal: bool) -> Int32:
    """The smallest number of keys any row sees (tiles that end before it need no mask)."""
    return cutlass.max(seqlen - s_q + 1, 0) if causal else seqlen


class MLADecodeSm90:
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

        # -- smem layouts: every operand K-major with the 128-byte swizzle (64 16-bit values per row) --
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, self.dtype, D_QK), self.dtype)
        sQ_layout = cute.tile_to_shape(atom, (TILE_M, D_QK), order=(0, 1))
        sKV_layout = cute.tile_to_shape(atom, (TILE_N, D_QK, NUM_STAGES), order=(0, 1, 2))
        sP_layout = cute.tile_to_shape(atom, (TILE_M, TILE_N), order=(0, 1))

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
        class SharedStorage:
            kv_mbar: cute.struct.MemRange[cutlass.Int64, self.kv_barriers]
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            row_max: cute.struct.MemRange[Float32, TILE_M]
            row_sum: cute.struct.MemRange[Float32, TILE_M * 4]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]

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
            self.shared_storage = SharedStorage
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
        q_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.q_mbar.data_ptr(), num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_THREADS // 32),
            tx_count=TILE_M * D_QK * self.dtype.width // 8)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sKV = storage.sKV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sMax = storage.row_max.get_tensor(cute.make_layout(TILE_M))
        sSum = storage.row_sum.get_tensor(cute.make_layout((TILE_M, 2, 2)))     # [row, consumer, item parity]
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

    @cute.jit
    def _produce_item(self, tma_q: cute.CopyAtom, mQ_tma: cute.Tensor, tma_kv: cute.CopyAtom, tKVs: cute.Tensor,
                      tKVg: cute.Tensor, sQ: cute.Tensor, mBT: cute.Tensor, q_pipe, kv_pipe, q_state, kv_state,
                      batch: Int32, m_block: Int32, start: Int32, n_tiles: Int32, rank: Int32, mSched=None,
                      trace_slot: Int32 = 0, pad=0):
        """The producer's loads for one (request, row tile, split): Q once, then its pages into the ring; with
        `pad` (1, pad_items), its first page twice (the pad tile, _pad_tile)."""
        gQ = cute.local_tile(mQ_tma[None, None, batch], (TILE_M, D_QK), (m_block, 0))
        tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                         cute.group_modes(gQ, 0, 2))
        q_pipe.producer_acquire(q_state)
        if const_expr(self.trace):
            if cute.arch.lane_idx() == 0:
                self._trace(mSched, trace_slot, T_QLOAD, cute.arch.clock())
        cute.copy(tma_q, tQg, tQs, tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
        first_page = start // TILE_N
        for t in cutlass.range(n_tiles + pad, unroll=1):
            if const_expr(self.pad_items):
                page = mBT[batch, first_page + cutlass.max(t - pad, 0)]
            else:
                page = mBT[batch, first_page + t]
            if const_expr(self.kv_prefetch > 0):
                ahead = t + self.kv_prefetch - 1 - pad      # the item's tile whose page goes to L2 now
                if ahead >= 0 and ahead < n_tiles:
                    self._prefetch_page(tma_kv, tKVg, self.cluster * mBT[batch, first_page + ahead] + rank)
            if const_expr(self.kv_split):
                if const_expr(self.trace):
                    if cute.arch.lane_idx() == 0 and t == 0:
                        self._trace(mSched, trace_slot, T_PAGE0, cute.arch.clock())
                self._produce_split(tma_kv, tKVs, tKVg, kv_pipe, kv_state, self.cluster * page + rank)
            elif const_expr(self.kv_parts > 1):
                if const_expr(self.trace):
                    if cute.arch.lane_idx() == 0 and t == 0:
                        self._trace(mSched, trace_slot, T_PAGE0, cute.arch.clock())
                self._produce_parts(tma_kv, tKVs, tKVg, kv_pipe, kv_state, self.cluster * page + rank)
            else:
                kv_pipe.producer_acquire(kv_state)
                if const_expr(self.trace):
                    if cute.arch.lane_idx() == 0 and t == 0:
                        self._trace(mSched, trace_slot, T_PAGE0, cute.arch.clock())
                if const_expr(self.cluster == 1):
                    cute.copy(tma_kv, tKVg[None, page], tKVs[None, kv_state.index],
                              tma_bar_ptr=kv_pipe.producer_get_barrier(kv_state))
                else:
                    cute.copy(tma_kv, tKVg[None, self.cluster * page + rank], tKVs[None, kv_state.index],
                              tma_bar_ptr=kv_pipe.producer_get_barrier(kv_state),
                              mcast_mask=cutlass.Int16((1 << self.cluster) - 1))
            kv_state.advance()
        return kv_state

    @cute.jit
    def _prefetch_page(self, tma_kv: cute.CopyAtom, tKVg: cute.Tensor, tile: Int32):
        """This CTA's share of one page (row tile `tile` of the cache's [64 / cluster, 576] tiling) into L2: a TMA
        prefetch of each box the page is loaded in, no barrier."""
        if const_expr(self.kv_boxes > 1):
            for box in cutlass.range_constexpr(self.kv_boxes):
                cute.prefetch(tma_kv, tKVg[None, tile, box])
        else:
            cute.prefetch(tma_kv, tKVg[None, tile])

    @cute.jit
    def _produce_parts(self, tma_kv: cute.CopyAtom, tKVs: cute.Tensor, tKVg: cute.Tensor, kv_pipe, kv_state,
                       tile: Int32):
        """One page's loads as kv_parts column parts, each on its own full barrier (KVParts), so that S can start
        on the first part while the others land. `tile`: the page's row tile in the [64 / cluster, 576] tiling
        of the cache (c * page + rank)."""
        for part in cutlass.range_constexpr(self.kv_parts):
            pipe = kv_pipe.pipes[part]
            pipe.producer_acquire(kv_state)
            if const_expr(self.cluster == 1):
                cute.copy(tma_kv, tKVg[None, tile, part], tKVs[None, kv_state.index, part],
                          tma_bar_ptr=pipe.producer_get_barrier(kv_state))
            else:
                cute.copy(tma_kv, tKVg[None, tile, part], tKVs[None, kv_state.index, part],
                          tma_bar_ptr=pipe.producer_get_barrier(kv_state),
                          mcast_mask=cutlass.Int16((1 << self.cluster) - 1))

    @cute.jit
    def _produce_split(self, tma_kv: cute.CopyAtom, tKVs: cute.Tensor, tKVg: cute.Tensor, kv_pipe: KVSplit, kv_state,
                       tile: Int32):
        """One page's loads for kv_split (KVSplit): the rope columns, then the half of V the stage's owner reads (the
        owner of ring stage s is consumer s), then the other half, each part as soon as it is free, in 64-column
        boxes. `tile`: the page's row tile in the [64 / cluster, 576] tiling of the cache (c * page + rank)."""
        mask = cutlass.Int16((1 << self.cluster) - 1)
        kv_pipe.rope.producer_acquire(kv_state)
        self._load_box(tma_kv, tKVs, tKVg, tile, kv_state.index, D_V // 64, kv_pipe.rope.producer_get_barrier(kv_state),
                       mask)
        for j in cutlass.range_constexpr(2):
            w = kv_state.index ^ j
            half = kv_pipe.half_state(kv_state, w)
            kv_pipe.halves.producer_acquire(half)
            for b in cutlass.range_constexpr(HALF_V // 64):
                self._load_box(tma_kv, tKVs, tKVg, tile, kv_state.index, w * (HALF_V // 64) + b,
                               kv_pipe.halves.producer_get_barrier(half), mask)

    @cute.jit
    def _load_box(self, tma_kv: cute.CopyAtom, tKVs: cute.Tensor, tKVg: cute.Tensor, tile: Int32, stage: Int32,
                  box: Int32, barrier, mask):
        """One 64-column box of a page into ring stage `stage`, completing on `barrier` (multicast in clusters)."""
        if const_expr(self.cluster == 1):
            cute.copy(tma_kv, tKVg[None, tile, box], tKVs[None, stage, box], tma_bar_ptr=barrier)
        else:
            cute.copy(tma_kv, tKVg[None, tile, box], tKVs[None, stage, box], tma_bar_ptr=barrier, mcast_mask=mask)

    @cute.jit
    def _pad_tile(self, kv_pipe: KVSplit, st: pipeline.PipelineState, cw: Int32):
        """A pad tile of pad_items (ring state st, stage 1, owned by consumer 1): the page the producer loaded is
        waited for and freed unread, so that the item's tiles start on stage 0 with consumer 0 as their first owner.
        Consumer 0 owned the tile before (the last of an earlier item) and owns the next: it waits for consumer 1's
        "P ready" of the pad, which comes after consumer 1's last read of P and m, before it writes them again."""
        kv_pipe.wait_half(st, cw)
        kv_pipe.release_half(st, cw)
        if cw == 1:
            kv_pipe.rope.consumer_wait(st)
            kv_pipe.rope.consumer_release(st)
            cute.arch.barrier_arrive(barrier_id=BAR_P_READY + 1, number_of_threads=CONSUMER_THREADS)
        else:
            cute.arch.barrier(barrier_id=BAR_P_READY + 1, number_of_threads=CONSUMER_THREADS)

    @cute.jit
    def _consume_item(self, kv_pipe, q_pipe, q_state, ops, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
                      tiled_mma_pv_rs: cute.TiledMma, sKV: cute.Tensor, sMax: cute.Tensor, sSum: cute.Tensor,
                      mOut: cute.Tensor, mLse: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, cw: Int32, ctid: Int32,
                      seqlen: Int32, start: Int32, n_tiles: Int32, g, batch: Int32, split: Int32, m_block: Int32,
                      s_q: Int32, h: Int32, rows: Int32, scale_log2: Float32, trace_slot: Int32 = 0, piece=None,
                      mTrace=None):
        """One consumer's part of one (request, row tile, split): its tiles of the seesaw, then its half of the
        output. `g` counts the tiles this CTA ran before (persistent launches; 0 otherwise): ring stage and owner
        of the item's tile t are those of tile g + t. `piece` (stream-K launches): (item, first tile, end tile,
        the item's tiles, slot, slots, cluster rank, smem storage) for merge_piece. `mTrace`: where traced
        launches record (mPO by default; stream-K launches' is in the schedule's buffer)."""
        (tSrQ, tSrK, tOrPs, tOrV, tOrV_rs, tOrP, tPsP, acc_s, acc_o, tScS, tOcO, rP) = ops
        mT = mPO if mTrace is None else mTrace
        # A wgmma m64 accumulator gives each thread two rows, r0 and r0 + 8 (value index i: bit 1 picks
        # the row), shared with the three other lanes of its quad.
        r0 = (ctid // 32) * 16 + (ctid % 32) // 4
        vis = cute.make_rmem_tensor(2, Int32)      # keys visible to each of the thread's rows
        row_m = cute.make_rmem_tensor(2, Float32)  # the max (log2 units) O_w and row_l are scaled to
        row_l = cute.make_rmem_tensor(2, Float32)  # this thread's part of the sums of its own tiles' P
        for hr in cutlass.range_constexpr(2):
            vis[hr] = visible_keys(seqlen, s_q, h, m_block * TILE_M + r0 + 8 * hr, self.causal)
            row_m[hr] = -Float32.inf
            row_l[hr] = 0.0
        min_vis = first_masked_key(seqlen, s_q, self.causal)

        q_pipe.consumer_wait(q_state)
        if const_expr(self.trace):
            if ctid == 0:
                self._trace(mT, trace_slot, T_Q + 4 * cw, cute.arch.clock())
        first = cw
        if const_expr(self.persistent):
            first = (cw + g) % 2
        lazy = self.lazy_rescale
        if const_expr(self.kv_split):
            self._seesaw_split(kv_pipe, ops, tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_rs, sKV, sMax, sSum, mT, cw,
                               ctid, r0, vis, row_m, row_l, min_vis, seqlen, start, n_tiles, g, first, q_state.phase,
                               scale_log2, trace_slot)
        else:
            for t in cutlass.range(first, n_tiles, 2, unroll=1):
                tok0 = start + t * TILE_N
                own = tile_state(g + t)
                if t > 0:
                    # -- a, b: the other consumer's tile t - 1 into this half of O --
                    if const_expr(self.cluster > 1):
                        # issued, not waited for: S below is queued right behind it
                        other_tile_pv_issue(cw, tile_state(g + t - 1), kv_pipe.consumer_wait, sMax, r0, row_m, row_l,
                                            acc_o, tiled_mma_pv, tOrPs, tOrV, lazy)
                    else:
                        other_tile_pv(cw, tile_state(g + t - 1), kv_pipe.consumer_wait, kv_pipe.consumer_release, sMax,
                                      r0, row_m, row_l, acc_o, tiled_mma_pv, tOrPs, tOrV, lazy)
                # -- c: S = Q K_t^T --
                if const_expr(self.kv_parts > 1):
                    issue_mma_by_part(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, own.index], kv_pipe.pipes, own)
                else:
                    kv_pipe.consumer_wait(own)
                    issue_mma(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, own.index], True)
                if const_expr(self.cluster > 1):
                    # b's wgmma ran ahead of S in the same queue: wait for it and free its stage
                    warpgroup.wait_group(1)
                    if t > 0:
                        kv_pipe.consumer_release(tile_state(g + t - 1))
                warpgroup.wait_group(0)
                # -- d, e: mask, running max, P; publish P(t), m(t) --
                alpha = self._own_tile_softmax(acc_s, row_m, row_l, rP, tPsP, tScS, vis, sMax, sSum, sKV, tok0, min_vis,
                                               seqlen, own.index, t, n_tiles, r0, cw, ctid, q_state.phase, scale_log2)
                # -- f: O_w = alpha O_w + P(t) V_{t,w}, P from registers --
                self._own_tile_pv(acc_o, alpha, tiled_mma_pv_rs, tOrP, tOrV_rs, own, kv_pipe.consumer_release, mT,
                                      trace_slot, t, first, cw, ctid)

            if const_expr(self.trace):
                if ctid == 0:
                    self._trace(mT, trace_slot, T_LOOP + 4 * cw, cute.arch.clock())
            # the last tile is the other consumer's: its P into this half of O, this consumer's row sums (final once
            # rescaled to that tile's max) published while the wgmma runs
            if n_tiles > 0 and (g + n_tiles - 1) % 2 != cw:
                last = tile_state(g + n_tiles - 1)
                if const_expr(self.early_sums):
                    other_tile_pv_issue(cw, last, kv_pipe.consumer_wait, sMax, r0, row_m, row_l, acc_o, tiled_mma_pv,
                                        tOrPs, tOrV, lazy)
                    publish_row_sums(row_l, sSum, r0, cw, ctid, q_state.phase)
                    warpgroup.wait_group(0)
                    kv_pipe.consumer_release(last)
                else:
                    other_tile_pv(cw, last, kv_pipe.consumer_wait, kv_pipe.consumer_release, sMax, r0, row_m, row_l,
                                  acc_o, tiled_mma_pv, tOrPs, tOrV, lazy)
        if const_expr(self.early_sums):
            if n_tiles == 0:
                publish_row_sums(row_l, sSum, r0, cw, ctid, q_state.phase)
        if const_expr(self.persistent):
            # every S of this item is done: the producer may load the next item's Q (during this epilogue)
            q_pipe.consumer_release(q_state)
        if const_expr(self.trace):
            if ctid == 0:
                self._trace(mT, trace_slot, T_EPI + 4 * cw, cute.arch.clock())

        # -- epilogue: whole row sums (both consumers', at the final max), normalize, store --
        inv_l = cute.make_rmem_tensor(2, Float32)
        lse = cute.make_rmem_tensor(2, Float32)
        if const_expr(self.early_sums):
            take_row_sums(row_m, sSum, r0, cw, q_state.phase, inv_l, lse)
        else:
            finish_rows(row_m, row_l, sSum[None, None, 0], r0, cw, ctid, inv_l, lse, barrier_id=BAR_SUM)
            if const_expr(self.persistent):
                # both consumers have read sSum before either writes the next item's
                cute.arch.barrier(barrier_id=BAR_SUM, number_of_threads=CONSUMER_THREADS)
        if const_expr(self.trace):
            if ctid == 0 and cw == 0:
                self._trace(mT, trace_slot, T_SUMS, cute.arch.clock())
        owner = Int32(1)         # this CTA stores the rows' output (stream-K: not a piece another one merges)
        if const_expr(self.streamk):
            owner = merge_piece(acc_o, inv_l, lse, mPO, mPL, r0, cw, ctid, piece, self.cluster)
        if owner != 0:
            full = m_block * TILE_M + TILE_M <= rows
            if const_expr(self.store16):
                if full:
                    store_dense_block(acc_o, inv_l, mOut, mPO, batch, split, m_block, rows, r0, cw, ctid,
                                      self.is_split, "bf16" if const_expr(self.dtype == cutlass.BFloat16) else "f16")
                else:
                    scale_rows(acc_o, inv_l)
                    self._store_o(acc_o, tiled_mma_pv, tOcO, mOut, mPO, cw, ctid, batch, split, m_block, rows, False)
            else:
                scale_rows(acc_o, inv_l)
                self._store_o(acc_o, tiled_mma_pv, tOcO, mOut, mPO, cw, ctid, batch, split, m_block, rows, full)
            store_dense_lse(lse, mLse, mPL, batch, split, m_block, rows, r0, cw, ctid, self.is_split)

    @cute.jit
    def _seesaw_split(self, kv_pipe: KVSplit, ops, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
                      tiled_mma_pv_rs: cute.TiledMma, sKV: cute.Tensor, sMax: cute.Tensor, sSum: cute.Tensor,
                      mT: cute.Tensor, cw: Int32, ctid: Int32, r0: Int32, vis: cute.Tensor, row_m: cute.Tensor,
                      row_l: cute.Tensor, min_vis: Int32, seqlen: Int32, start: Int32, n_tiles: Int32, g, first,
                      parity: Int32, scale_log2: Float32, trace_slot: Int32):
        """The seesaw's tiles on kv_split's ring (KVSplit), S issued before the wait for the other consumer's P. One
        own tile t of consumer w, in order:
          c1. wait for the rope columns and V's half w of tile t; issue their k-blocks of S(t) (both were freed by
              this consumer, so they land first)
          a, b. wait for P(t-1) and m(t-1); O_w rescaled; issue O_w += P(t-1) V_{t-1,w} (S(t)'s first part runs
              meanwhile, and before that while the other consumer's softmax(t-1) runs)
          c2. wait for the other half; issue its k-blocks of S(t); wait for all: free half w of tile t-1 and the rope
              columns of tile t
          d, e. softmax(t), publish P(t), m(t) (as in the default order)
          f. O_w rescaled; O_w += P(t) V_{t,w}; wait; free half w of tile t.
        Each part is freed by the one consumer that reads it last, so a page's refill starts part by part instead of
        after both consumers' P V."""
        (tSrQ, tSrK, tOrPs, tOrV, tOrV_rs, tOrP, tPsP, acc_s, acc_o, tScS, tOcO, rP) = ops
        lazy = self.lazy_rescale
        for t in cutlass.range(first, n_tiles, 2, unroll=1):
            tok0 = start + t * TILE_N
            own = tile_state(g + t)
            prev = tile_state(g + t - 1)           # used only for t > 0
            tSrK_t = tSrK[None, None, None, own.index]
            # -- c1: the rope's and V half w's k-blocks of S(t) --
            kv_pipe.rope.consumer_wait(own)
            kv_pipe.wait_half(own, cw)
            self._issue_s_part(tiled_mma_qk, acc_s, tSrQ, tSrK_t, cw, True)
            if t > 0:
                # -- a, b: the other consumer's tile t - 1 into this half of O, issued behind S(t)'s first part --
                other_tile_pv_issue(cw, prev, lambda st: kv_pipe.wait_half(st, cw), sMax, r0, row_m, row_l, acc_o,
                                    tiled_mma_pv, tOrPs, tOrV, lazy)
            # -- c2: the other half's k-blocks --
            kv_pipe.wait_half(own, 1 - cw)
            self._issue_s_part(tiled_mma_qk, acc_s, tSrQ, tSrK_t, cw, False)
            warpgroup.wait_group(0)
            if t > 0:
                kv_pipe.release_half(prev, cw)
            kv_pipe.rope.consumer_release(own)
            # -- d, e: mask, running max, P; publish P(t), m(t) --
            alpha = self._own_tile_softmax(acc_s, row_m, row_l, rP, tPsP, tScS, vis, sMax, sSum, sKV, tok0, min_vis,
                                           seqlen, own.index, t, n_tiles, r0, cw, ctid, parity, scale_log2)
            # -- f: O_w = alpha O_w + P(t) V_{t,w}, P from registers --
            self._own_tile_pv(acc_o, alpha, tiled_mma_pv_rs, tOrP, tOrV_rs, own,
                                  lambda st: kv_pipe.release_half(st, cw), mT, trace_slot, t, first, cw, ctid)

        if const_expr(self.trace):
            if ctid == 0:
                self._trace(mT, trace_slot, T_LOOP + 4 * cw, cute.arch.clock())
        if n_tiles > 0 and (g + n_tiles - 1) % 2 != cw:
            # the last tile is the other consumer's (as in the default order)
            last = tile_state(g + n_tiles - 1)
            other_tile_pv_issue(cw, last, lambda st: kv_pipe.wait_half(st, cw), sMax, r0, row_m, row_l, acc_o,
                                tiled_mma_pv, tOrPs, tOrV, lazy)
            if const_expr(self.early_sums):
                publish_row_sums(row_l, sSum, r0, cw, ctid, parity)
            warpgroup.wait_group(0)
            kv_pipe.release_half(last, cw)

    @cute.jit
    def _issue_s_part(self, tiled_mma_qk: cute.TiledMma, acc_s: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor,
                      cw: Int32, first: cutlass.Constexpr[bool]):
        """kv_split's S in two committed groups: `first`, the rope's k-blocks then V half cw's (zeroing acc_s);
        otherwise the other half's."""
        if cw == 0:
            issue_k_blocks(tiled_mma_qk, acc_s, tSrQ, tSrK, s_part_blocks(0, first), first)
        else:
            issue_k_blocks(tiled_mma_qk, acc_s, tSrQ, tSrK, s_part_blocks(1, first), first)

    @cute.jit
    def _own_tile_pv(self, acc_o: cute.Tensor, alpha: cute.Tensor, tiled_mma_pv_rs: cute.TiledMma, tOrP: cute.Tensor,
                     tOrV_rs: cute.Tensor, own, release, mT: cute.Tensor, trace_slot: Int32, t: Int32, first,
                     cw: Int32, ctid: Int32):
        """Step f of the owner's tile (state `own`): O_w = alpha O_w + P(t) V_{t,w} with P from registers, waited;
        then `release(own)` frees what this consumer read of the stage."""
        rescale_rows(acc_o, alpha, self.lazy_rescale)
        issue_mma(tiled_mma_pv_rs, acc_o, tOrP, tOrV_rs[None, None, None, own.index], False)
        warpgroup.wait_group(0)
        release(own)
        if const_expr(self.trace):
            if ctid == 0 and t < first + 2:
                self._trace(mT, trace_slot, T_FIRST + 4 * cw, cute.arch.clock())

    @cute.jit
    def _own_tile_softmax(self, acc_s: cute.Tensor, row_m: cute.Tensor, row_l: cute.Tensor, rP: cute.Tensor,
                          tPsP: cute.Tensor, tScS: cute.Tensor, vis: cute.Tensor, sMax: cute.Tensor, sSum: cute.Tensor,
                          sKV: cute.Tensor, tok0: Int32, min_vis: Int32, seqlen: Int32, stage: Int32, t: Int32,
                          n_tiles: Int32, r0: Int32, cw: Int32, ctid: Int32, parity: Int32, scale_log2: Float32):
        """Steps d and e of the owner's tile t (in ring stage `stage`), S in acc_s: mask, running max, P into rP and
        smem, m(t) into sMax, V rows past the request's end zeroed, "P(t) ready" -> alpha, O_w's rescale for f."""
        # -- d: mask, running max, P --
        if const_expr(not self.fold_scale):
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = acc_s[i] * scale_log2
        if tok0 + TILE_N > min_vis:
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                if tok0 + tScS[i][1] >= vis[(i // 2) % 2]:
                    acc_s[i] = -Float32.inf
        if const_expr(self.spec_exp):
            alpha = speculative_p(acc_s, row_m, row_l, rP, tPsP, scale_log2, self.tree_max)
        else:
            mx = cute.make_rmem_tensor(2, Float32)
            if const_expr(self.fold_scale):
                # the scale is positive: the max of the unscaled S, scaled, is the max of the scaled
                mx[0] = -Float32.inf
                mx[1] = -Float32.inf
            else:
                mx[0] = row_m[0]
                mx[1] = row_m[1]
            fold_row_max(acc_s, mx, self.tree_max)
            if const_expr(self.fold_scale):
                for hr in cutlass.range_constexpr(2):
                    mx[hr] = cute.arch.fmax(row_m[hr], mx[hr] * scale_log2)
            alpha, m_base = quad_row_max(mx, row_m, row_l, self.lazy_rescale)
            exp_p(acc_s, m_base, row_l, rP, scale_log2 if const_expr(self.fold_scale) else None)
        # -- e: publish P(t), m(t) --
        if const_expr(not self.spec_exp):
            cute.autovec_copy(rP, tPsP)      # (speculative_p stores its own)
        if ctid % 4 == 0:
            sMax[r0] = row_m[0]
            sMax[r0 + 8] = row_m[1]
        if tok0 + TILE_N > seqlen:
            # cache rows past the request's end: zero all 512 V columns of this tile (NaN * 0 is NaN)
            for k in cutlass.range(seqlen - tok0, TILE_N, unroll=1):
                for c in cutlass.range_constexpr(D_V // 128):
                    sKV[k, c * 128 + ctid, stage] = sKV.element_type(0.0)
        # generic-proxy smem writes (P, zeroed V) become visible to wgmma's async proxy
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier_arrive(barrier_id=BAR_P_READY + cw, number_of_threads=CONSUMER_THREADS)
        if const_expr(self.early_sums):
            if t == n_tiles - 1:
                # this consumer's row sums are final (the last tile is its own): out to the other one now
                publish_row_sums(row_l, sSum, r0, cw, ctid, parity)
        if tok0 + TILE_N > seqlen:
            # this consumer's own P V below reads V rows its other threads zeroed
            cute.arch.barrier(barrier_id=BAR_WG + cw, number_of_threads=128)
        return alpha

    @cute.jit
    def _store_o(self, acc_o: cute.Tensor, tiled_mma_pv: cute.TiledMma, tOcO: cute.Tensor, mOut: cute.Tensor,
                 mPO: cute.Tensor, cw: Int32, ctid: Int32, batch: Int32, split: Int32, m_block: Int32, rows: Int32,
                 full):
        """This consumer's normalized [64, 256] block of the output (or fp32 split partial) in the accumulator's
        layout: a thread's values come in pairs of adjacent columns, which autovec_copy stores as one 4-byte
        (bf16) / 8-byte (fp32) access; row by row in the last row block of a request whose s_q * h is not a
        multiple of 64 (`full` False)."""
        if const_expr(self.is_split):
            gO = cute.local_tile(mPO[batch, split, None, None], (TILE_M, HALF_V), (m_block, cw))
            rO = acc_o
        else:
            gO = cute.local_tile(mOut[batch, None, None], (TILE_M, HALF_V), (m_block, cw))
            rO = cute.make_fragment_like(acc_o, self.dtype)
            rO.store(acc_o.load().to(self.dtype))
        tOgO = tiled_mma_pv.get_slice(ctid).partition_C(gO)
        if full:
            cute.autovec_copy(rO, tOgO)
        else:
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                if m_block * TILE_M + tOcO[i][0] < rows:
                    tOgO[i] = rO[i]

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

    @cute.jit
    def _produce_items(self, tma_q: cute.CopyAtom, mQ_tma: cute.Tensor, tma_kv: cute.CopyAtom, tKVs: cute.Tensor,
                       tKVg: cute.Tensor, sQ: cute.Tensor, mBT: cute.Tensor, mSeqlens: cute.Tensor,
                       mSched: cute.Tensor, mOrder: cute.Tensor, q_pipe, kv_pipe, item_pipe, q_state, kv_state,
                       storage, rows: Int32, rank: Int32, cid: Int32, n_clusters: Int32):
        """The producer warp of a persistent launch: item `cid` first, then tickets from mSched[0] (offset by the
        clusters launched) until one is past the last item; each item is handed to the consumers, then its Q and
        pages are loaded. Items are (request, pair of row tiles), request-major over the requests in mOrder's
        order (longest first); CTA r of a cluster takes row tile pair * cluster + r. The last cluster to finish
        resets the counters for the next launch."""
        pairs = cute.ceil_div(rows, TILE_M) // self.cluster
        n_items = cute.size(mSeqlens) * pairs
        item_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, ITEM_STAGES)
        chan_phase = Int32(0)
        item = cid
        while item < n_items:
            item_state = publish_item(item_pipe, item_state, storage, item)
            slot = item * self.cluster + rank     # this CTA's part of the item (traced launches)
            if const_expr(self.trace):
                if cute.arch.lane_idx() == 0:
                    self._trace(mSched, slot, T_PUB, cute.arch.clock())
            batch = Int32(mOrder[item // pairs])
            m_block = (item % pairs) * self.cluster + rank
            n_tiles = (mSeqlens[batch] + TILE_N - 1) // TILE_N
            pad = 0
            if const_expr(self.pad_items):
                pad = kv_state.index * cutlass.min(n_tiles, 1)     # the ring's stage is 1: a pad tile first
            kv_state = self._produce_item(tma_q, mQ_tma, tma_kv, tKVs, tKVg, sQ, mBT, q_pipe, kv_pipe, q_state,
                                          kv_state, batch, m_block, 0, n_tiles, rank, mSched, slot, pad)
            q_state.advance()
            item = fetch_ticket(mSched, storage, rank, n_clusters, n_items, chan_phase, self.cluster)
            chan_phase = chan_phase ^ 1
        item_state = publish_item(item_pipe, item_state, storage, item)   # past the last: the consumers stop
        if rank == 0:
            if cute.arch.lane_idx() == 0:
                done = cute.arch.atomic_add(mSched.iterator + 1, Int32(1))
                if done == n_clusters - 1:
                    # every cluster has drawn its last ticket: nobody touches the counters again in this launch
                    mSched[0] = Int32(0)
                    mSched[1] = Int32(0)
        return kv_state
