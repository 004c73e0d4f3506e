"""Dequantizing the FP8 656-byte KV format into a bf16 wgmma tile in shared memory, for the CuTe DSL FP8
kernels (mla_decode_fp8_narrow_kernel.py, sparse_mla_fp8_kernel.py).

A row's first 528 bytes in the kernels' raw smem stage: 512 e4m3 c_kv bytes, then 4 fp32 scales (one per
128 columns). An e4m3 byte x read as the bf16 with bits ((x & 0x7F) << 4) | ((x & 0x80) << 8) is exactly
x * 2^-120 (subnormals too), so one fma.rn.bf16x2 by (scale * 2^120) -- exact in bf16 when the scale is a
bf16 value <= 2^7, which the quantizer guarantees -- gives the bf16 nearest e4m3 * scale, the format's
value, with no conversion instruction. The bit trick never makes NaN/inf from any byte, even 0xFF poison.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

TILE_N = 64           # rows of the tile
D_V = 512             # its bf16 columns
RAW_WORDS = 132       # a row of the raw stage in 32-bit words (528 B)
SCALE_WORD = 128      # the scales start at byte 512
EXP_120 = 120 << 23   # adds 120 to an fp32 exponent: scale * 2^120
KV_BLOCKS = D_V // 64  # the bf16 tile's 64-column blocks (one swizzle atom wide; 4 QK k-steps each)
HALF_BLOCKS = KV_BLOCKS // 2  # a column half's blocks (store_half)


@cute.jit
def dequant_tile(tidx: Int32, stage_base: Int32, kv_base: Int32, kv_full: cute.Pointer, valid: Int32,
                 release_every: cutlass.Constexpr[int] = 1):
    """The loader warpgroup's conversion of one tile: raw stage (shared address `stage_base`, rows of 528 B:
    e4m3 bytes then 4 fp32 scales) -> the bf16 c_kv tile (shared address `kv_base`, [64, 512] in 64-column
    blocks of 8 KB, 128-byte swizzle), one column block at a time, arriving on kv_full[block // release_every]
    after every `release_every` blocks, so that the consumers' QK starts on the first blocks while the later
    ones are converted. Each release costs a proxy fence, which waits for the warp's shared stores to land.

    Thread p converts the 8 columns p % 8 of each block in rows r + 16 i (i < 4), r = 4 ((p // 8) % 4) + p // 32:
    one 8-byte load and one 16-byte store each; rows >= `valid` become zeros (multiplier 0). A warp's rows are
    r, r + 4, r + 8, r + 12: raw rows are 528 B apart (16 B more than a multiple of 128), so those rows' 64 bytes
    of a block sit at bank offsets 64 apart and the warp's 8-byte loads take the 2 wavefronts that 256 bytes need
    (four consecutive rows overlap on 16-byte steps: 4 wavefronts); its 16-byte stores take the minimum 4 either
    way. The loader has one warp per SM sub-partition, so nothing else hides its shared-memory latency: the loads
    of block b + 1 are issued before block b is converted and stored (the asm blocks keep their source order).
    """
    prow, pc = _thread_rows(tidx)
    keep = _keep(prow, valid)
    row_base = _row_bases(stage_base, prow)
    raw = _load_block(row_base, pc, 0)
    scale = _load_scales(row_base, 0)
    for cb in cutlass.range_constexpr(KV_BLOCKS):
        nxt_raw = raw
        nxt_scale = scale
        if const_expr(cb + 1 < KV_BLOCKS):
            nxt_raw = _load_block(row_base, pc, cb + 1)
            if const_expr((cb + 1) % 2 == 0):
                nxt_scale = _load_scales(row_base, (cb + 1) // 2)
        _store_block(raw, scale, prow, pc, keep, kv_base, kv_full, cb, release_every)
        raw = nxt_raw
        scale = nxt_scale


def load_raw_page(tidx: Int32, stage_base: Int32):
    """All the raw stage's bytes that thread `tidx` converts in dequant_tile (8 of each of the 8 column blocks and
    the 4 scales, in its 4 rows), in registers (80 of them), for store_tile: once this returns, the stage may be
    freed for the next TMA, before the loader waits for a bf16 tile.

    The proxy fence at the end orders these generic-proxy loads before that TMA's async-proxy writes. Without it
    the H200 showed reads of bytes the TMA had already overwritten (N 32 off by up to 0.38 at b128; one of 17
    quick-check shapes at N 16 with one raw stage: bench/NOTES.md 65). dequant_tile needs none of its own: its
    last hand-over fence comes after all its loads."""
    prow, pc = _thread_rows(tidx)
    row_base = _row_bases(stage_base, prow)
    page = ([_load_block(row_base, pc, cb) for cb in range(KV_BLOCKS)],
            [_load_scales(row_base, g) for g in range(KV_BLOCKS // 2)])
    cute.arch.fence_proxy("async.shared", space="cta")
    return page


def store_tile(tidx: Int32, page, kv_base: Int32, kv_full: cute.Pointer, valid: Int32, release_every: int):
    """dequant_tile's conversion and hand-overs, from load_raw_page's registers (`page`)."""
    prow, pc = _thread_rows(tidx)
    keep = _keep(prow, valid)
    raw, scale = page
    for cb in range(KV_BLOCKS):
        _store_block(raw[cb], scale[cb // 2], prow, pc, keep, kv_base, kv_full, cb, release_every)


def store_half(tidx: Int32, page, half: int, slot_base: Int32, full: cute.Pointer, valid: Int32):
    """Column half `half` (blocks 4 half .. 4 half + 3) of load_raw_page's registers (`page`) into a half-tile
    slot [64, 256] (4 blocks of 8 KB from shared address `slot_base`, the tile's block layout), then the proxy
    fence and the hand-over on `full` (the FP8 kernels' half ring: fp8_pages.store_halves)."""
    prow, pc = _thread_rows(tidx)
    keep = _keep(prow, valid)
    raw, scale = page
    for j in range(HALF_BLOCKS):
        cb = HALF_BLOCKS * half + j
        _store_block(raw[cb], scale[cb // 2], prow, pc, keep, slot_base, full, j, HALF_BLOCKS)


def _thread_rows(tidx: Int32):
    """(r, c): thread tidx's first row (dequant_tile's docstring says why this order) and its 8-byte column."""
    return 4 * ((tidx // 8) % 4) + tidx // 32, tidx % 8


def _keep(prow: Int32, valid: Int32) -> list:
    """Per row of the thread: all ones where the row is inside the request (its values kept), else 0."""
    return [_all_ones_if_lt(prow + 16 * i, valid) for i in range(TILE_N // 16)]


def _row_bases(stage_base: Int32, prow: Int32) -> list:
    return [stage_base + (prow + 16 * i) * (RAW_WORDS * 4) for i in range(TILE_N // 16)]


def _load_block(row_base: list, pc: Int32, cb: int) -> list:
    """The thread's 8 e4m3 bytes of column block cb in each of its rows."""
    return [_ld_shared_b64(b + cb * 64 + pc * 8) for b in row_base]


def _load_scales(row_base: list, g: int) -> list:
    """Scale g (columns 128 g .. 128 g + 127: blocks 2 g and 2 g + 1) of each of the thread's rows."""
    return [_ld_shared_b32(b + (SCALE_WORD + g) * 4) for b in row_base]


def _store_block(raw: list, scale: list, prow: Int32, pc: Int32, keep: list, kv_base: Int32,
                 kv_full: cute.Pointer, cb: int, release_every: int):
    """Column block cb of the thread's rows into the bf16 tile, then (every `release_every` blocks) the proxy
    fence that makes the generic-proxy stores visible to the consumers' wgmma and the hand-over."""
    swz = (pc ^ (prow % 8)) * 16          # rows prow + 16 i share row % 8
    for i in range(TILE_N // 16):
        mult = _bf16x2_hi(scale[i] + EXP_120) & keep[i]
        _convert8_store(raw[i], kv_base + cb * (TILE_N * 128) + (prow + 16 * i) * 128 + swz, mult)
    if (cb + 1) % release_every == 0:
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_arrive(kv_full + cb // release_every)


@dsl_user_op
def _ld_shared_b32(addr: Int32, *, loc=None, ip=None) -> Int32:
    """The 32-bit word at shared address `addr`."""
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Int32(addr).ir_value(loc=loc, ip=ip)], "ld.shared.b32 $0, [$1];", "=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _bf16x2_hi(bits: Int32, *, loc=None, ip=None) -> Int32:
    """Both halves = the upper 16 bits of `bits` (an fp32 whose value is a bf16 value: that bf16, twice)."""
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Int32(bits).ir_value(loc=loc, ip=ip)], "prmt.b32 $0, $1, 0, 0x3232;", "=r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _ld_shared_b64(addr: Int32, *, loc=None, ip=None) -> Int64:
    """The 8 bytes at shared address `addr` (8-byte aligned)."""
    return Int64(llvm.inline_asm(
        Int64.mlir_type, [Int32(addr).ir_value(loc=loc, ip=ip)], "ld.shared.b64 $0, [$1];", "=l,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _all_ones_if_lt(a: Int32, b: Int32, *, loc=None, ip=None) -> Int32:
    """0xFFFFFFFF where a < b, else 0."""
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred p;\nsetp.lt.s32 p, $1, $2;\nselp.b32 $0, -1, 0, p;\n}\n", "=r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _convert8_store(raw: Int64, dst: Int32, mult: Int32, *, loc=None, ip=None) -> None:
    """8 e4m3 bytes (`raw`) -> 8 bf16 (e4m3 * scale, RNE) as one 16-byte store at shared `dst`.

    prmt with selector 0x9180 (0xB3A2) puts bytes 0, 1 (2, 3) into the two 16-bit halves sign-extended;
    << 4 and the mask 0x87F0 per half leave the sign at bit 15 and exponent + mantissa at bits 4..10: the
    bf16 of x * 2^-120. `mult` is bf16x2 (scale * 2^120, twice); the fma adds -0.0, which changes nothing.
    """
    llvm.inline_asm(
        None,
        [Int64(raw).ir_value(loc=loc, ip=ip), Int32(dst).ir_value(loc=loc, ip=ip),
         Int32(mult).ir_value(loc=loc, ip=ip)],
        "{\n"
        ".reg .b32 w0, w1, y0, y1, y2, y3, nz;\n"
        "mov.b64 {w0, w1}, $0;\n"
        "mov.b32 nz, 0x80008000;\n"
        "prmt.b32 y0, w0, 0, 0x9180;\n"
        "prmt.b32 y1, w0, 0, 0xB3A2;\n"
        "prmt.b32 y2, w1, 0, 0x9180;\n"
        "prmt.b32 y3, w1, 0, 0xB3A2;\n"
        "shl.b32 y0, y0, 4;\n"
        "shl.b32 y1, y1, 4;\n"
        "shl.b32 y2, y2, 4;\n"
        "shl.b32 y3, y3, 4;\n"
        "and.b32 y0, y0, 0x87F087F0;\n"
        "and.b32 y1, y1, 0x87F087F0;\n"
        "and.b32 y2, y2, 0x87F087F0;\n"
        "and.b32 y3, y3, 0x87F087F0;\n"
        "fma.rn.bf16x2 y0, y0, $2, nz;\n"
        "fma.rn.bf16x2 y1, y1, $2, nz;\n"
        "fma.rn.bf16x2 y2, y2, $2, nz;\n"
        "fma.rn.bf16x2 y3, y3, $2, nz;\n"
        "st.shared.v4.b32 [$1], {y0, y1, y2, y3};\n"
        "}\n",
        "l,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
