"""Pieces the Triton kernels share."""

import triton
import triton.language as tl


@triton.jit
def fp8_kv_values(x, COMPUTE: tl.constexpr):
    """FP8 KV entries (e4m3 * scale, float32) -> the format's bf16 values, in COMPUTE dtype.

    The FP8 format's value of an entry is the bf16 nearest e4m3 * scale (kernels/fp8_format.py).
    On the GPU a bf16 conversion rounds to nearest even; Triton's CPU interpreter truncates
    instead, so for other compute dtypes (the interpreter's tests) the rounding is done on the
    float32 bits, which gives the same values everywhere.
    """
    if COMPUTE == tl.bfloat16:
        return x.to(tl.bfloat16)
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(COMPUTE)
