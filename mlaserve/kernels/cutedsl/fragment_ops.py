"""Register-level operations of the keys-on-M FP8 decode kernels (mla_decode_fp8_mma_kernel.py,
mla_decode_fp8_f16_kernel.py), as inline PTX: ldmatrix and the e4m3 V^T fragment it gives, vector loads and stores,
bf16 / f16 pair conversions, and Q's power-of-two row scale. Everything here is inlined into the calling kernel."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from mlaserve.kernels.cutedsl.fp8_pages import TILE_N

Q_RANGE_EXP = 7       # q * 2^a has its largest |value| in [2^7, 2^8)


@dsl_user_op
def ldsm_x4(addr: Int32, trans: bool = False, *, loc=None, ip=None) -> list:
    """ldmatrix .x4 (b16; .trans where `trans`) from this lane's row address: lane l gets, of matrix i (rows from
    lanes 8 i .. 8 i + 7), word i: not transposed, row l // 4's 4 bytes 4 (l % 4) .. + 3."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([Int32.mlir_type] * 4), [Int32(addr).ir_value(loc=loc, ip=ip)],
        f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 {{$0, $1, $2, $3}}, [$4];",
        "=r,=r,=r,=r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Int32(llvm.extractvalue(Int32.mlir_type, res, [i], loc=loc, ip=ip)) for i in range(4)]


@cute.jit
def v_fragment(frag: cute.Tensor, stage_base: Int32, warp: Int32, lane: Int32, m_tile: cutlass.Constexpr[int]):
    """V^T's M tile m_tile (dims 64 m_tile .. + 63, this warp's 16 in v_dim order) over the page's 64 keys as the
    FP8 register A fragment of m64nNk32 (2 k-steps, 4 words each) into `frag` (Int32 view). Per k-step one
    ldmatrix .x4 .trans of the group box (matrix i: keys 8 i .. 8 i + 7 of the step's 32; lane l's row = key
    32 k + l, its 16-byte chunk XORed with key % 8 as the 128-byte swizzle puts it) and one prmt a register:
    bytes 0, 2 (1, 3) of the words of keys 0..7 and 8..15, interleaved, make row r (r + 8) over K columns
    4c .. 4c + 3 (keys 2c, 2c + 8, 2c + 1, 2c + 9)."""
    g = m_tile // 2
    chunk = 4 * (m_tile % 2) + warp
    for k in cutlass.range_constexpr(TILE_N // 32):
        key = 32 * k + lane
        w = ldsm_x4(stage_base + g * (TILE_N * 128) + key * 128 + ((chunk ^ (key % 8)) * 16), trans=True)
        frag[4 * k + 0] = prmt(w[0], w[1], 0x6240)
        frag[4 * k + 1] = prmt(w[0], w[1], 0x7351)
        frag[4 * k + 2] = prmt(w[2], w[3], 0x6240)
        frag[4 * k + 3] = prmt(w[2], w[3], 0x7351)


@dsl_user_op
def prmt(a: Int32, b: Int32, sel: int, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
        f"prmt.b32 $0, $1, $2, {sel:#x};", "=r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def ld_global_v4_b32(addr: cutlass.Int64, streamed: bool = False, *, loc=None, ip=None) -> list:
    """The 16 bytes at global address `addr` (16-byte aligned) as 4 words, through the read-only path. `streamed`:
    not kept in L1, and left by LLVM where the caller issues it (fp8_register_loader's loads run ahead of their use)."""
    quad = llvm.inline_asm(
        llvm.StructType.get_literal([Int32.mlir_type] * 4), [cutlass.Int64(addr).ir_value(loc=loc, ip=ip)],
        f"ld.global.nc{'.L1::no_allocate' if streamed else ''}.v4.b32 {{$0, $1, $2, $3}}, [$4];", "=r,=r,=r,=r,l",
        has_side_effects=streamed, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Int32(llvm.extractvalue(Int32.mlir_type, quad, [e], loc=loc, ip=ip)) for e in range(4)]


@dsl_user_op
def ld_global_nc_b32(addr: cutlass.Int64, *, loc=None, ip=None) -> Int32:
    """The word at global address `addr`, as ld_global_v4_b32(streamed=True) reads."""
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [cutlass.Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.nc.L1::no_allocate.b32 $0, [$1];",
        "=r,l",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def ld_shared_v4(addr: Int32, *, loc=None, ip=None) -> list:
    """The 16 bytes at shared address `addr` as 4 words."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([Int32.mlir_type] * 4), [Int32(addr).ir_value(loc=loc, ip=ip)],
        "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Int32(llvm.extractvalue(Int32.mlir_type, res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def st_shared_words(addr: Int32, words: list, *, loc=None, ip=None) -> None:
    """1, 2 or 4 words as one 4-, 8- or 16-byte shared-memory store at `addr`."""
    n = len(words)
    regs = ", ".join(f"${i + 1}" for i in range(n))
    op = "st.shared.b32 [$0], $1;" if n == 1 else f"st.shared.v{n}.b32 [$0], {{{regs}}};"
    llvm.inline_asm(None, [Int32(addr).ir_value(loc=loc, ip=ip), *(Int32(w).ir_value(loc=loc, ip=ip) for w in words)],
                    op, ",".join("r" * (n + 1)),
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def bf16x2_to_f32(w: Int32, *, loc=None, ip=None) -> tuple:
    """A word's two bf16 (bits 0..15, 16..31) as fp32."""
    return _asm_pair(
        Float32, [Int32(w)],
        "{\n.reg .b32 t;\nshl.b32 t, $2, 16;\nmov.b32 $0, t;\nand.b32 t, $2, 0xFFFF0000;\nmov.b32 $1, t;\n}\n",
        "=f,=f,r", loc, ip)


@dsl_user_op
def cvt_pair(lo: Float32, hi: Float32, kind: str = "f16", *, loc=None, ip=None) -> Int32:
    """(lo, hi) rounded to an f16 (kind "f16") or bf16 ("bf16") pair, lo in bits 0..15."""
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{kind}x2.f32 $0, $2, $1;", "=r,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def e4m3x4_to_f16(w: Int32, s_lo: Int32, s_hi: Int32, *, loc=None, ip=None) -> tuple:
    """A word's 4 e4m3 bytes -> (f16x2 of bytes 0, 1 times s_lo, f16x2 of bytes 2, 3 times s_hi): cvt is exact,
    the multiply rounds once."""
    return _asm_pair(
        Int32, [Int32(w), Int32(s_lo), Int32(s_hi)],
        "{\n.reg .b16 a, b;\n.reg .b32 x, y;\nmov.b32 {a, b}, $2;\ncvt.rn.f16x2.e4m3x2 x, a;\n"
        "cvt.rn.f16x2.e4m3x2 y, b;\nmul.rn.f16x2 $0, x, $3;\nmul.rn.f16x2 $1, y, $4;\n}\n",
        "=r,=r,r,r,r", loc, ip)


@dsl_user_op
def e4m3x4_to_f16_exact(w: Int32, *, loc=None, ip=None) -> tuple:
    """A word's 4 e4m3 bytes -> (f16x2 of bytes 0, 1, f16x2 of bytes 2, 3), exact (no scale)."""
    return _asm_pair(
        Int32, [Int32(w)],
        "{\n.reg .b16 a, b;\nmov.b32 {a, b}, $2;\ncvt.rn.f16x2.e4m3x2 $0, a;\ncvt.rn.f16x2.e4m3x2 $1, b;\n}\n",
        "=r,=r,r", loc, ip)


def _asm_pair(ty, args: list, asm: str, constraints: str, loc, ip) -> tuple:
    """Pure inline asm of two `ty` results ($0, $1) over `args` (DSL values, $2 ..) -> the two results."""
    pair = llvm.inline_asm(
        llvm.StructType.get_literal([ty.mlir_type] * 2), [a.ir_value(loc=loc, ip=ip) for a in args], asm,
        constraints, has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return (ty(llvm.extractvalue(ty.mlir_type, pair, [0], loc=loc, ip=ip)),
            ty(llvm.extractvalue(ty.mlir_type, pair, [1], loc=loc, ip=ip)))


@dsl_user_op
def pow2_scale(amax: Float32, *, loc=None, ip=None) -> Float32:
    """2^a with amax * 2^a in [2^7, 2^8) (exponent arithmetic on the bits), 1.0 for amax 0 (or subnormal)."""
    return Float32(llvm.inline_asm(
        Float32.mlir_type, [Float32(amax).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 b, e;\n.reg .pred z;\nmov.b32 b, $1;\nshr.u32 e, b, 23;\nand.b32 e, e, 255;\n"
        "setp.eq.u32 z, e, 0;\n"
        f"sub.s32 e, {127 + Q_RANGE_EXP + 127}, e;\n"   # biased exponent of 2^(7 - (e - 127))
        "min.s32 e, e, 254;\nmax.s32 e, e, 1;\nshl.b32 e, e, 23;\nselp.b32 e, 0x3F800000, e, z;\n"
        "mov.b32 $0, e;\n}\n", "=f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))
