"""The register-path loader of the FP8 seesaw decode (mla_decode_fp8_seesaw_kernel.py): a warpgroup that reads each
page of the FP8 656-byte cache with 16-byte global loads straight into registers and writes the page as the bf16
[64, 576] ring stage the seesaw consumers read (mla_decode_consumer.SeesawConsumer), so that FP8 pages flow through
the bf16 kernel's schedule with no raw smem stage (Q 72 KB + two 72 KB stages + P 8 KB leave no room for one).

A page goes by column groups (128 columns, one scale each), so that its first columns can be handed over while the
rest are converted (`parts`). Warp w converts rows 16 w .. 16 w + 15; a warp-load covers 4 rows of one group, lane
l row 16 w + 4 q + l // 8 and its 16 e4m3 bytes l % 8 of the group (4 x 128 coalesced bytes) plus the row's scale
(a 4-byte load the 8 lanes of a row share). The 16 bytes become two 16-byte bf16 chunks of the 128-byte-swizzled
64-column block (fp8_dequant's bit trick: exact, no conversion instruction); lanes of odd blocks store their second
chunk first, so that each store instruction of the warp covers all 8 bank groups (4 wavefronts, the minimum for 512
bytes). The swap costs nothing: it is in the prmt selectors, which are registers. k_pe travels by TMA into the
stage's rope columns, issued by warp 0 once the stage is free, on the last part's full barrier.

Loads run `ahead` groups (20 words a thread each) ahead of the one converted, across pages (`carry`): the next
page's first groups are issued while this page's last are converted, before the wait for the next stage to be free.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from mlaserve.kernels.cutedsl.fp8_dequant import EXP_120, _all_ones_if_lt, _bf16x2_hi
from mlaserve.kernels.cutedsl.fragment_ops import ld_global_v4_b32

TILE_N = 64
D_QK = 576
ROW_BYTES = 656       # an FP8 row: 512 e4m3 bytes, 4 fp32 scales, 64 bf16 k_pe
SCALE_BYTE = 512
PAGE_BYTES = TILE_N * ROW_BYTES
STAGE_BYTES = TILE_N * D_QK * 2       # a bf16 ring stage [64, 576]
BLOCK_BYTES = TILE_N * 128            # one 64-column block of it (128-byte swizzle)
LOADER_THREADS = 128
GROUPS = 4                            # column groups of 128 (one scale each) a page
LOADS = 4                             # warp-loads of 4 rows a group and warp
# the loader's defaults (mla_decode passes its FP8_SEESAW_* values)
GROUPS_AHEAD = 3                      # groups loaded ahead of the one converted
PREFETCH = False                      # warp 0 asks L2 for the bytes of the page after next
CARRY = True                          # loads run ahead across pages
NZ = 0x80008000                       # -0.0 twice: the fma's addend
SEL_SWAP = 0x4444                     # prmt selectors 0x9180 / 0xB3A2 (bytes of a) <-> 0xD5C4 / 0xF7E6 (of b)


def part_groups(parts: int) -> tuple:
    """The column groups that end each of `parts` parts of a page (2: groups 0-1 | 2-3)."""
    return tuple(GROUPS * (p + 1) // parts for p in range(parts))


def part_ending_at(g: int, parts: int) -> int:
    """The part that column group g ends, or -1."""
    ends = part_groups(parts)
    return ends.index(g + 1) if g + 1 in ends else -1


def part_k_blocks(parts: int) -> tuple:
    """S's k-blocks (16 columns) a part starts at, and the end: the last part also has the rope's 64 columns."""
    return (0, *(g * 8 for g in part_groups(parts)[:-1]), D_QK // 16)


class LaneConsts:
    """What a loader thread computes once: its prmt selectors, its store offset in a stage (of its first row's first
    chunk; the others are XORs and adds of it, store_group), its byte offsets within a page (data; the scale's is
    data + scale_delta) and its first row."""

    def __init__(self, warp: Int32, lane: Int32):
        c = lane % 8                      # the 16-byte chunk of the group's 128 e4m3 bytes
        sub = lane // 8                   # the row within a warp-load's 4
        odd = c // 4                      # the chunk's 64-column block within the group
        swap = odd * SEL_SWAP
        self.sel = [swap ^ 0x9180, swap ^ 0xB3A2, swap ^ 0xD5C4, swap ^ 0xF7E6]
        self.row0 = 16 * warp + sub
        self.store = odd * BLOCK_BYTES + self.row0 * 128 + ((2 * (c % 4) + odd) ^ sub) * 16
        self.data = Int64(self.row0 * ROW_BYTES + 16 * c)
        self.scale_delta = Int64(SCALE_BYTE - 16 * c)


def load_group(lc: LaneConsts, page_addr: Int64, g: int) -> list:
    """Column group g's loads of the page at global address `page_addr`: per warp-load the thread's 4 data words and
    its row's scale."""
    data = page_addr + lc.data
    scale = data + lc.scale_delta
    out = []
    for q in range(LOADS):
        out += ld_global_v4_b32(data + (4 * q * ROW_BYTES + 128 * g), streamed=True)
        out.append(ld_global_nc_b32(scale + (4 * q * ROW_BYTES + 4 * g)))
    return out


def store_group(lc: LaneConsts, words: list, g: int, stage_base: Int32, valid: Int32):
    """Column group g (load_group's words) as bf16 into the stage at shared address `stage_base` (1024-byte aligned);
    rows >= `valid` as zeros (multiplier 0). Load q's row is 4 q further down (+512 q bytes) and its swizzle XORs the
    chunk with 4 more where q is odd (bit 6); the second chunk of a row is the first's XOR 1 (bit 4)."""
    for q in range(LOADS):
        w = words[5 * q:5 * q + 5]
        keep = _all_ones_if_lt(lc.row0 + 4 * q, valid)
        mult = _bf16x2_hi(w[4] + EXP_120) & keep
        dst = ((stage_base + g * (2 * BLOCK_BYTES) + lc.store) ^ (64 * (q % 2))) + 512 * q
        convert16_store(w[:4], lc.sel, mult, dst, dst ^ 16)


@cute.jit
def fp8_register_loader(tidx: Int32, warp_idx: Int32, kv_addr: Int64, skv_base: Int32, pipes: tuple,
                        tma_pe: cute.CopyAtom, tPg: cute.Tensor, tPs: cute.Tensor, mBT: cute.Tensor, batch: Int32,
                        first_page: Int32, n_tiles: Int32, seqlen: Int32, start: Int32,
                        stages: cutlass.Constexpr[int], ahead: cutlass.Constexpr[int] = GROUPS_AHEAD,
                        prefetch: cutlass.Constexpr[bool] = PREFETCH, carry: cutlass.Constexpr[bool] = CARRY):
    """The loader warpgroup's part of one (request, split): its n_tiles pages from page index first_page of the
    block table into the ring (stages of [64, 576] bf16 from shared address skv_base), page t into stage t % stages
    once the consumers freed it, handed over part by part: `pipes` holds a pipeline per part (part_groups; the last
    one's full barrier also takes k_pe's TMA bytes). Loads go `ahead` column groups ahead of the one converted. With
    `prefetch`, warp 0 asks L2 for page t + 2's bytes (one bulk prefetch of the whole page, the block-table entry the
    loads read ahead anyway) while it starts page t, so that the loads find them there: a thread's registers hold
    too few bytes in flight to cover the trip from DRAM (Little's law), the prefetch engine's requests hold none.
    Without `carry`, a page's first loads are issued at its start (after the page before was handed over) instead
    of while the page before is converted: no load is in flight at a hand-over's proxy fence (a MEMBAR.ALL.CTA in
    the SASS), which may wait for them."""
    last = pipes[len(pipes) - 1]
    lc = LaneConsts(warp_idx, tidx % 32)
    page = Int32(0)              # an n_tiles of 0 loads page 0's first groups, which exist, and uses none of them
    nxt = Int32(0)
    if n_tiles > 0:
        page = mBT[batch, first_page]
        nxt = mBT[batch, first_page + cutlass.min(1, n_tiles - 1)]
    addr = kv_addr + Int64(page) * PAGE_BYTES
    loaded = [load_group(lc, addr, g) for g in range(ahead if carry else 0)]
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    if const_expr(prefetch):
        if warp_idx == 0 and n_tiles > 1:
            prefetch_l2(kv_addr + Int64(nxt) * PAGE_BYTES, PAGE_BYTES)
    for t in cutlass.range(n_tiles, unroll=1):
        later = mBT[batch, first_page + cutlass.min(t + 2, n_tiles - 1)]
        if const_expr(prefetch):
            if warp_idx == 0 and t + 2 < n_tiles:
                prefetch_l2(kv_addr + Int64(later) * PAGE_BYTES, PAGE_BYTES)
        nxt_addr = kv_addr + Int64(nxt) * PAGE_BYTES
        valid = seqlen - (start + t * TILE_N)
        stage_base = skv_base + state.index * STAGE_BYTES
        if const_expr(not carry):
            loaded = [load_group(lc, addr, g) for g in range(ahead)]
        # the stage is free (the consumers free all its parts at once): warp 0 arrives on the last part's full
        # barrier with k_pe's bytes and issues its TMA
        for earlier in cutlass.range_constexpr(len(pipes) - 1):
            pipes[earlier].sync_object_empty.wait(state.index, state.phase)
        if warp_idx == 0:
            last.producer_acquire(state)
            cute.copy(tma_pe, tPg[None, page], tPs[None, state.index], tma_bar_ptr=last.producer_get_barrier(state))
        else:
            last.sync_object_empty.wait(state.index, state.phase)
        this_page = list(loaded)
        next_page = []
        for g in cutlass.range_constexpr(GROUPS):
            store_group(lc, this_page[g], g, stage_base, valid)
            k = g + ahead
            if const_expr(k < GROUPS):
                this_page.append(load_group(lc, addr, k))
            elif const_expr(carry):
                next_page.append(load_group(lc, nxt_addr, k - GROUPS))
            if const_expr(part_ending_at(g, len(pipes)) >= 0):
                # generic-proxy stores -> the consumers' wgmma (async proxy), then this thread's arrival
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.mbarrier_arrive(pipes[part_ending_at(g, len(pipes))].producer_get_barrier(state))
        state.advance()
        loaded = next_page
        addr = nxt_addr
        page = nxt
        nxt = later


@dsl_user_op
def prefetch_l2(addr: Int64, nbytes: int, *, loc=None, ip=None) -> None:
    """A bulk prefetch of `nbytes` (a multiple of 16) from global address `addr` (16-byte aligned) into L2, issued by
    one elected lane of the calling warp."""
    llvm.inline_asm(
        None, [Int64(addr).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred p;\nelect.sync _|p, 0xffffffff;\n"
        f"@p cp.async.bulk.prefetch.L2.global [$0], {nbytes};\n}}\n",
        "l", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def ld_global_nc_b32(addr: Int64, *, loc=None, ip=None) -> Int32:
    """The word at global address `addr`, as fragment_ops.ld_global_v4_b32(streamed=True) reads."""
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.nc.L1::no_allocate.b32 $0, [$1];", "=r,l",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def convert16_store(words: list, sel: list, mult: Int32, dst0: Int32, dst1: Int32, *, loc=None, ip=None) -> None:
    """16 e4m3 bytes (`words`) -> 16 bf16 (e4m3 * scale, RNE) as two 16-byte shared stores: the 8 values that
    prmt selectors sel[0], sel[1] take from (words[0], words[2]) and (words[1], words[3]) at `dst0`, those of
    sel[2], sel[3] at `dst1`. `mult`: bf16x2 scale * 2^120 (fp8_dequant's bit trick; 0 zeroes the row)."""
    args = [Int32(x).ir_value(loc=loc, ip=ip) for x in (*words, *sel, mult, dst0, dst1)]
    body = []
    for n, (a, b, s) in enumerate(((0, 2, 4), (0, 2, 5), (1, 3, 4), (1, 3, 5),
                                   (0, 2, 6), (0, 2, 7), (1, 3, 6), (1, 3, 7))):
        body.append(f"prmt.b32 y{n}, ${a}, ${b}, ${s};")
    body += [f"shl.b32 y{n}, y{n}, 4;" for n in range(8)]
    body += [f"and.b32 y{n}, y{n}, 0x87F087F0;" for n in range(8)]
    body += [f"fma.rn.bf16x2 y{n}, y{n}, $8, nz;" for n in range(8)]
    llvm.inline_asm(
        None, args,
        "{\n.reg .b32 y0, y1, y2, y3, y4, y5, y6, y7, nz;\n"
        f"mov.b32 nz, {NZ:#x};\n" + "\n".join(body) + "\n"
        "st.shared.v4.b32 [$9], {y0, y1, y2, y3};\n"
        "st.shared.v4.b32 [$10], {y4, y5, y6, y7};\n}\n",
        "r,r,r,r,r,r,r,r,r,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
