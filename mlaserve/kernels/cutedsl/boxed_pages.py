"""The frame the keys-on-M FP8 decode kernels with consumer-owned stages share (mla_decode_fp8_mma_kernel.py,
mla_decode_fp8_f16_kernel.py): each page's 512 e4m3 bytes a row TMA'd as four [64, 128] boxes in the 128-byte
swizzle, its scales [64, 4] fp32 and k_pe [64, 64] bf16, into stages that the consumers refill themselves (the
consumers' merge and O^T's stores at the end: consumer_ends.py). Everything here is inlined into the calling kernel
at trace time.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import dsl_user_op

from mlaserve.kernels.cutedsl.fp8_pages import D_PE, D_V, PE_BYTES, ROPE_ELEMS, ROW_WORDS, TILE_N
from mlaserve.kernels.cutedsl.request_rows import grid_request, page_split

GROUPS = 4            # scale groups of 128 columns
M_TILES = D_V // 64   # O^T's 64-dim tiles
KV_BYTES = TILE_N * D_V
SCALE_BYTES = TILE_N * GROUPS * 4
CONSUMER_THREADS = 128
THREADS = 256         # two consumer warpgroups, no producer
WARPS = 4             # a consumer's warps
STAGES = 4            # consumer c owns stages c and c + 2 (pages t = c, c + 2, ...)
BAR_MERGE = 2         # both consumers: the stashes for the end's merge stored
BAR_RED = 3           # + 2 c: consumer c's 4 warps: column maxima (then sums); a page's stage read


def page_host_setup(kv_ptr: cute.Pointer, rope_ptr: cute.Pointer, num_pages: Int32, stages: int):
    """The stages' smem layouts (e4m3 boxes [64, 512, stages], k_pe [64, 64, stages], scales [64, 4, stages]) and
    the three TMA atoms with their tensors, over the cache of num_pages pages (kv_ptr as e4m3 bytes at each row's
    start, rope_ptr as bf16 at its k_pe). -> (sK_layout, sPE_layout, sSc_layout), (tma_kv, mKV_tma, tma_sc,
    mSc_tma, tma_pe, mPE_tma)."""
    f8 = cutlass.Float8E4M3FN
    bf16 = cutlass.BFloat16
    n_rows = num_pages * TILE_N
    mKV = cute.make_tensor(cute.recast_ptr(kv_ptr, dtype=f8),
                           cute.make_layout((n_rows, D_V), stride=(ROW_WORDS * 4, 1)))
    mSc = cute.make_tensor(cute.recast_ptr(kv_ptr + D_V // 4, dtype=Float32),
                           cute.make_layout((n_rows, GROUPS), stride=(ROW_WORDS, 1)))
    mRope = cute.make_tensor(rope_ptr, cute.make_layout((n_rows, D_PE), stride=(ROPE_ELEMS, 1)))
    atom8 = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, f8, D_V), f8)
    atom16 = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, bf16, D_PE), bf16)
    sK_layout = cute.tile_to_shape(atom8, (TILE_N, D_V, stages), order=(0, 1, 2))
    sPE_layout = cute.tile_to_shape(atom16, (TILE_N, D_PE, stages), order=(0, 1, 2))
    sSc_layout = cute.make_layout((TILE_N, GROUPS, stages), stride=(GROUPS, 1, TILE_N * GROUPS))
    tma_op = cpasync.CopyBulkTensorTileG2SOp()
    tma_kv, mKV_tma = cpasync.make_tiled_tma_atom(tma_op, mKV, cute.slice_(sK_layout, (None, None, 0)), (TILE_N, D_V))
    tma_sc, mSc_tma = cpasync.make_tiled_tma_atom(tma_op, mSc, cute.slice_(sSc_layout, (None, None, 0)),
                                                  (TILE_N, GROUPS))
    tma_pe, mPE_tma = cpasync.make_tiled_tma_atom(tma_op, mRope, cute.slice_(sPE_layout, (None, None, 0)),
                                                  (TILE_N, D_PE))
    return (sK_layout, sPE_layout, sSc_layout), (tma_kv, mKV_tma, tma_sc, mSc_tma, tma_pe, mPE_tma)


@cute.jit
def kernel_start(shared_storage, mLse: cute.Tensor, mPO: cute.Tensor, ordered: cutlass.Constexpr[bool],
                 is_split: cutlass.Constexpr[bool]):
    """A kernel's first steps: its indices (the request through the grid's order), its smem struct, the stages'
    full barriers initialized and fenced -> (tidx, split, batch, lane, c, ctid, warp, storage, full), c the
    consumer, ctid its thread, warp its warp."""
    tidx, _, _ = cute.arch.thread_idx()
    _, split, batch = cute.arch.block_idx()
    batch = grid_request(batch, mLse, mPO, ordered, is_split)
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    lane = tidx % 32
    c = warp_idx // WARPS
    ctid = tidx - CONSUMER_THREADS * c
    warp = warp_idx % WARPS
    smem = utils.SmemAllocator()
    storage = smem.allocate(shared_storage)
    full = storage.full.data_ptr()
    if tidx == 0:
        for s in cutlass.range_constexpr(STAGES):
            cute.arch.mbarrier_init(full + s, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    return tidx, split, batch, lane, c, ctid, warp, storage, full


@cute.jit
def first_pages(tma_kv: cute.CopyAtom, mKV_tma: cute.Tensor, tma_sc: cute.CopyAtom, mSc_tma: cute.Tensor,
                tma_pe: cute.CopyAtom, mPE_tma: cute.Tensor, sK: cute.Tensor, sSc: cute.Tensor, sPE: cute.Tensor,
                mBT: cute.Tensor, mSeqlens: cute.Tensor, batch: Int32, split: Int32, num_splits: Int32, c: Int32,
                warp: Int32, lane: Int32, full: cute.Pointer, bt_early: cutlass.Constexpr[bool] = False,
                loads: cutlass.Constexpr[int] = STAGES // 2):
    """The split's pages and the TMA partitions; each consumer's warp 0 loads its first `loads` pages (two, or
    one where the kernel asks for the second later; consumer 0's first prefetches the descriptors) -> (seqlen,
    start, n_tiles, first_page, partitions as load_page takes them). bt_early (unsplit launches, whose first page
    is 0): those pages' block-table entries are read beside the request's length instead of after it, so that the
    first loads wait for one global read, not two."""
    early = []
    if const_expr(bt_early):
        for p in cutlass.range_constexpr(loads):
            # a column within the table whatever the request's length (its entry is used only below that length)
            col = cutlass.min(c + 2 * p, mBT.shape[1] - 1)
            early.append(ld_global_b32(mBT.iterator.toint() + cutlass.Int64(batch * mBT.shape[1] + col) * 4))
    seqlen = mSeqlens[batch]
    start, n_tiles = page_split(seqlen, split, num_splits)
    first_page = start // TILE_N

    tKs, tKg, tSs, tSg, tPs, tPg = page_partitions(tma_kv, mKV_tma, tma_sc, mSc_tma, tma_pe, mPE_tma, sK, sSc, sPE)
    if warp == 0:
        if c == 0:
            cpasync.prefetch_descriptor(tma_kv)
            cpasync.prefetch_descriptor(tma_sc)
            cpasync.prefetch_descriptor(tma_pe)
        for p in cutlass.range_constexpr(loads):
            if c + 2 * p < n_tiles:
                if const_expr(bt_early):
                    load_page(tma_kv, tKg, tKs, tma_sc, tSg, tSs, tma_pe, tPg, tPs, full, early[p], c + 2 * p, lane)
                else:
                    load_page(tma_kv, tKg, tKs, tma_sc, tSg, tSs, tma_pe, tPg, tPs, full,
                              mBT[batch, first_page + c + 2 * p], c + 2 * p, lane)
    return seqlen, start, n_tiles, first_page, (tKs, tKg, tSs, tSg, tPs, tPg)


def page_partitions(tma_kv: cute.CopyAtom, mKV_tma: cute.Tensor, tma_sc: cute.CopyAtom, mSc_tma: cute.Tensor,
                    tma_pe: cute.CopyAtom, mPE_tma: cute.Tensor, sK: cute.Tensor, sSc: cute.Tensor, sPE: cute.Tensor):
    """The TMA partitions of a page's three parts, [.., pages] in global memory and [.., stages] in smem ->
    (tKs, tKg, tSs, tSg, tPs, tPg), as load_page takes them."""
    gKV = cute.local_tile(mKV_tma, (TILE_N, D_V), (None, 0))          # [64, 512, pages]
    gSc = cute.local_tile(mSc_tma, (TILE_N, GROUPS), (None, 0))       # [64, 4, pages]
    gPE = cute.local_tile(mPE_tma, (TILE_N, D_PE), (None, 0))         # [64, 64, pages]
    tKs, tKg = cpasync.tma_partition(tma_kv, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                     cute.group_modes(gKV, 0, 2))
    tSs, tSg = cpasync.tma_partition(tma_sc, 0, cute.make_layout(1), cute.group_modes(sSc, 0, 2),
                                     cute.group_modes(gSc, 0, 2))
    tPs, tPg = cpasync.tma_partition(tma_pe, 0, cute.make_layout(1), cute.group_modes(sPE, 0, 2),
                                     cute.group_modes(gPE, 0, 2))
    return tKs, tKg, tSs, tSg, tPs, tPg


@cute.jit
def load_page(tma_kv: cute.CopyAtom, tKg: cute.Tensor, tKs: cute.Tensor, tma_sc: cute.CopyAtom, tSg: cute.Tensor,
               tSs: cute.Tensor, tma_pe: cute.CopyAtom, tPg: cute.Tensor, tPs: cute.Tensor, full: cute.Pointer,
               page: Int32, st: Int32, lane: Int32):
    """Page `page`'s e4m3 boxes, scales and k_pe into stage st, on full[st] (called by one whole warp)."""
    if lane == 0:
        cute.arch.mbarrier_arrive_and_expect_tx(full + st, KV_BYTES + SCALE_BYTES + PE_BYTES)
    cute.copy(tma_kv, tKg[None, page], tKs[None, st], tma_bar_ptr=full + st)
    cute.copy(tma_sc, tSg[None, page], tSs[None, st], tma_bar_ptr=full + st)
    cute.copy(tma_pe, tPg[None, page], tPs[None, st], tma_bar_ptr=full + st)


@cute.jit
def wait_page(full: cute.Pointer, t: Int32, k_base: Int32, start: Int32, seqlen: Int32, ctid: Int32, bar_p: Int32):
    """A consumer's wait for page t of the split -> (stage, first token, the request's tokens from it, the stage's
    e4m3 base address); on a last page the rows past the request are zeroed first (bar_p: the consumer's own)."""
    st = t % STAGES
    tok0 = start + t * TILE_N
    valid = seqlen - tok0
    cute.arch.mbarrier_wait(full + st, (t // STAGES) % 2)
    stage_base = k_base + st * KV_BYTES
    if valid < TILE_N:
        # e4m3 0xFF is NaN and 0 * NaN is NaN: the rows past the request become zeros before any MMA
        zero_rows(stage_base, valid, ctid)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=bar_p, number_of_threads=CONSUMER_THREADS)
    return st, tok0, valid, stage_base


@cute.jit
def zero_rows(stage_base: Int32, valid: Int32, ctid: Int32):
    """Rows valid .. 63 of the stage's four e4m3 boxes [64, 128] to zeros (16-byte stores; the swizzle permutes
    16-byte chunks within a row, so whole rows are whole rows)."""
    for j in cutlass.range_constexpr(TILE_N * D_V // 16 // CONSUMER_THREADS):
        chunk = ctid + CONSUMER_THREADS * j          # 16-byte chunk: box g, row, chunk in row
        g = chunk // (TILE_N * 8)
        row = (chunk // 8) % TILE_N
        if row >= valid:
            st_shared_zero16(stage_base + g * (TILE_N * 128) + row * 128 + (chunk % 8) * 16)


def v_dim(m_row: Int32) -> Int32:
    """The dim (within a 64-dim M tile) of O^T's M row `m_row`."""
    i = m_row % 16
    return 16 * (m_row // 16) + 2 * (i % 8) + i // 8


@dsl_user_op
def ld_global_b32(addr: cutlass.Int64, *, loc=None, ip=None) -> Int32:
    """The word at global address `addr`, read where the program reads it: volatile, which neither LLVM nor ptxas
    moves (ptxas sank a plain load into the branch that used it, past the reads that came after it)."""
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [cutlass.Int64(addr).ir_value(loc=loc, ip=ip)], "ld.volatile.global.b32 $0, [$1];", "=r,l",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def st_shared_zero16(addr: Int32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [Int32(addr).ir_value(loc=loc, ip=ip)],
                    "st.shared.v4.b32 [$0], {0, 0, 0, 0};", "r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
