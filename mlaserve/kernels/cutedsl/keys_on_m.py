"""The column softmax of the keys-on-M FP8 decode kernels (mla_decode_fp8_narrow_kernel.py,
mla_decode_fp8_mma_kernel.py): S^T [64 keys, n] in a wgmma m64nN accumulator, a query row per column.

A thread (lane = 4 q + c of warp w) holds keys k0 = 16 w + q and k0 + 8 of a page, and n / 4 columns: slot s
is column 8 (s // 2) + 2 c + s % 2 (value i of the accumulator is column col_slot(i, n), row half (i // 2) % 2).
Warps reduce over their 16 keys by shuffles and the 4 warps meet in shared memory: red[(column, warp) + at] are
this page's fp32 slots (`at`: the kernel's further indices, the page's parity, its consumer). Everything here is
inlined into the calling kernel at trace time.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from mlaserve.kernels.cutedsl.split_consumers import move_row_max

WARPS = 4


def col_slot(i: int, n: int) -> int:
    """Which of a thread's n / 4 accumulator columns value i of an m64nN fragment (repeated along M) holds:
    value i = e + 2 r + 4 j (+ n / 2 per 64-row block) sits in column 8 j + 2 (lane % 4) + e, row half r."""
    v = i % (n // 2)
    return (v % 2) + 2 * (v // 4)


def columns(lane: Int32, n: int) -> list:
    """The thread's columns, by slot."""
    return [8 * (s // 2) + 2 * (lane % 4) + s % 2 for s in range(n // 4)]


@cute.jit
def mask_keys(acc_s: cute.Tensor, tok0: Int32, k0: Int32, vis: cute.Tensor, min_vis: Int32,
              n: cutlass.Constexpr[int]):
    """S to -inf where a key (token tok0 + k0 (+ 8)) is past what its column sees (vis[slot]); pages that end
    before min_vis, the fewest keys any column sees, need no test."""
    if tok0 + 64 > min_vis:
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            if tok0 + k0 + 8 * ((i // 2) % 2) >= vis[col_slot(i, n)]:
                acc_s[i] = -Float32.inf


@cute.jit
def publish_column_max(acc_s: cute.Tensor, cols: list, lane: Int32, warp: Int32, red: cute.Tensor, at: tuple):
    """Each column's maximum over the warp's 16 keys into red[(column, warp) + at] (lanes 0-3 write)."""
    slots = len(cols)
    mx = cute.make_rmem_tensor(slots, Float32)
    for s in cutlass.range_constexpr(slots):
        i0 = 4 * (s // 2) + s % 2
        mx[s] = cute.arch.fmax(acc_s[i0], acc_s[i0 + 2])
        for off in (4, 8, 16):
            mx[s] = cute.arch.fmax(mx[s], cute.arch.shuffle_sync_bfly(mx[s], offset=off))
        if lane < 4:
            red[(cols[s], warp) + at] = mx[s]


@cute.jit
def take_column_max(col_m: cute.Tensor, col_l: cute.Tensor, alpha: cute.Tensor, m_base: cute.Tensor, cols: list,
                    red: cute.Tensor, at: tuple):
    """After the warps' barrier: each column's running max moved to the 4 warps' maxima (move_row_max)."""
    for s in cutlass.range_constexpr(len(cols)):
        m_new = col_m[s]
        for w in cutlass.range_constexpr(WARPS):
            m_new = cute.arch.fmax(m_new, red[(cols[s], w) + at])
        move_row_max(col_m, col_l, alpha, m_base, s, m_new)


@cute.jit
def rescale_moved(acc_o: list, col_m: cute.Tensor, m_prev: cute.Tensor, alpha: cute.Tensor,
                  n: cutlass.Constexpr[int]):
    """O^T's tiles times alpha by column where any of the thread's columns' maxima moved this page (col_m against
    m_prev); a warp vote, so that a warp rescales all or nothing: alpha is 1 where a max did not move, and every
    warp sees the same maxima."""
    moved = col_m[0] != m_prev[0]
    for s in cutlass.range_constexpr(1, cute.size(col_m)):
        moved = moved | (col_m[s] != m_prev[s])
    if cute.arch.vote_any_sync(moved):
        for m in cutlass.range_constexpr(len(acc_o)):
            for i in cutlass.range_constexpr(cute.size(acc_o[m])):
                acc_o[m][i] = acc_o[m][i] * alpha[col_slot(i, n)]


@cute.jit
def exp_columns(acc_s: cute.Tensor, m_base: cute.Tensor, col_l: cute.Tensor, n: cutlass.Constexpr[int]):
    """P = exp2(S - m_base) in place, each column's part of the sum added into col_l."""
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        p = cute.arch.exp2(acc_s[i] - m_base[col_slot(i, n)])
        acc_s[i] = p
        col_l[col_slot(i, n)] = col_l[col_slot(i, n)] + p


@cute.jit
def finish_columns(col_m: cute.Tensor, col_l: cute.Tensor, cols: list, lane: Int32, warp: Int32, red: cute.Tensor,
                   at: tuple, barrier_id: int, threads: int):
    """The whole columns' sums (shuffles, then the 4 warps through red and a named barrier) -> (1 / sum, lse in
    natural log) by slot: 0 and -inf for a column that saw no key."""
    slots = len(cols)
    inv_l = cute.make_rmem_tensor(slots, Float32)
    lse = cute.make_rmem_tensor(slots, Float32)
    for s in cutlass.range_constexpr(slots):
        for off in (4, 8, 16):
            col_l[s] = col_l[s] + cute.arch.shuffle_sync_bfly(col_l[s], offset=off)
        if lane < 4:
            red[(cols[s], warp) + at] = col_l[s]
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
    for s in cutlass.range_constexpr(slots):
        total = red[(cols[s], 0) + at] + red[(cols[s], 1) + at] + red[(cols[s], 2) + at] + red[(cols[s], 3) + at]
        inv_l[s] = 0.0
        lse[s] = -Float32.inf
        if total > 0.0:
            inv_l[s] = 1.0 / total
            lse[s] = (col_m[s] + cute.math.log2(total, fastmath=False)) * math.log(2.0)
    return inv_l, lse


@cute.jit
def store_lse(lse: cute.Tensor, cols: list, lane: Int32, warp: Int32, rows: Int32, mLse: cute.Tensor,
              mPL: cute.Tensor, batch: Int32, split: Int32, is_split: cutlass.Constexpr[bool]):
    """Warp 0's lanes 0-3 store each real column's lse (the split partials' where `is_split`)."""
    if warp == 0 and lane < 4:
        for s in cutlass.range_constexpr(len(cols)):
            if cols[s] < rows:
                if const_expr(is_split):
                    mPL[batch, split, cols[s]] = lse[s]
                else:
                    mLse[batch, cols[s]] = lse[s]
