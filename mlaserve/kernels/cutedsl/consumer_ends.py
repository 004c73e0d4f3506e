"""The end of the keys-on-M FP8 decode kernels' two consumers (mla_decode_fp8_mma_kernel.py,
mla_decode_fp8_f16_kernel.py), which take alternate pages, each with its own O^T, column maxima and sums: they are
merged through a stash in smem, the consumer's stages, once its pages are all read. Either consumer 0 merges and
stores all of O^T (one_consumer_end) or each merges and stores half of its dims (split_consumer_end); both give
the same bits. Everything here is inlined into the calling kernel at trace time.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from mlaserve.kernels.cutedsl.boxed_pages import (
    BAR_MERGE, BAR_RED, CONSUMER_THREADS, KV_BYTES, M_TILES, THREADS, v_dim)
from mlaserve.kernels.cutedsl.fp8_pages import D_PE, D_V, TILE_N
from mlaserve.kernels.cutedsl.keys_on_m import col_slot, finish_columns, store_lse


def stash_tensors(parts: list, ml_ptr: cute.Pointer, vals: int, slots: int, threads: int, tiles: int = M_TILES):
    """A consumer's stash in smem: `tiles` of O^T's tiles spread evenly over the Float32 pointers `parts` (vals
    values a tile and thread, thread-minor), and its maxima and sums (2 slots values a thread) at ml_ptr."""
    per = tiles // len(parts)
    merge = [cute.make_tensor(p, cute.make_layout((threads, per * vals), stride=(1, threads))) for p in parts]
    merge_ml = cute.make_tensor(ml_ptr, cute.make_layout((threads, 2 * slots), stride=(1, threads)))
    return merge, merge_ml


@cute.jit
def stash_consumer(acc_o: list, col_m: cute.Tensor, col_l: cute.Tensor, ctid: Int32, merge: list,
                   merge_ml: cute.Tensor, tiles: cutlass.Constexpr = None):
    """A consumer leaves O^T's tiles `tiles` (all when None; the j-th of them at stash place j), its maxima and its
    sums in stash_tensors' smem."""
    chosen = list(range(M_TILES)) if const_expr(tiles is None) else tiles
    per = len(chosen) // len(merge)
    vals = cute.size(acc_o[0])
    slots = cute.size(col_m)
    for j in cutlass.range_constexpr(len(chosen)):
        for i in cutlass.range_constexpr(vals):
            merge[j // per][ctid, (j % per) * vals + i] = acc_o[chosen[j]][i]
    for s in cutlass.range_constexpr(slots):
        merge_ml[ctid, s] = col_m[s]
        merge_ml[ctid, slots + s] = col_l[s]


@cute.jit
def merge_stash(acc_o: list, col_m: cute.Tensor, col_l: cute.Tensor, ctid: Int32, merge: list,
                merge_ml: cute.Tensor, n: cutlass.Constexpr[int], tiles: cutlass.Constexpr = None,
                own_first: cutlass.Constexpr[bool] = True):
    """A consumer folds the other's stash (stash_consumer, the same `tiles`) into its own O^T tiles, maxima and
    sums: both rescaled to the larger maximum of each column (a column neither saw stays at -inf, its sums 0).
    own_first: this consumer is consumer 0, whose merge LLVM contracts to fma(own, a0, other * a1): consumer 0's
    product exact, consumer 1's rounded. Else the fma is written out with the other's (consumer 0's) product exact,
    so that both consumers' merges round alike (FP8_SPLIT_EPILOGUE's halves have the one-consumer merge's bits):
    written as a sum with the other's value first, LLVM reordered the sum and contracted the own product instead."""
    chosen = list(range(M_TILES)) if const_expr(tiles is None) else tiles
    per = len(chosen) // len(merge)
    vals = cute.size(acc_o[0])
    slots = cute.size(col_m)
    a0 = cute.make_rmem_tensor(slots, Float32)     # this consumer's factors
    a1 = cute.make_rmem_tensor(slots, Float32)     # the other's
    for s in cutlass.range_constexpr(slots):
        m1 = merge_ml[ctid, s]
        mm = cute.arch.fmax(col_m[s], m1)
        if const_expr(not own_first):
            mm = cute.arch.fmax(m1, col_m[s])
        m_safe = mm
        if mm == -Float32.inf:
            m_safe = 0.0
        a0[s] = cute.arch.exp2(col_m[s] - m_safe)
        a1[s] = cute.arch.exp2(m1 - m_safe)
        if const_expr(own_first):
            col_l[s] = col_l[s] * a0[s] + merge_ml[ctid, slots + s] * a1[s]
        else:
            col_l[s] = cute.math.fma(merge_ml[ctid, slots + s], a1[s], col_l[s] * a0[s])
        col_m[s] = mm
    for j in cutlass.range_constexpr(len(chosen)):
        m = chosen[j]
        for i in cutlass.range_constexpr(vals):
            other = merge[j // per][ctid, (j % per) * vals + i]
            if const_expr(own_first):
                acc_o[m][i] = acc_o[m][i] * a0[col_slot(i, n)] + other * a1[col_slot(i, n)]
            else:
                acc_o[m][i] = cute.math.fma(other, a1[col_slot(i, n)], acc_o[m][i] * a0[col_slot(i, n)])


@cute.jit
def one_consumer_end(c: Int32, acc_o: list, col_m: cute.Tensor, col_l: cute.Tensor, ctid: Int32, merge: list,
                     merge_ml: cute.Tensor, n_tiles: Int32, cols: list, lane: Int32, warp: Int32, red: cute.Tensor,
                     n: cutlass.Constexpr[int], store):
    """The two consumers' end where consumer 0 finishes all of O^T: consumer 1 leaves its O^T, maxima and sums in
    the stash (stash_tensors' `merge`, `merge_ml`) and is done; consumer 0 folds them in, takes the whole columns'
    sums on the parity its last page left free (finish_columns through `red`) and calls store(inv_l, lse), which
    may only call cute.jit functions (it runs outside the DSL's rewriting of control flow)."""
    if c == 1:
        stash_consumer(acc_o, col_m, col_l, ctid, merge, merge_ml)
        cute.arch.barrier_arrive(barrier_id=BAR_MERGE, number_of_threads=THREADS)
    else:
        cute.arch.barrier(barrier_id=BAR_MERGE, number_of_threads=THREADS)
        merge_stash(acc_o, col_m, col_l, ctid, merge, merge_ml, n)
        par = (n_tiles + 1) // 2 % 2
        inv_l, lse = finish_columns(col_m, col_l, cols, lane, warp, red, (par, 0), BAR_RED, CONSUMER_THREADS)
        store(inv_l, lse)


@cute.jit
def store_rows(acc_o: list, inv_l: cute.Tensor, lse: cute.Tensor, tOcO: cute.Tensor, cols: list, lane: Int32,
               warp: Int32, rows: Int32, batch: Int32, split: Int32, mOut: cute.Tensor,
               mLse: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, n: cutlass.Constexpr[int],
               is_split: cutlass.Constexpr[bool], tiles: cutlass.Constexpr = None,
               lse_too: cutlass.Constexpr[bool] = True):
    """O^T normalized into the request's rows (bf16 out, or the split's fp32 partials), and each column's lse.
    Values i, i + 2 are dims d, d + 1 of one row (M rows m, m + 8; v_dim): one 4-byte (bf16) or 8-byte (fp32
    partials) store a pair. `tiles`: only those of O^T's 64-dim tiles (all when None); `lse_too`: the lse too."""
    out_base = mPO.iterator.toint() if const_expr(is_split) else mOut.iterator.toint()
    row0 = batch * rows
    if const_expr(is_split):
        row0 = (batch * mPO.shape[1] + split) * rows
    chosen = list(range(M_TILES)) if const_expr(tiles is None) else tiles
    for j in cutlass.range_constexpr(len(chosen)):
        m = chosen[j]
        for i in cutlass.range_constexpr(cute.size(acc_o[m])):
            if const_expr(i % 4 < 2):
                r = tOcO[i][1]
                d = 64 * m + v_dim(tOcO[i][0])
                if r < rows:
                    f = inv_l[col_slot(i, n)]
                    at = cutlass.Int64((row0 + r) * D_V + d) * (4 if is_split else 2)
                    st_global_pair(out_base + at, acc_o[m][i] * f, acc_o[m][i + 2] * f, bf16=not is_split)
    if const_expr(lse_too):
        store_lse(lse, cols, lane, warp, rows, mLse, mPL, batch, split, is_split)


@cute.jit
def split_consumer_end(cc: cutlass.Constexpr[int], acc_o: list, col_m: cute.Tensor, col_l: cute.Tensor,
                       ctid: Int32, storage, sRed: cute.Tensor, n_tiles: Int32, out_io: tuple,
                       n: cutlass.Constexpr[int], is_split: cutlass.Constexpr[bool]):
    """Consumer cc's end where both consumers finish half of O^T (mla_decode.FP8_SPLIT_EPILOGUE): it leaves the
    other half's O^T tiles, its maxima and its sums in its own stage cc and k_pe stage cc (its pages are all read),
    and after one barrier of both folds the other's stash into its own half, tiles 4 cc .. 4 cc + 3 (dims from
    256 cc), normalizes and stores them; consumer 0 stores the lse. merge_stash writes every product consumer 0's
    value first, so that the result has the same bits as the one-consumer end."""
    half = M_TILES // 2
    vals = cute.size(acc_o[0])
    slots = cute.size(col_m)
    mine = [half * cc + j for j in range(half)]
    own, own_ml = stash_tensors(
        [cute.recast_ptr(storage.sK.data_ptr() + cc * KV_BYTES, dtype=Float32)],
        cute.recast_ptr(storage.sPE.data_ptr() + cc * (TILE_N * D_PE), dtype=Float32), vals, slots,
        CONSUMER_THREADS, tiles=half)
    other, other_ml = stash_tensors(
        [cute.recast_ptr(storage.sK.data_ptr() + (1 - cc) * KV_BYTES, dtype=Float32)],
        cute.recast_ptr(storage.sPE.data_ptr() + (1 - cc) * (TILE_N * D_PE), dtype=Float32), vals, slots,
        CONSUMER_THREADS, tiles=half)
    stash_consumer(acc_o, col_m, col_l, ctid, own, own_ml, tiles=[half * (1 - cc) + j for j in range(half)])
    cute.arch.barrier(barrier_id=BAR_MERGE, number_of_threads=THREADS)
    merge_stash(acc_o, col_m, col_l, ctid, other, other_ml, n, tiles=mine, own_first=cc == 0)
    tOcO, cols, lane, warp, rows, batch, split, mOut, mLse, mPO, mPL = out_io
    # the sums' exchange on the parity this consumer's last page did not use
    par = (n_tiles + 1) // 2 % 2
    if const_expr(cc == 1):
        par = n_tiles // 2 % 2
    inv_l, lse = finish_columns(col_m, col_l, cols, lane, warp, sRed, (par, cc), BAR_RED + 2 * cc, CONSUMER_THREADS)
    store_rows(acc_o, inv_l, lse, tOcO, cols, lane, warp, rows, batch, split, mOut, mLse, mPO, mPL, n, is_split,
               tiles=mine, lse_too=cc == 0)


@dsl_user_op
def st_global_pair(addr: cutlass.Int64, a: Float32, b: Float32, bf16: bool, *, loc=None, ip=None) -> None:
    """(a, b) at `addr`, a first: rounded to a bf16 pair (one 4-byte store) or as two fp32 (one 8-byte store)."""
    store = ("{\n.reg .b32 t;\ncvt.rn.bf16x2.f32 t, $2, $1;\nst.global.b32 [$0], t;\n}\n" if bf16
             else "st.global.v2.f32 [$0], {$1, $2};")
    llvm.inline_asm(None, [cutlass.Int64(addr).ir_value(loc=loc, ip=ip), Float32(a).ir_value(loc=loc, ip=ip),
                           Float32(b).ir_value(loc=loc, ip=ip)], store, "l,f,f",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
