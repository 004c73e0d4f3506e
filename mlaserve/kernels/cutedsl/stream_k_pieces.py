"""The stream-K pieces of the persistent CuTe dense decode (mla_decode_kernel.py, MLADecodeSm90(streamk=True)):
how a slot walks its pieces of the static balanced schedule (mlaserve.kernels.triton.stream_k) and how the pieces
of a cut item merge. Everything here is inlined into the kernel at trace time.

The workspace (mla_decode.stream_k_buffers' fp32 buffer, mWS) holds an entry per slot s, kind k (0: the
continuation piece at the slot's start, 1: the first piece at its end) and CTA rank r, entry (2 s + k) * cluster
+ r: the normalized O of its 64 rows (64 x 512 fp32, in the consumer threads' register order: _chunk_at), then,
after all entries' O, 64 lse each. The schedule's
buffer (mSched) holds W, I, CONT (3 slots + 2 int32), then an arrival counter per slot and rank (indexed by the
slot of the item's first piece) and a ready flag per entry.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from mlaserve.kernels.cutedsl.seesaw_consumers import CONSUMER_THREADS, D_V, HALF_V, TILE_M, TILE_N
from mlaserve.kernels.cutedsl.split_consumers import row_of, scale_rows

BAR_SK = 6            # both consumers, around the arrival count and the partials' handover
WG_THREADS = 128      # a consumer warpgroup's threads
_LOG2E = 1.4426950408889634


def _lse_at(n_slots, entry, cluster: int):
    """Where workspace entry `entry`'s 64 lse start: after every entry's rows of O."""
    return n_slots * 2 * cluster * TILE_M * D_V + entry * TILE_M


@cute.jit
def first_piece(mSched: cute.Tensor, s: Int32, n_slots: Int32):
    """Slot s's first piece and bounds -> (item, first tile, its position in the sequence W_s, W_s+1, the
    first item of the next slot I_s+1). The slot starts inside item I_s - 1 where CONT_s > 0."""
    item = mSched[n_slots + 1 + s]
    lo = Int32(0)
    cont = mSched[2 * n_slots + 2 + s]
    if cont > 0:
        item = item - 1
        lo = cont
    return item, lo, mSched[s], mSched[s + 1], mSched[n_slots + 2 + s]

@cute.jit
def piece_of(mSeqlens: cute.Tensor, item: Int32, lo: Int32, pos: Int32, w1: Int32, rank: Int32,
             cluster: cutlass.Constexpr[int]):
    """The piece of `item` (row-tile pair item // b of request item % b) from tile `lo` at sequence position
    `pos` in a slot ending at w1 -> (request, row tile, its length, its tiles, the piece's end tile)."""
    b = cute.size(mSeqlens)
    batch = item % b
    seqlen = mSeqlens[batch]
    n = (seqlen + TILE_N - 1) // TILE_N
    return batch, (item // b) * cluster + rank, seqlen, n, cutlass.min(n, lo + w1 - pos)

@cute.jit
def merge_piece(acc_o: cute.Tensor, inv_l: cute.Tensor, lse: cute.Tensor, mWS: cute.Tensor, mSched: cute.Tensor,
                r0: Int32, cw: Int32, ctid: Int32, piece, cluster: cutlass.Constexpr[int]) -> Int32:
    """After a piece's row sums: 1 if this CTA is to store the rows' output (acc_o, inv_l, lse then hold the
    whole item's), 0 if another piece of the item will.

    A whole item stores its own. The pieces of a cut item (first piece at the end of slot s0, the others at
    the start of slots s0 + 1 ..) count their arrivals on the item's counter; each but the last writes its
    normalized O and lse into its workspace entry (slot, kind: 0 a continuation, 1 a first piece) and flags
    it ready; the last folds all pieces in slot order, whatever order they finished in (the first piece from
    registers when it is the last, as it nearly always is: else its own partial is written and read back
    like the others), so that the result does not depend on timing. It waits only for pieces that have
    arrived, which are running their epilogues: no slot waits for a slot that has not started. The counters
    and flags start at zero: the schedule kernel clears them before each launch."""
    item, lo, hi, n_tiles, s, n_slots, rank, storage = piece
    owner = Int32(1)
    if lo > 0 or hi < n_tiles:
        # the slots of the item's pieces: s0 .. s_end - 1
        s0 = s
        if lo > 0:
            s0 = s - 1
            while mSched[2 * n_slots + 2 + s0] > 0 and mSched[n_slots + 1 + s0] - 1 == item:
                s0 = s0 - 1
        s_end = s0 + 1
        while s_end < n_slots and mSched[2 * n_slots + 2 + s_end] > 0 and mSched[n_slots + 1 + s_end] - 1 == item:
            s_end = s_end + 1
        counter = 3 * n_slots + 2 + s0 * cluster + rank
        ready = 3 * n_slots + 2 + n_slots * cluster       # + workspace entry
        arrivals = storage.arrivals.get_tensor(cute.make_layout(2))
        if cw == 0 and ctid == 0:
            arrivals[0] = cute.arch.atomic_add(mSched.iterator + counter, Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.barrier(barrier_id=BAR_SK, number_of_threads=CONSUMER_THREADS)
        last = arrivals[0] == s_end - s0 - 1
        me = (s * 2) * cluster + rank
        if lo == 0:
            me = (s * 2 + 1) * cluster + rank
        if not last or lo > 0:
            _store_partial(acc_o, inv_l, lse, mWS, me, n_slots, r0, cw, ctid, cluster)
        if not last:
            # every thread's stores of the partial, then one thread's fence (cumulative over them through the
            # barrier) and the flag
            cute.arch.barrier(barrier_id=BAR_SK, number_of_threads=CONSUMER_THREADS)
            if cw == 0 and ctid == 0:
                cute.arch.fence_acq_rel_gpu()
                cute.arch.store(mSched.iterator + ready + me, Int32(1), sem="relaxed", scope="gpu")
            owner = Int32(0)
        else:
            cur = cute.make_rmem_tensor(2, Float32)
            for j in cutlass.range(s0, s_end, unroll=1):
                entry = (j * 2) * cluster + rank
                if j == s0:
                    entry = (j * 2 + 1) * cluster + rank
                if j == s0 and lo == 0:
                    scale_rows(acc_o, inv_l)
                    cur[0] = lse[0]
                    cur[1] = lse[1]
                else:
                    if j != s:
                        if cw == 0 and ctid == 0:
                            while cute.arch.load(mSched.iterator + ready + entry, Int32, sem="acquire",
                                                 scope="gpu") == 0:
                                pass
                        cute.arch.barrier(barrier_id=BAR_SK, number_of_threads=CONSUMER_THREADS)
                    _fold_partial(acc_o, cur, mWS, entry, n_slots, r0, cw, ctid, j == s0, cluster)
            for hr in cutlass.range_constexpr(2):
                inv_l[hr] = 1.0
                lse[hr] = cur[hr]
    return owner

@cute.jit
def _store_partial(acc_o: cute.Tensor, inv_l: cute.Tensor, lse: cute.Tensor, mWS: cute.Tensor, entry: Int32,
                   n_slots: Int32, r0: Int32, cw: Int32, ctid: Int32, cluster: cutlass.Constexpr[int]):
    """A piece's normalized O (acc_o scaled in place) and lse into workspace entry `entry`, O in the registers'
    order (_chunk_at), the lse after all entries' rows."""
    scale_rows(acc_o, inv_l)
    base = mWS.iterator.toint()
    for k in cutlass.range_constexpr(cute.size(acc_o) // 4):
        _st_global_v4_f32([acc_o[4 * k + e] for e in range(4)], base + _chunk_at(entry, cw, ctid, k))
    if cw == 0 and ctid % 4 == 0:
        for hr in cutlass.range_constexpr(2):
            mWS[_lse_at(n_slots, entry, cluster) + r0 + 8 * hr] = lse[hr]


@cute.jit
def _fold_partial(acc_o: cute.Tensor, cur: cute.Tensor, mWS: cute.Tensor, entry: Int32, n_slots: Int32, r0: Int32,
                  cw: Int32, ctid: Int32, first, cluster: cutlass.Constexpr[int]):
    """acc_o (normalized, log-sum-exp cur per row) merged with workspace entry `entry` (normalized, its own
    lse), or replaced by it where `first`. The entry holds this thread's values where it keeps them in acc_o
    (_store_partial of the same thread of another piece), read in 16-byte loads after the weights are known, so
    that each is folded as it arrives and its registers are free for the next. Plain loads (ld.global.cg, a
    strong load, issued one after another: ~20 us a merge at the end of every slot on the H200): the entry is
    this CTA's own (its stores passed through L1) or was flagged ready to an acquire load, whose L1 invalidation
    (CCTL.IVALL) keeps stale lines of an earlier launch out."""
    lse_base = _lse_at(n_slots, entry, cluster)
    ca = cute.make_rmem_tensor(2, Float32)
    cb = cute.make_rmem_tensor(2, Float32)
    for hr in cutlass.range_constexpr(2):
        lp = mWS[lse_base + r0 + 8 * hr]
        ca[hr] = 0.0
        cb[hr] = 1.0
        if not first:
            mx = cute.arch.fmax(cur[hr], lp)
            cb[hr] = 0.0
            if mx != -Float32.inf:
                ea = cute.math.exp2((cur[hr] - mx) * _LOG2E, fastmath=False)
                eb = cute.math.exp2((lp - mx) * _LOG2E, fastmath=False)
                ca[hr] = ea / (ea + eb)
                cb[hr] = eb / (ea + eb)
                lp = mx + cute.math.log2(ea + eb, fastmath=False) / _LOG2E
        cur[hr] = lp
    base = mWS.iterator.toint()
    for k in cutlass.range_constexpr(cute.size(acc_o) // 4):
        v = _ld_global_v4_f32(base + _chunk_at(entry, cw, ctid, k))
        for e in cutlass.range_constexpr(4):
            acc_o[4 * k + e] = acc_o[4 * k + e] * ca[row_of(4 * k + e)] + v[e] * cb[row_of(4 * k + e)]


def _chunk_at(entry: Int32, cw: Int32, ctid: Int32, k: int) -> Int64:
    """The byte offset in the workspace of values 4k .. 4k + 3 of thread ctid of consumer cw in entry `entry`:
    chunk k of all 128 threads of a consumer in a row (16 bytes a thread, so a warp's store or load of a chunk
    is 512 contiguous bytes), the consumer's 32 chunks after each other, consumer 1 after consumer 0."""
    return Int64(entry * TILE_M * D_V + cw * TILE_M * HALF_V + (k * WG_THREADS + ctid) * 4) * 4


@dsl_user_op
def _st_global_v4_f32(v: list, addr: Int64, *, loc=None, ip=None) -> None:
    """4 fp32 as one 16-byte store at global address `addr` (16-byte aligned)."""
    llvm.inline_asm(
        None, [*(Float32(x).ir_value(loc=loc, ip=ip) for x in v), Int64(addr).ir_value(loc=loc, ip=ip)],
        "st.global.v4.f32 [$4], {$0, $1, $2, $3};", "f,f,f,f,l",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def _ld_global_v4_f32(addr: Int64, *, loc=None, ip=None) -> list:
    """The 4 fp32 at global address `addr` (16-byte aligned), one 16-byte load. It keeps its place among the
    kernel's other memory operations (after the acquire load of the entry's flag)."""
    quad = llvm.inline_asm(
        ir.Type.parse("!llvm.struct<(f32,f32,f32,f32)>"), [Int64(addr).ir_value(loc=loc, ip=ip)],
        "ld.global.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Float32(llvm.extractvalue(Float32.mlir_type, quad, [e])) for e in range(4)]
