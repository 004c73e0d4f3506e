"""How the CuTe DSL FP8 kernels that dequantize pages into bf16 tiles in smem (mla_decode_fp8_narrow_kernel.py,
sparse_mla_fp8_kernel.py) bring the 656-byte FP8 pages in and multiply on them: the format's layout constants, the
host-side tensors, smem layouts and TMA atoms, the loader warpgroup (TMA of Q and each page's raw bytes into a ring
of RAW_STAGES stages, or one, dequantization into bf16 tiles handed over on mbarriers: fp8_dequant.py), and the
QK / PV wgmma groups on those tiles. sparse_mla_fp8_kernel.py's docstring describes the barriers per tile.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from mlaserve.kernels.cutedsl.fp8_dequant import KV_BLOCKS, dequant_tile, load_raw_page, store_half, store_tile
from mlaserve.kernels.cutedsl.split_consumers import arrive_p_free

TILE_N = 64           # cached tokens per tile: one page
D_QK = 576
D_V = 512
D_PE = D_QK - D_V
RAW_WORDS = 132       # the e4m3 bytes and the 4 scales of a row, in 32-bit words (528 B)
ROW_WORDS = 164       # 656 B
ROPE_ELEMS = 328      # a row in bf16 elements; k_pe starts at element 264 (byte 528)
RAW_STAGES = 2
LOADER_THREADS = 128
HALF_SLOTS = 3        # the FP8 sparse kernel's half ring: bf16 slots of a column half [64, 256] each
HALF_SLOT_BYTES = TILE_N * D_V
PE_BYTES = TILE_N * D_PE * 2


def fp8_host_setup(q_rows: int, q_ptr, kv_ptr, rope_ptr, bt_ptr, seqlens_ptr, out_ptr, lse_ptr, po_ptr, pl_ptr,
                   batch, s_q, h, num_pages, max_pages, num_splits, raw_stages: int = RAW_STAGES):
    """The host-side pieces of the narrow FP8 dense kernel (mla_decode_fp8_narrow_kernel.py), from `__call__`'s
    arguments (see MLADecodeFP8NarrowSm90.__call__), for CTAs of `q_rows` query rows:
      tensors (block table, seqlens, out, lse, partial out, partial lse),
      smem layouts (the 128-byte-swizzle K-major atom; Q [q_rows, 576]; the bf16 c_kv tile [64, 512]; the
        raw ring's k_pe [64, 64, raw_stages] and bytes [64, 132 words, raw_stages], plain row-major),
      TMA atoms with their tensors (Q, the raw bytes, k_pe)."""
    dtype = cutlass.BFloat16
    rows = s_q * h
    n_rows = num_pages * TILE_N
    mQ = cute.make_tensor(q_ptr, cute.make_layout((rows, D_QK, batch), stride=(D_QK, 1, rows * D_QK)))
    mRaw = cute.make_tensor(kv_ptr, cute.make_layout((n_rows, RAW_WORDS), stride=(ROW_WORDS, 1)))
    mRope = cute.make_tensor(rope_ptr, cute.make_layout((n_rows, D_PE), stride=(ROPE_ELEMS, 1)))
    mBT, mSeqlens, mOut, mLse, mPO, mPL = fp8_io_tensors(bt_ptr, seqlens_ptr, out_ptr, lse_ptr, po_ptr, pl_ptr,
                                                         batch, rows, max_pages, num_splits)

    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, dtype, D_QK), dtype)
    sQ_layout = cute.tile_to_shape(atom, (q_rows, D_QK), order=(0, 1))
    sKV_layout = cute.tile_to_shape(atom, (TILE_N, D_V), order=(0, 1))
    sPE_layout = cute.tile_to_shape(atom, (TILE_N, D_PE, raw_stages), order=(0, 1, 2))
    sRaw_layout = cute.make_layout((TILE_N, RAW_WORDS, raw_stages), stride=(RAW_WORDS, 1, TILE_N * RAW_WORDS))

    tma_op = cpasync.CopyBulkTensorTileG2SOp()
    tma_q, mQ_tma = cpasync.make_tiled_tma_atom(tma_op, mQ, sQ_layout, (q_rows, D_QK))
    tma_raw, mRaw_tma = cpasync.make_tiled_tma_atom(
        tma_op, mRaw, cute.slice_(sRaw_layout, (None, None, 0)), (TILE_N, RAW_WORDS))
    tma_pe, mPE_tma = cpasync.make_tiled_tma_atom(
        tma_op, mRope, cute.slice_(sPE_layout, (None, None, 0)), (TILE_N, D_PE))
    return ((mBT, mSeqlens, mOut, mLse, mPO, mPL), (atom, sQ_layout, sKV_layout, sPE_layout, sRaw_layout),
            (tma_q, mQ_tma, tma_raw, mRaw_tma, tma_pe, mPE_tma))



def fp8_io_tensors(bt_ptr, seqlens_ptr, out_ptr, lse_ptr, po_ptr, pl_ptr, batch, rows, max_pages, num_splits):
    """The FP8 decode kernels' block table, seqlens, out, lse, partial out and partial lse tensors."""
    mBT = cute.make_tensor(bt_ptr, cute.make_layout((batch, max_pages), stride=(max_pages, 1)))
    mSeqlens = cute.make_tensor(seqlens_ptr, cute.make_layout(batch))
    mOut = cute.make_tensor(out_ptr, cute.make_layout((batch, rows, D_V), stride=(rows * D_V, D_V, 1)))
    mLse = cute.make_tensor(lse_ptr, cute.make_layout((batch, rows), stride=(rows, 1)))
    mPO = cute.make_tensor(po_ptr, cute.make_layout((batch, num_splits, rows, D_V),
                                                    stride=(num_splits * rows * D_V, rows * D_V, D_V, 1)))
    mPL = cute.make_tensor(pl_ptr, cute.make_layout((batch, num_splits, rows), stride=(num_splits * rows, rows, 1)))
    return mBT, mSeqlens, mOut, mLse, mPO, mPL


def fp8_kernel_setup(tidx: Int32, storage, consumer_threads: int, q_rows: int, sQ_layout: cute.ComposedLayout,
                     sKV_layout: cute.ComposedLayout, sPE_layout: cute.ComposedLayout, sRaw_layout: cute.Layout,
                     tiles: int = 1, raw_pe: bool = True, raw_stages: int = RAW_STAGES, tile_barriers: bool = True):
    """In the FP8 dense kernels, before the warp roles split: thread 0 initializes the bf16 tiles' barriers in
    `storage.kv_mbar` (per tile KV_BLOCKS kv_full, each completed by the loader's 128 threads; then a kv_empty a
    tile, by the `consumer_threads`); the raw ring's pipeline (a stage is freed by the 4 loader warps,
    dequantized, and, where k_pe travels in the raw stage (`raw_pe`), by the consumer warps once S used it: one
    elected lane per warp) and Q's (creating them fences the inits and syncs the CTA); the smem tensors.
    Without `tile_barriers` the kernel initializes the tiles' barriers itself (before this call).
    -> (raw_pipe, q_pipe, sQ, sKV, sPE, sRaw)."""
    if tile_barriers:
        _init_tile_barriers(tidx, storage.kv_mbar.data_ptr(), consumer_threads, tiles)
    raw_pipe = pipeline.PipelineTmaAsync.create(
        barrier_storage=storage.raw_mbar.data_ptr(), num_stages=raw_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(
            pipeline.Agent.Thread, (LOADER_THREADS + (consumer_threads if raw_pe else 0)) // 32),
        tx_count=TILE_N * (RAW_WORDS * 4 + (D_PE * 2 if raw_pe else 0)))
    q_pipe = pipeline.PipelineTmaAsync.create(
        barrier_storage=storage.q_mbar.data_ptr(), num_stages=1,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_threads // 32),
        tx_count=q_rows * D_QK * 2)
    return (raw_pipe, q_pipe,
            storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            storage.sKV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner),
            storage.sPE.get_tensor(sPE_layout.outer, swizzle=sPE_layout.inner),
            storage.sRaw.get_tensor(sRaw_layout))


@cute.jit
def _init_tile_barriers(tidx: Int32, kv_full: cute.Pointer, consumer_threads: cutlass.Constexpr[int],
                        tiles: cutlass.Constexpr[int]):
    if tidx == 0:
        for cb in cutlass.range_constexpr(tiles * KV_BLOCKS):
            cute.arch.mbarrier_init(kv_full + cb, LOADER_THREADS)
        for tile in cutlass.range_constexpr(tiles):
            cute.arch.mbarrier_init(kv_full + tiles * KV_BLOCKS + tile, consumer_threads)


@cute.jit
def fp8_loader(tidx: Int32, warp_idx: Int32, tma_q: cute.CopyAtom, mQ_tma: cute.Tensor, sQ: cute.Tensor, q_pipe,
               m_block: Int32, q_rows: cutlass.Constexpr[int], tma_raw: cute.CopyAtom, mRaw_tma: cute.Tensor,
               sRaw: cute.Tensor, tma_pe: cute.CopyAtom, mPE_tma: cute.Tensor, sPE: cute.Tensor, raw_pipe,
               raw_base: Int32, kv_base: Int32, kv_full: cute.Pointer, kv_empty: cute.Pointer, mBT: cute.Tensor,
               batch: Int32, first_page: Int32, n_tiles: Int32, seqlen: Int32, start: Int32,
               tiles: cutlass.Constexpr[int] = 1, raw_pe: cutlass.Constexpr[bool] = True,
               release_every: cutlass.Constexpr[int] = 1, raw_stages: cutlass.Constexpr[int] = RAW_STAGES,
               bt_ahead: cutlass.Constexpr[bool] = False):
    """The loader warpgroup of the narrow FP8 dense kernel (mla_decode_fp8_narrow_kernel.py): warp 0
    loads the CTA's Q tile [q_rows, 576] (row block m_block) and the pages' raw bytes (and, `raw_pe`, their
    k_pe) by TMA into the ring of `raw_stages` stages; all four warps dequantize page t into bf16 c_kv tile
    t % `tiles` (the tiles side by side from shared address kv_base) once the consumers freed it (kv_empty +
    tile), releasing it every `release_every` blocks on kv_full + tile * KV_BLOCKS + block // release_every,
    then free the raw stage. With one raw stage (k_pe not in it: `raw_pe` False), each thread first takes its
    share of the stage into registers (fp8_dequant.load_raw_page) and the stage is freed, and page t + 1's TMA
    issued, before the wait for the tile and the conversion: the page in flight lands while page t is
    converted. With `bt_ahead` (the narrow kernel) warp 0 reads each refill's block-table entry a page before
    the refill: read at the refill, its latency holds warp 0, and with it the page's conversion, every page
    (bench/NOTES.md 71)."""
    gRaw = cute.local_tile(mRaw_tma, (TILE_N, RAW_WORDS), (None, 0))     # [64, 132, pages]
    gPE = cute.local_tile(mPE_tma, (TILE_N, D_PE), (None, 0))           # [64, 64, pages]
    tRs, tRg = cpasync.tma_partition(tma_raw, 0, cute.make_layout(1), cute.group_modes(sRaw, 0, 2),
                                     cute.group_modes(gRaw, 0, 2))
    tPs, tPg = cpasync.tma_partition(tma_pe, 0, cute.make_layout(1), cute.group_modes(sPE, 0, 2),
                                     cute.group_modes(gPE, 0, 2))
    raw_p = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, raw_stages)
    if warp_idx == 0:
        gQ = cute.local_tile(mQ_tma[None, None, batch], (q_rows, D_QK), (m_block, 0))
        tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                         cute.group_modes(gQ, 0, 2))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        q_pipe.producer_acquire(q_state)
        cute.copy(tma_q, tQg, tQs, tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
    for t in cutlass.range(cutlass.min(n_tiles, raw_stages), unroll=1):
        if warp_idx == 0:
            _load_page(raw_pipe, raw_p, tma_raw, tRg, tRs, tma_pe, tPg, tPs, mBT[batch, first_page + t], raw_pe)
        raw_p.advance()

    regs = raw_stages == 1
    raw_c = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, raw_stages)
    next_page = Int32(0)
    if const_expr(bt_ahead):
        if warp_idx == 0 and raw_stages < n_tiles:
            next_page = mBT[batch, first_page + raw_stages]
    for t in cutlass.range(n_tiles, unroll=1):
        valid = seqlen - (start + t * TILE_N)      # rows of this page inside the request (may be > 64)
        later_page = Int32(0)
        if const_expr(bt_ahead):
            if warp_idx == 0 and t + 1 + raw_stages < n_tiles:
                later_page = mBT[batch, first_page + t + 1 + raw_stages]
        tile = t % tiles
        raw_pipe.consumer_wait(raw_c)
        if const_expr(regs):
            page = load_raw_page(tidx, raw_base + raw_c.index * (TILE_N * RAW_WORDS * 4))
        else:
            cute.arch.mbarrier_wait(kv_empty + tile, (t // tiles + 1) % 2)
            dequant_tile(tidx, raw_base + raw_c.index * (TILE_N * RAW_WORDS * 4),
                         kv_base + tile * (TILE_N * D_V * 2), kv_full + tile * KV_BLOCKS, valid, release_every)
        cute.arch.sync_warp()
        raw_pipe.consumer_release(raw_c)
        raw_c.advance()
        if warp_idx == 0:
            if t + raw_stages < n_tiles:
                if const_expr(not bt_ahead):
                    next_page = mBT[batch, first_page + t + raw_stages]
                _load_page(raw_pipe, raw_p, tma_raw, tRg, tRs, tma_pe, tPg, tPs, next_page, raw_pe)
        next_page = later_page
        raw_p.advance()
        if const_expr(regs):
            cute.arch.mbarrier_wait(kv_empty + tile, (t // tiles + 1) % 2)
            store_tile(tidx, page, kv_base + tile * (TILE_N * D_V * 2), kv_full + tile * KV_BLOCKS, valid,
                       release_every)


def store_halves(tidx: Int32, page, t: Int32, kv_base: Int32, kv_full: cute.Pointer, kv_empty: cute.Pointer,
                 valid: Int32):
    """The half ring's conversion of tile t from load_raw_page's registers: column half h into slot
    (2 t + h) % HALF_SLOTS (from shared address kv_base) once kv_empty + slot says its last reader is done, handed
    over on kv_full + slot (the FP8 sparse kernel's half ring, sparse_mla_fp8_kernel.py)."""
    for half in range(2):
        use = 2 * t + half
        slot = use % HALF_SLOTS
        cute.arch.mbarrier_wait(kv_empty + slot, (use // HALF_SLOTS + 1) % 2)
        store_half(tidx, page, half, kv_base + slot * HALF_SLOT_BYTES, kv_full + slot, valid)


@cute.jit
def load_pe(tma_pe: cute.CopyAtom, tPg: cute.Tensor, tPs: cute.Tensor, bar: cute.Pointer, page: Int32, lane: Int32,
            stage=0):
    """A page's k_pe [64, 64] bf16 by TMA into k_pe buffer `stage` of tPs, on `bar` (called by one whole warp): the
    narrow FP8 kernel's two tiles, whose k_pe does not travel in the raw stage."""
    if lane == 0:
        cute.arch.mbarrier_arrive_and_expect_tx(bar, PE_BYTES)
    cute.copy(tma_pe, tPg[None, page], tPs[None, stage], tma_bar_ptr=bar)


@cute.jit
def _load_page(raw_pipe, state, tma_raw: cute.CopyAtom, tRg: cute.Tensor, tRs: cute.Tensor,
               tma_pe: cute.CopyAtom, tPg: cute.Tensor, tPs: cute.Tensor, page: Int32,
               raw_pe: cutlass.Constexpr[bool]):
    """One page's e4m3 bytes + scales into raw stage state.index, on that stage's full barrier, and its k_pe
    there too (`raw_pe`) or into L2 (for the consumers' own load of it later)."""
    raw_pipe.producer_acquire(state)
    bar = raw_pipe.producer_get_barrier(state)
    cute.copy(tma_raw, tRg[None, page], tRs[None, state.index], tma_bar_ptr=bar)
    if const_expr(raw_pe):
        cute.copy(tma_pe, tPg[None, page], tPs[None, state.index], tma_bar_ptr=bar)
    else:
        cute.prefetch(tma_pe, tPg[None, page])


@cute.jit
def _qk_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, a_pe: cute.Tensor,
             b_pe: cute.Tensor, kv_full: cute.Pointer, phase: Int32, release_every: cutlass.Constexpr[int] = 1,
             pe_full: cute.Pointer = None, pe_phase: Int32 = None):
    """acc = A_pe B_pe + A B over the nope and rope parts (Q, K in whichever order the kernel puts them on
    wgmma's M and N) as one wgmma group, waited for. The c_kv k-steps on each group of `release_every`
    64-column blocks are issued once the loader's kv_full[group] completes its phase `phase`. k_pe's k-steps
    come first where k_pe sits in the raw stage already; with `pe_full`, last, once its own TMA completed
    (pe_full's phase `pe_phase`), which then has the c_kv k-steps' time to land."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, False)
    if const_expr(pe_full is None):
        for k in cutlass.range_constexpr(cute.size(a_pe.shape[2])):
            cute.gemm(atom, acc, a_pe[None, None, k], b_pe[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
    steps = cute.size(a.shape[2])
    group = steps // KV_BLOCKS * release_every
    for k in cutlass.range_constexpr(steps):
        if const_expr(k % group == 0):
            cute.arch.mbarrier_wait(kv_full + k // group, phase)
        cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    if const_expr(pe_full is not None):
        cute.arch.mbarrier_wait(pe_full, pe_phase)
        for k in cutlass.range_constexpr(cute.size(a_pe.shape[2])):
            cute.gemm(atom, acc, a_pe[None, None, k], b_pe[None, None, k], acc)
    warpgroup.commit_group()
    warpgroup.wait_group(0)


@cute.jit
def pv_and_release(tiled_mma: cute.TiledMma, acc_o: cute.Tensor, tOrP: cute.Tensor, tOrV: cute.Tensor,
                   kv_empty: cute.Pointer, t: Int32, cw: Int32, n_tiles: Int32, half_ring: cutlass.Constexpr[bool],
                   one_barrier: cutlass.Constexpr[bool]):
    """The split consumer pair's O_w += P V_w of tile t (the FP8 sparse kernel, sparse_mla_fp8_kernel.py), waited
    for, then what it read is freed: on the half ring, slot (2 t + cw) % HALF_SLOTS, tile t's column half cw (the
    other consumer's S of tile t, the slot's other reader, came before P was complete), else the whole tile
    (kv_empty); with `one_barrier`, P too, for the other consumer's next store (split_consumers.one_barrier_p),
    unless t is the last tile."""
    if const_expr(half_ring):
        slot = (2 * t + cw) % HALF_SLOTS
        _pv_gemm(tiled_mma, acc_o, tOrP, tOrV[None, None, None, slot])
        cute.arch.mbarrier_arrive(kv_empty + slot)
    else:
        _pv_gemm(tiled_mma, acc_o, tOrP, tOrV)
        cute.arch.mbarrier_arrive(kv_empty)
    if const_expr(one_barrier):
        if t + 1 < n_tiles:
            arrive_p_free(cw)


@cute.jit
def _pv_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tOrP: cute.Tensor, tOrV: cute.Tensor):
    """acc += P V over the tile's keys as one wgmma group, waited for (the bf16 tile is released next)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, True)
    for k in cutlass.range_constexpr(cute.size(tOrP.shape[2])):
        cute.gemm(atom, acc, tOrP[None, None, k], tOrV[None, None, k], acc)
    warpgroup.commit_group()
    warpgroup.wait_group(0)
