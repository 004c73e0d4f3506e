"""The f16-register FP8 decode's Q (mla_decode_fp8_f16_kernel.py): each query row read from global memory, scaled by
a power of two 2^a that puts its largest |q_nope| in [2^7, 2^8) (so that f16 keeps bf16 q exactly down to 2^-22 of
it), and stored in shared memory as the B operand of S^T = K Q^T: Q * 2^a in f16, each 16-column group's columns
in the K fragments' order (the kernel's Q_PERM), Q_pe * 2^a in bf16 (exact), and 2^-a a row for the softmax.
Inlined into the kernel at trace time.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from mlaserve.kernels.cutedsl.boxed_pages import THREADS
from mlaserve.kernels.cutedsl.fp8_pages import D_PE, D_QK, D_V
from mlaserve.kernels.cutedsl.fragment_ops import (
    bf16x2_to_f32, cvt_pair, ld_global_v4_b32, pow2_scale, st_shared_words)


@cute.jit
def load_q(q_base: cutlass.Int64, batch: Int32, rows: Int32, tidx: Int32, n: cutlass.Constexpr[int]):
    """This thread's part of its query row (store_q_f16 says which), read from global memory -> (words of its
    16-column groups [8 * groups], rope words [4]: zeros for parts >= 8); rows past `rows` read row 0 (nothing
    here waits for the reads: store_q_f16 zeroes those rows)."""
    per_row = THREADS // n
    groups = (D_V // 16) // per_row
    r = tidx // per_row
    part = tidx % per_row
    rr = r
    if r >= rows:
        rr = 0
    row_addr = q_base + cutlass.Int64(batch * rows + rr) * (D_QK * 2)
    words = cute.make_rmem_tensor(8 * groups, Int32)
    for j in cutlass.range_constexpr(groups):
        col = 16 * (part + per_row * j)
        for e in cutlass.range_constexpr(2):
            w = ld_global_v4_b32(row_addr + (col + 8 * e) * 2)
            for x in cutlass.range_constexpr(4):
                words[8 * j + 4 * e + x] = w[x]
    pe = cute.make_rmem_tensor(4, Int32)
    pe.fill(0)
    if part < D_PE // 8:
        w = ld_global_v4_b32(row_addr + (D_V + 8 * part) * 2)
        for x in cutlass.range_constexpr(4):
            pe[x] = w[x]
    return words, pe


@cute.jit
def store_q_f16(words: cute.Tensor, pe: cute.Tensor, rows: Int32, tidx: Int32, n: cutlass.Constexpr[int],
                 q_base_s: Int32, qpe_base: Int32, sInv: cute.Tensor):
    """Q * 2^a into sQ [n, 512] f16 (128-byte swizzle: 64-column boxes of n rows, n * 128 bytes apart; 16-byte
    chunk j of a row at j ^ (row % 8)), each 16-column group's columns in Q_PERM's order; Q_pe * 2^a into sQpe
    [n, 64] bf16 likewise; 2^-a into sInv; from load_q's words. a per query row r: its largest |q_nope| in
    [2^7, 2^8) (pow2_scale). 256 / n threads a row; thread `part` takes the row's 16-column groups
    part + (256 / n) j, and parts < 8 the rope chunk part. Rows past `rows` are zeros."""
    per_row = THREADS // n
    groups = (D_V // 16) // per_row
    r = tidx // per_row
    part = tidx % per_row
    if r >= rows:
        words.fill(0)
        pe.fill(0)
    amax = Float32(0.0)
    for e in cutlass.range_constexpr(8 * groups):
        lo, hi = bf16x2_to_f32(words[e])
        amax = cute.arch.fmax(amax, cute.arch.fmax(cute.arch.fmax(lo, -lo), cute.arch.fmax(hi, -hi)))
    for off in (1, 2, 4, 8, 16):
        if const_expr(off < per_row):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off))
    scale = pow2_scale(amax)             # 2^a as fp32 (1 for a zero row)
    for j in cutlass.range_constexpr(groups):
        g16 = part + per_row * j
        # the group's 8 words (column pairs 0..7) scaled into f16x2; logical word L holds pair 2 L (L < 4),
        # else pair 2 (L - 4) + 1 (Q_PERM)
        hw = [scaled_pair(words[8 * j + e], scale, "f16") for e in range(8)]
        box = g16 // 4
        for half in cutlass.range_constexpr(2):
            chunk = 2 * (g16 % 4) + half
            addr = q_base_s + box * (n * 128) + (r // 8) * 1024 + (r % 8) * 128 + ((chunk ^ (r % 8)) * 16)
            st_shared_words(addr, [hw[half], hw[2 + half], hw[4 + half], hw[6 + half]])
    if part == 0:
        sInv[r] = 1.0 / scale
    if part < D_PE // 8:
        pw = [scaled_pair(pe[e], scale, "bf16") for e in range(4)]
        st_shared_words(qpe_base + (r // 8) * 1024 + (r % 8) * 128 + (part ^ (r % 8)) * 16, pw)


def scaled_pair(w: Int32, scale: Float32, kind: str) -> Int32:
    """A word's two bf16 times `scale` (a power of 2), as an f16 or (exactly) a bf16 pair."""
    lo, hi = bf16x2_to_f32(w)
    return cvt_pair(lo * scale, hi * scale, kind)


