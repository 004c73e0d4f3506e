"""The register-path loader of the FP8 seesaw decode (mla_decode_fp8_seesaw_kernel.py): a warpgroup that reads each
page of the FP8 656-byte cache with 16-byte global loads straight into registers and writes the page as the bf16
[64, 576] ring stage the seesaw consumers read (mla_decode_consumer.SeesawConsumer), so that FP8 pages flow through
the bf16 kernel's schedule with no raw smem stage (Q 72 KB + two 72 KB stages + P 8 KB leave no room for one).

Per page and warp w (rows 2w, 2w + 1, 2w + 8, 2w + 9, ..., 16 rows whose row % 8 is 2w or 2w + 1, so that a thread's
swizzled store addresses take two patterns, not eight): one row a warp-load, lane l its 16 e4m3 bytes l (columns
16 l .. 16 l + 15: 512 coalesced bytes a row) and the row's scale of those columns (a 4-byte load the 8 lanes of a
scale group share). The 16 bytes become two 16-byte bf16 chunks of the 128-byte-swizzled 64-column block l // 4
(fp8_dequant's bit trick: exact, no conversion instruction); lanes of odd blocks store their second chunk first,
so that each store instruction of the warp covers all 8 bank groups (4 wavefronts, the minimum for 512 bytes). The
swap costs nothing: it is in the prmt selectors, which are registers. k_pe travels by TMA into the stage's rope
columns, issued by warp 0 once the stage is free, on the stage's full barrier (the loader's 128 arrivals after its
proxy fence, and the TMA's one with its bytes).

Loads run GROUPS_AHEAD groups of GROUP_ROWS rows (5 words a row and thread) ahead of the conversion, across pages:
the next page's first groups are issued while this page's last are converted, before the wait for the next stage to
be free. With PREFETCH, warp 0 asks L2 for the page after next (one bulk prefetch a page).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from mlaserve.kernels.cutedsl.fp8_dequant import EXP_120, _all_ones_if_lt, _bf16x2_hi, _ld_shared_b32
from mlaserve.kernels.cutedsl.fragment_ops import ld_global_nc_b32, ld_global_v4_b32

TILE_N = 64
D_QK = 576
ROW_BYTES = 656       # an FP8 row: 512 e4m3 bytes, 4 fp32 scales, 64 bf16 k_pe
SCALE_BYTE = 512
PAGE_BYTES = TILE_N * ROW_BYTES
STAGE_BYTES = TILE_N * D_QK * 2       # a bf16 ring stage [64, 576]
BLOCK_BYTES = TILE_N * 128            # one 64-column block of it (128-byte swizzle)
LOADER_THREADS = 128
WARP_ROWS = TILE_N // 4               # rows a loader warp converts a page
GROUP_ROWS = 4                        # rows a warp's group of loads covers (module default: mla_decode sets its own)
GROUPS_AHEAD = 3                      # groups loaded ahead of the one converted (module default, as above)
PREFETCH = False                      # warp 0 asks L2 for the bytes of the page after next (module default, as above)
BT_AHEAD = 8                          # bt_base: each page's block-table entry copied into smem this many pages before
BT_SLOTS = 16                         # ... its first use, into a ring of this many words a warp
BT_WORDS = LOADER_THREADS // 32 * BT_SLOTS   # ... and the rings of the loader's 4 warps
assert 2 <= BT_AHEAD <= min(BT_SLOTS, 32), "the ring's first BT_AHEAD entries come from as many lanes at once"
NZ = 0x80008000                       # -0.0 twice: the fma's addend
SEL_SWAP = 0x4444                     # prmt selectors 0x9180 / 0xB3A2 (bytes of a) <-> 0xD5C4 / 0xF7E6 (of b)


def row_of(i: int) -> int:
    """A warp's i-th row (0 .. 15) less 2w: 0, 1, 8, 9, 16, 17, ..."""
    return i % 2 + 8 * (i // 2)


class LaneConsts:
    """What a loader thread computes once: its prmt selectors, its store offsets in a stage (per row parity p and
    store s) and its byte offsets within a row (data and scale), for warp `warp` and lane `lane`."""

    def __init__(self, warp: Int32, lane: Int32):
        blk = lane // 4
        odd = blk % 2
        swap = odd * SEL_SWAP
        self.sel = [swap ^ 0x9180, swap ^ 0xB3A2, swap ^ 0xD5C4, swap ^ 0xF7E6]
        self.store = []
        for p in range(2):
            r = 2 * warp + p
            for s in range(2):
                chunk = (2 * (lane % 4) + (odd ^ s)) ^ r
                self.store.append(blk * BLOCK_BYTES + r * 128 + chunk * 16)
        self.data = Int64(2 * warp * ROW_BYTES + 16 * lane)
        self.scale = Int64(2 * warp * ROW_BYTES + SCALE_BYTE + 4 * (lane // 8))
        self.row0 = 2 * warp


def load_group(lc: LaneConsts, page_addr: Int64, j: int, rows: int) -> list:
    """Group j's loads (of `rows` rows) of the page at global address `page_addr`: per row its 4 data words and its
    scale word."""
    data = page_addr + lc.data
    scale = page_addr + lc.scale
    out = []
    for i in range(rows * j, rows * (j + 1)):
        out += ld_global_v4_b32(data + row_of(i) * ROW_BYTES, streamed=True)
        out.append(ld_global_nc_b32(scale + row_of(i) * ROW_BYTES))
    return out


def store_group(lc: LaneConsts, words: list, j: int, rows: int, stage_base: Int32, valid: Int32):
    """Group j's rows (load_group's words) as bf16 into the stage at shared address `stage_base`; rows >= `valid`
    as zeros (multiplier 0)."""
    for n, i in enumerate(range(rows * j, rows * (j + 1))):
        w = words[5 * n:5 * n + 5]
        keep = _all_ones_if_lt(lc.row0 + row_of(i), valid)
        mult = _bf16x2_hi(w[4] + EXP_120) & keep
        base = stage_base + (i // 2) * 1024
        convert16_store(w[:4], lc.sel, mult, base + lc.store[2 * (i % 2)], base + lc.store[2 * (i % 2) + 1])


@cute.jit
def fp8_register_loader(tidx: Int32, warp_idx: Int32, kv_addr: Int64, skv_base: Int32, kv_pipe, tma_pe: cute.CopyAtom,
                        tPg: cute.Tensor, tPs: cute.Tensor, mBT: cute.Tensor, batch: Int32, first_page: Int32,
                        n_tiles: Int32, seqlen: Int32, start: Int32, stages: cutlass.Constexpr[int],
                        group_rows: cutlass.Constexpr[int] = GROUP_ROWS, ahead: cutlass.Constexpr[int] = GROUPS_AHEAD,
                        prefetch: cutlass.Constexpr[bool] = PREFETCH, bt_base: Int32 = None):
    """The loader warpgroup's part of one (request, split): its n_tiles pages from page index first_page of the
    block table into the ring (stages of [64, 576] bf16 from shared address skv_base), page t into stage t % stages
    once kv_pipe says it is free, then handed over on its full barrier. Loads go in groups of `group_rows` rows a
    warp, `ahead` groups ahead of the one converted. With `prefetch`, warp 0 asks L2 for page t + 2's bytes (one bulk
    prefetch of the whole page, the block-table entry the loads read ahead anyway) while it starts page t, so that the
    loads find them there: a thread's registers hold too few bytes in flight to cover the trip from DRAM (Little's
    law), the prefetch engine's requests hold none. With `bt_base` (the shared address of BT_WORDS words) each warp
    copies the block table into a ring of its own by cp.async (lane 0, one 4-byte entry a page, BT_AHEAD pages before
    its first use), and reads each page's entries from there: read from global memory at each page's start, page
    t + 2's entry went at once into a uniform register (ptxas's R2UR, in all four warps), which held each warp for the
    read's trip every page (ncu: 21% of the loader's stall samples at b128 h64 8k, bench/NOTES.md 160)."""
    groups = WARP_ROWS // group_rows
    lc = LaneConsts(warp_idx, tidx % 32)
    page = Int32(0)              # an n_tiles of 0 loads page 0's first groups, which exist, and uses none of them
    nxt = Int32(0)
    bt_row = mBT.iterator.toint() + Int64(batch * mBT.shape[1] + first_page) * 4
    if n_tiles > 0:
        if const_expr(bt_base is not None):
            # pages 0 .. BT_AHEAD - 1 (the last page past the split's end) by lanes 0 .. BT_AHEAD - 1, waited for
            ring = bt_base + tidx // 32 * (4 * BT_SLOTS)
            if tidx % 32 < BT_AHEAD:
                cp_async_b32(ring + tidx % 32 * 4, bt_row + Int64(cutlass.min(tidx % 32, n_tiles - 1)) * 4)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_warp()
            page = _ld_shared_b32(ring)
            nxt = _ld_shared_b32(ring + 4 * cutlass.min(1, n_tiles - 1))
        else:
            page = mBT[batch, first_page]
            nxt = mBT[batch, first_page + cutlass.min(1, n_tiles - 1)]
    addr = kv_addr + Int64(page) * PAGE_BYTES
    loaded = [load_group(lc, addr, j, group_rows) for j in range(ahead)]
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    if const_expr(prefetch):
        if warp_idx == 0 and n_tiles > 1:
            prefetch_l2(kv_addr + Int64(nxt) * PAGE_BYTES, PAGE_BYTES)
    for t in cutlass.range(n_tiles, unroll=1):
        if const_expr(bt_base is not None):
            # page t + BT_AHEAD's entry into its slot; then the copies of the pages up to t + 2 are complete (at most
            # BT_AHEAD - 2 younger groups pending) and page t + 2's entry is read
            ring = bt_base + tidx // 32 * (4 * BT_SLOTS)
            if tidx % 32 == 0:
                cp_async_b32(ring + (t + BT_AHEAD) % BT_SLOTS * 4,
                             bt_row + Int64(cutlass.min(t + BT_AHEAD, n_tiles - 1)) * 4)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(BT_AHEAD - 2)
            cute.arch.sync_warp()
            later = _ld_shared_b32(ring + (t + 2) % BT_SLOTS * 4)
        else:
            later = mBT[batch, first_page + cutlass.min(t + 2, n_tiles - 1)]
        if const_expr(prefetch):
            if warp_idx == 0 and t + 2 < n_tiles:
                prefetch_l2(kv_addr + Int64(later) * PAGE_BYTES, PAGE_BYTES)
        nxt_addr = kv_addr + Int64(nxt) * PAGE_BYTES
        valid = seqlen - (start + t * TILE_N)
        stage_base = skv_base + state.index * STAGE_BYTES
        # the stage is free: warp 0 arrives with k_pe's bytes and issues its TMA
        if warp_idx == 0:
            kv_pipe.producer_acquire(state)
            cute.copy(tma_pe, tPg[None, page], tPs[None, state.index], tma_bar_ptr=kv_pipe.producer_get_barrier(state))
        else:
            kv_pipe.sync_object_empty.wait(state.index, state.phase)
        this_page = list(loaded)
        next_page = []
        for j in cutlass.range_constexpr(groups):
            store_group(lc, this_page[j], j, group_rows, stage_base, valid)
            k = j + ahead
            if const_expr(k < groups):
                this_page.append(load_group(lc, addr, k, group_rows))
            else:
                next_page.append(load_group(lc, nxt_addr, k - groups, group_rows))
        # generic-proxy stores -> the consumers' wgmma (async proxy), then this thread's arrival
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_arrive(kv_pipe.producer_get_barrier(state))
        state.advance()
        loaded = next_page
        addr = nxt_addr
        page = nxt
        nxt = later


@dsl_user_op
def cp_async_b32(dst: Int32, src: Int64, *, loc=None, ip=None) -> None:
    """cp.async of the 4 bytes at global address `src` to shared address `dst` (in this thread's open group)."""
    llvm.inline_asm(None, [Int32(dst).ir_value(loc=loc, ip=ip), Int64(src).ir_value(loc=loc, ip=ip)],
                    "cp.async.ca.shared.global [$0], [$1], 4;", "r,l",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


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
