"""Pieces the Triton kernels share: attention over the FP8 656-byte KV format (kernels/fp8_format.py).

FP8 KV without dequantizing it. An entry's value is e4m3 * scale, with one fp32 scale per token
and 128-column tile. Instead of forming that product for every element (e4m3 -> f32, x scale,
-> bf16: four conversions and a multiply per element, which bound the kernels), the tiles go to
the tensor cores as fp16, which holds every e4m3 value exactly (one packed cvt per two elements),
and the scales are applied where they are few:
    QK:  s[i, n] = sum_t scale[n, t] * (q_t[i] . e4m3_t[n])             (4 dots of K = 128)
    PV:  out_t[i] = sum_n p[i, n] * scale[n, t] * e4m3_t[n]              (P scaled per tile)
The query's nope part goes to fp16 too, each row first multiplied by a power of two that puts its
largest magnitude in [2^12, 2^13) (exact, and far from fp16's 65504 limit); the power is undone
on the scores. P times the scales is kept <= 1 by dividing by `r`, the largest scale seen so
far, which the accumulators carry as a common factor (rescaled with the softmax's alpha).
Products are exact (fp16 x fp16 -> fp32), so the result is the attention over e4m3 * scale up to
fp32 summation order — the format's values, without the bf16 rounding a dequantized tile has.
"""

import triton
import triton.language as tl

# fp8_format.MIN_SCALE: every real row's scales are at least this (the running max starts here)
FP8_MIN_SCALE = tl.constexpr(1e-10)


@triton.jit
def fp8_tile(kv_ptr, row_off, rows_ok, T: tl.constexpr, DOT: tl.constexpr, MASKED: tl.constexpr):
    """Tile T (columns 128*T .. 128*T + 127) of FP8 cache rows -> (values [BLOCK_N, 128] in DOT, exactly
    the e4m3 numbers; scales fp32 [BLOCK_N]).

    kv_ptr: uint8 pointer to the cache; row_off int64 [BLOCK_N]: each row's byte offset; rows_ok bool
    [BLOCK_N] (used when MASKED): rows that are not ok read 0 and touch no memory.
    """
    offs_c = T * 128 + tl.arange(0, 128)
    ptrs = (kv_ptr + row_off[:, None] + offs_c[None, :]).to(tl.pointer_type(tl.float8e4nv))
    scale_ptr = (kv_ptr + row_off + 512).to(tl.pointer_type(tl.float32)) + T
    if MASKED:
        vals = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        scale = tl.load(scale_ptr, mask=rows_ok, other=0.0)
    else:
        vals = tl.load(ptrs)
        scale = tl.load(scale_ptr)
    return vals.to(DOT), scale


@triton.jit
def fp8_rope(kv_ptr, row_off, rows_ok, COMPUTE: tl.constexpr, MASKED: tl.constexpr):
    """The 64 bf16 rope values of FP8 cache rows -> [BLOCK_N, 64] in COMPUTE."""
    ptrs = (kv_ptr + row_off + 528)[:, None].to(tl.pointer_type(tl.bfloat16)) + tl.arange(0, 64)[None, :]
    if MASKED:
        return tl.load(ptrs, mask=rows_ok[:, None], other=0.0).to(COMPUTE)
    return tl.load(ptrs).to(COMPUTE)


@triton.jit
def fp8_query(q_rows, rows_ok, DOT: tl.constexpr):
    """The nope part (512 values) of BLOCK_H query rows -> (q0, q1, q2, q3 [BLOCK_H, 128] in DOT, each
    row times 2^k; 2^-k fp32 [BLOCK_H], to multiply the row's nope scores by).

    q_rows: pointers [BLOCK_H] to each row's first value; rows that are not ok read 0.
    """
    offs = tl.arange(0, 128)
    m = rows_ok[:, None]
    q0 = tl.load(q_rows[:, None] + offs[None, :], mask=m, other=0.0).to(tl.float32)
    q1 = tl.load(q_rows[:, None] + (128 + offs)[None, :], mask=m, other=0.0).to(tl.float32)
    q2 = tl.load(q_rows[:, None] + (256 + offs)[None, :], mask=m, other=0.0).to(tl.float32)
    q3 = tl.load(q_rows[:, None] + (384 + offs)[None, :], mask=m, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(q0), 1), tl.max(tl.abs(q1), 1)),
                      tl.maximum(tl.max(tl.abs(q2), 1), tl.max(tl.abs(q3), 1)))
    # amax in [2^(e-127), 2^(e-126)) for biased exponent e; 2^k = 2^(139-e) maps it into [2^12, 2^13).
    # e clamped to [13, 254] keeps both powers normal floats (zero rows take the clamp and stay zero).
    e = tl.minimum(tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 13), 254)
    up = ((266 - e) << 23).to(tl.float32, bitcast=True)
    down = ((e - 12) << 23).to(tl.float32, bitcast=True)
    return ((q0 * up[:, None]).to(DOT), (q1 * up[:, None]).to(DOT), (q2 * up[:, None]).to(DOT),
            (q3 * up[:, None]).to(DOT), down)


@triton.jit
def fp8_qk(q0, q1, q2, q3, k0, k1, k2, k3, c0, c1, c2, c3, PREC: tl.constexpr):
    """sum_t scale_t[n] * (q_t . k_t[n]): the nope scores [BLOCK_H, BLOCK_N] (in fp8_query's row units)."""
    s = tl.dot(q0, tl.trans(k0), input_precision=PREC) * c0[None, :]
    s += tl.dot(q1, tl.trans(k1), input_precision=PREC) * c1[None, :]
    s += tl.dot(q2, tl.trans(k2), input_precision=PREC) * c2[None, :]
    s += tl.dot(q3, tl.trans(k3), input_precision=PREC) * c3[None, :]
    return s


@triton.jit
def fp8_softmax_pv(s, m_i, l_i, r_i, acc0, acc1, acc2, acc3, k0, k1, k2, k3, c0, c1, c2, c3,
                   DOT: tl.constexpr, PREC: tl.constexpr, GUARD: tl.constexpr):
    """One online-softmax step over scores s [BLOCK_H, BLOCK_N] (log2 units, -inf where masked).

    acc_t fp32 [BLOCK_H, 128] hold out_t / r_i (r_i: the largest scale seen, a scalar); m_i, l_i fp32
    [BLOCK_H]. GUARD: some row may have seen no key yet (m = -inf); it then stays at 0, never NaN.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if GUARD:
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_base = m_new
    alpha = tl.math.exp2(m_i - m_base)
    p = tl.math.exp2(s - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    r_new = tl.maximum(tl.maximum(tl.maximum(tl.max(c0, 0), tl.max(c1, 0)),
                                  tl.maximum(tl.max(c2, 0), tl.max(c3, 0))), r_i)
    f = alpha * (r_i / r_new)
    inv_r = 1.0 / r_new
    acc0 = tl.dot((p * (c0 * inv_r)[None, :]).to(DOT), k0, acc0 * f[:, None], input_precision=PREC)
    acc1 = tl.dot((p * (c1 * inv_r)[None, :]).to(DOT), k1, acc1 * f[:, None], input_precision=PREC)
    acc2 = tl.dot((p * (c2 * inv_r)[None, :]).to(DOT), k2, acc2 * f[:, None], input_precision=PREC)
    acc3 = tl.dot((p * (c3 * inv_r)[None, :]).to(DOT), k3, acc3 * f[:, None], input_precision=PREC)
    return acc0, acc1, acc2, acc3, m_new, l_i, r_new
