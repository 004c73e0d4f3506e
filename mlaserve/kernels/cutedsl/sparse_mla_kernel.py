"""The Hopper (sm_90a) sparse MLA (DSA) kernel in CuTe DSL: one CTA = 64 heads of one query token x one
split of that token's top-k.

Imported only where `nvidia-cutlass-dsl` is installed (sparse_mla.py loads it on first launch). The math
is mla_decode_kernel.py's (the committed version measured on the H200) over gathered rows instead of
pages: every query token has its own index row, so tokens never share a KV tile and the 64 rows of a CTA
are 64 heads of one token (h < 64: TMA zero-fills the missing head rows; h 128: two CTAs per token,
adjacent in the grid so the second finds the gathered rows in L2).

Warp roles (384 threads, three warpgroups):
- WG 0, the producer (setmaxnreg 40): warp 0 loads the Q tile once (TMA, [64, 576]); then all 128
  threads gather each tile's 64 cache rows into a 2-stage ring with cp.async, 16-byte chunks, 72 per
  1152-byte row. Thread p owns rows p // 8 + 16 i (i < 4) and chunks p % 8 + 8 j (j < 9): a warp reads 4
  rows x 128 contiguous bytes per instruction and writes 8 distinct 16-byte bank groups per row. The
  destination is the same K-major 128-byte-swizzled layout a TMA load writes (the dense kernel's
  consumers read it unchanged). A row whose index is -1, or past the split's end, is zero-filled by the
  copy itself (cp.async src-size 0): never read, and 0 * P keeps a NaN in an unused slot out of O.
  Completion: each producer thread ends a stage with cp.async.mbarrier.arrive.noinc on the stage's full
  barrier (initialized to 128 arrivals). Chosen over consumers waiting on cp.async groups because only
  the issuing thread can wait on a group: the producer would have to wait for stage t's bytes before
  signalling, which serializes its next gather behind the consumers' release. With the mbarrier the
  copies land asynchronously and the consumers wake when the last 16 bytes are in.
  cp.async writes are generic-proxy writes and wgmma reads through the async proxy, so each consumer
  issues fence.proxy.async after its full-barrier wait, before its first wgmma on the stage.
- WG 1 and WG 2, the consumers (setmaxnreg 232), split every tile's work in halves, as in the dense kernel:
    S_w = Q K_w^T     keys 32w .. 32w+32 of the tile       wgmma m64n32k16, 36 k-steps
    row maxima exchanged through smem (named barrier); both then hold the same running max
    P_w = exp2(S_w - m) -> smem as columns 32w .. 32w+32 of P [64, 64] (16-bit)
    O_w += P V_w      V_w = the tile's c_kv columns 256w .. 256w+256, read as MN-major B
                                                          wgmma m64n256k16, 4 k-steps
  Masking: a key whose index is -1 (or past the split's end) scores -inf. The indices are read by the
  consumers from global memory (L1/L2: the producer just read the same words) before their full-barrier
  wait, so the load latency hides behind the wait. Every head row of a CTA shares one index row, so the
  mask depends on the key only.

Synchronisation inside one tile (both consumers): wait full[stage], fence.proxy.async -> S -> write maxima
-> BAR_MAX -> read maxima, P -> write P -> fence.proxy.async -> BAR_P -> O += P V (waited) -> release
empty[stage] (one lane per warp). One buffer each of maxima and P suffices (the dense kernel's argument).

What every sparse kernel does alike is here as module functions, which the seesaw kernel
(sparse_mla_seesaw_kernel.py, a subclass that also reuses `__call__`, `_smem` and `_gather`) and the FP8
kernel (sparse_mla_fp8_kernel.py) call: the host setup and grid, the CTA's coordinates and split range, the
Q load and wait, the gather's row slots and 16-byte copies, the consumers' wait for a gathered stage and
their softmax rows. All are traced inline: factoring them out of the three kernels left the SASS of all ten
specializations instruction for instruction the same (sm_90a).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync, warpgroup

from mlaserve.kernels.cutedsl.common import register_split_fits
from mlaserve.kernels.cutedsl.seesaw_consumers import issue_mma, v_view
from mlaserve.kernels.cutedsl.split_consumers import (
    CONSUMER_THREADS, finish_rows, key_of, publish_p, rescale_to_tile_max, scale_rows, sparse_key_bias,
    split_tiled_mmas, store_sparse)

TILE_M = 64          # heads per CTA: one wgmma M
TILE_N = 64          # gathered cache rows per stage
D_QK = 576
D_V = 512
HALF_N = TILE_N // 2  # keys of S per consumer
HALF_V = D_V // 2     # columns of O per consumer
NUM_STAGES = 2
PRODUCER_REGS = 40    # address math for 36 copies per tile; 40 + 2 * 232 per 128 threads fits 64K registers
CONSUMER_REGS = 232
THREADS = 3 * 128
PRODUCER_THREADS = 128
assert register_split_fits((PRODUCER_THREADS, PRODUCER_REGS), (THREADS - PRODUCER_THREADS, CONSUMER_REGS))

CHUNK = 8                                  # 16-bit values per 16-byte cp.async
CHUNKS_PER_ROW = D_QK // CHUNK             # 72
ROWS_PER_PASS = PRODUCER_THREADS // 8      # 16: 8 threads per row, one 128-byte swizzle row each pass
ROW_PASSES = TILE_N // ROWS_PER_PASS       # 4
COL_PASSES = CHUNKS_PER_ROW // 8           # 9: one per 64-column swizzle atom
# Elements of the 128-byte-swizzled K-major ring: an atom is 8 rows x 64 values (1024 bytes), atoms
# tiled down the 64 rows first (8 atoms = one 64-column block), then along the 9 column blocks, then stages.
ATOM_BLOCK = TILE_N * 64                   # values per 64-column block of a stage
STAGE_ELEMS = TILE_N * D_QK


class SparseMLASm90:
    """Compiled per (dtype, split). Launched by sparse_mla.py through `__call__` (a cute.jit host function)."""

    ROW_MAX_COLS = 2      # sMax [64, 2]: each consumer's row maxima of the tile

    def __init__(self, dtype, is_split: bool, store16: bool = False):
        self.dtype = dtype
        self.is_split = is_split
        self.store16 = store16    # blocks of 64 heads (out or split partials) stored 16 bytes at a time

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, out_ptr: cute.Pointer,
                 lse_ptr: cute.Pointer, po_ptr: cute.Pointer, pl_ptr: cute.Pointer,
                 tokens: Int32, h: Int32, num_slots: Int32, topk: Int32, num_splits: Int32, split_len: Int32,
                 scale_log2: Float32, stream):
        """q [tokens, h, 576]; kv [num_slots, 576]; idx int32 [tokens, topk]; out [tokens, h, 512] (q's dtype),
        lse fp32 [tokens, h]; partials (split only) fp32 [num_splits, tokens, h, 512] and [num_splits, tokens, h]
        (the layout of the Triton `_combine_splits_kernel`). Split s covers indices [s * split_len, + split_len).
        Subclasses that keep this smem and grid change `_tiled_mmas` and ROW_MAX_COLS only."""
        mKV = cute.make_tensor(kv_ptr, cute.make_layout((num_slots, D_QK), stride=(D_QK, 1)))
        (mIdx, mOut, mLse, mPO, mPL), (atom, sQ_layout, sP_layout), (tma_q, mQ_tma), (m_blocks, grid) = \
            sparse_host_setup(self.dtype, q_ptr, idx_ptr, out_ptr, lse_ptr, po_ptr, pl_ptr, tokens, h, topk,
                              num_splits)
        sKV_layout = cute.tile_to_shape(atom, (TILE_N, D_QK, NUM_STAGES), order=(0, 1, 2))

        @cute.struct
        class SharedStorage:
            kv_mbar: cute.struct.MemRange[cutlass.Int64, NUM_STAGES * 2]
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            row_max: cute.struct.MemRange[Float32, TILE_M * self.ROW_MAX_COLS]
            row_sum: cute.struct.MemRange[Float32, TILE_M * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(tma_q, mQ_tma, mKV, mIdx, mOut, mLse, mPO, mPL, h, topk, m_blocks, split_len, scale_log2,
                    sQ_layout, sKV_layout, sP_layout, *self._tiled_mmas()).launch(
            grid=grid, block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    def _tiled_mmas(self) -> tuple:
        """The MMAs `kernel` takes after the smem layouts: S_w = Q K_w^T at m64n32, O_w += P V_w at m64n256."""
        return split_tiled_mmas(self.dtype)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ_tma: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor,
               mOut: cute.Tensor, mLse: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, h: Int32, topk: Int32,
               m_blocks: Int32, split_len: Int32, scale_log2: Float32, sQ_layout: cute.ComposedLayout,
               sKV_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma,
               tiled_mma_pv: cute.TiledMma):
        tidx, warp_idx, wg, m_block, token, split = cta_coords(tma_q, m_blocks)
        storage, kv_pipe, q_pipe, sQ, sKV, sP = self._smem(sQ_layout, sKV_layout, sP_layout)
        sMax = storage.row_max.get_tensor(cute.make_layout((TILE_M, 2)))
        sSum = storage.row_sum.get_tensor(cute.make_layout((TILE_M, 2)))
        start, end, n_tiles = split_range(split, split_len, topk)

        if wg == 0:
            # ---------------- producer ----------------
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            load_q(warp_idx, tma_q, mQ_tma, sQ, q_pipe, token, m_block)
            self._gather(tidx, token, start, end, n_tiles, mKV, mIdx, storage.sKV.data_ptr(), kv_pipe)
        else:
            # ---------------- consumers ----------------
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            cw = wg - 1                  # which half: keys 32cw.. of S, columns 256cw.. of O
            ctid = tidx % 128
            thr_qk = tiled_mma_qk.get_slice(ctid)
            thr_pv = tiled_mma_pv.get_slice(ctid)
            sK_w = cute.local_tile(sKV, (HALF_N, D_QK, NUM_STAGES), (cw, 0, 0))
            sVt = v_view(sKV)                                                         # [512, 64, stages]
            sVt_w = cute.local_tile(sVt, (HALF_V, TILE_N, NUM_STAGES), (cw, 0, 0))  # [256, 64, stages]
            sP_w = cute.local_tile(sP, (TILE_M, HALF_N), (0, cw))
            tSrQ = tiled_mma_qk.make_fragment_A(thr_qk.partition_A(sQ))
            tSrK = tiled_mma_qk.make_fragment_B(thr_qk.partition_B(sK_w))
            tOrP = tiled_mma_pv.make_fragment_A(thr_pv.partition_A(sP))
            tOrV = tiled_mma_pv.make_fragment_B(thr_pv.partition_B(sVt_w))
            tPsP = thr_qk.partition_C(sP_w)
            acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE_M, HALF_N)), Float32)
            acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((TILE_M, HALF_V)), Float32)
            acc_o.fill(0.0)
            tScS = thr_qk.partition_C(cute.make_identity_tensor((TILE_M, HALF_N)))
            tOcO = thr_pv.partition_C(cute.make_identity_tensor((TILE_M, HALF_V)))
            rP = cute.make_fragment_like(acc_s, self.dtype)
            n_vals = cute.size(acc_s)
            bias = cute.make_rmem_tensor(n_vals // 2, Float32)   # 0 or -inf per distinct key (key_of) of this thread
            r0, row_m, row_l = consumer_rows(ctid)
            alpha = cute.make_rmem_tensor(2, Float32)
            m_base = cute.make_rmem_tensor(2, Float32)

            wait_q(q_pipe)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, NUM_STAGES)
            for t in cutlass.range(n_tiles, unroll=1):
                stage = kv_state.index
                # -- this half's keys: -inf where the index is -1 or past the split (read before the wait) --
                sparse_key_bias(bias, tScS, start + t * TILE_N + cw * HALF_N, end, mIdx, token)
                wait_gathered(kv_pipe, kv_state)
                # -- S_w = Q K_w^T --
                _gemm(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, stage], True)
                for i in cutlass.range_constexpr(n_vals):
                    acc_s[i] = acc_s[i] * scale_log2 + bias[key_of(i)]
                rescale_to_tile_max(acc_s, row_m, row_l, alpha, m_base, sMax, r0, cw, ctid)
                publish_p(acc_s, m_base, row_l, rP, tPsP)
                # -- O_w = alpha O_w + P V_w --
                scale_rows(acc_o, alpha)
                _gemm(tiled_mma_pv, acc_o, tOrP, tOrV[None, None, None, stage], False)
                # the wgmma wait above is warp-wide: one lane per warp may free the stage
                if cute.arch.lane_idx() == 0:
                    kv_pipe.consumer_release(kv_state)
                kv_state.advance()

            # -- epilogue: whole row sums (quad, then both consumers), normalize, store --
            inv_l = cute.make_rmem_tensor(2, Float32)
            lse = cute.make_rmem_tensor(2, Float32)
            finish_rows(row_m, row_l, sSum, r0, cw, ctid, inv_l, lse)
            store_sparse(acc_o, inv_l, lse, tOcO, r0, cw, ctid, m_block * TILE_M, h, token, split, mOut, mLse,
                         mPO, mPL, self.is_split, self.store16)

    def _smem(self, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
              sP_layout: cute.ComposedLayout):
        """The CTA's shared storage, its two pipelines and buffers, traced inline:
        (storage, kv_pipe, q_pipe, sQ [64, 576], sKV [64, 576, stages], sP [64, 64])."""
        storage = utils.SmemAllocator().allocate(self.shared_storage)
        # full: 128 producer threads, each one cp.async.mbarrier.arrive.noinc per stage;
        # empty: one lane of each of the 8 consumer warps
        kv_pipe = pipeline.PipelineCpAsync.create(
            barrier_storage=storage.kv_mbar.data_ptr(), num_stages=NUM_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, PRODUCER_THREADS),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_THREADS // 32))
        q_pipe = make_q_pipe(storage, self.dtype)
        return (storage, kv_pipe, q_pipe,
                storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
                storage.sKV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner),
                storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner))

    @cute.jit
    def _gather(self, tidx: Int32, token: Int32, start: Int32, end: Int32, n_tiles: Int32, mKV: cute.Tensor,
                mIdx: cute.Tensor, s_base: cute.Pointer, kv_pipe: pipeline.PipelineCpAsync):
        """The producer warpgroup's loop: per tile, 64 cache rows [64, 576] into ring stage t % 2 by cp.async.

        Thread p copies chunks p % 8 + 8 j of rows p // 8 + 16 i. In the 128-byte swizzle, chunk c of row r
        of a stage sits at byte (c // 8) * 8192 + r * 128 + ((c % 8) ^ (r % 8)) * 16 (atoms of 8 rows x 128
        bytes, 1024-byte aligned, stacked down the rows first) — the layout TMA writes for sKV_layout.
        """
        prow = tidx // 8
        pchunk = tidx % 8
        # values from the row start to this thread's chunk in every swizzle atom it writes (r % 8 = prow % 8)
        swz = (pchunk ^ (prow % 8)) * CHUNK
        kv_base = mKV.iterator
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, NUM_STAGES)
        for t in cutlass.range(n_tiles, unroll=1):
            slots = row_slots(mIdx, token, start + t * TILE_N + prow, end)
            kv_pipe.producer_acquire(state)
            stage_base = s_base + state.index * STAGE_ELEMS
            for i in cutlass.range_constexpr(ROW_PASSES):
                r = prow + ROWS_PER_PASS * i
                nbytes, row_off = slot_source(slots[i], D_QK)
                for j in cutlass.range_constexpr(COL_PASSES):
                    dst = stage_base + (j * ATOM_BLOCK + r * 64 + swz)
                    cp16(dst, kv_base + (row_off + (j * 64 + pchunk * CHUNK)), nbytes)
            # fires once this thread's copies so far have landed (the barrier counts 128 such arrivals)
            kv_pipe.producer_commit(state)
            state.advance()
        drain_copies()


# -------- what every sparse kernel does alike (host setup, CTA prelude, Q, the gather, softmax rows) --------

def sparse_host_setup(dtype, q_ptr: cute.Pointer, idx_ptr: cute.Pointer, out_ptr: cute.Pointer,
                      lse_ptr: cute.Pointer, po_ptr: cute.Pointer, pl_ptr: cute.Pointer, tokens: Int32, h: Int32,
                      topk: Int32, num_splits: Int32):
    """The sparse kernels' common host side (tensor shapes in SparseMLASm90.__call__), traced inline:
    (mIdx, mOut, mLse, mPO, mPL), (atom, sQ_layout, sP_layout) with Q [64, 576] and P [64, 64] K-major in the
    128-byte swizzle (64 16-bit values per row) and their atom, (tma_q, mQ_tma), and (m_blocks, grid)."""
    mQ = cute.make_tensor(q_ptr, cute.make_layout((h, D_QK, tokens), stride=(D_QK, 1, h * D_QK)))
    mIdx = cute.make_tensor(idx_ptr, cute.make_layout((tokens, topk), stride=(topk, 1)))
    mOut = cute.make_tensor(out_ptr, cute.make_layout((tokens, h, D_V), stride=(h * D_V, D_V, 1)))
    mLse = cute.make_tensor(lse_ptr, cute.make_layout((tokens, h), stride=(h, 1)))
    mPO = cute.make_tensor(po_ptr, cute.make_layout((num_splits, tokens, h, D_V),
                                                    stride=(tokens * h * D_V, h * D_V, D_V, 1)))
    mPL = cute.make_tensor(pl_ptr, cute.make_layout((num_splits, tokens, h), stride=(tokens * h, h, 1)))
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, dtype, D_QK), dtype)
    sQ_layout = cute.tile_to_shape(atom, (TILE_M, D_QK), order=(0, 1))
    sP_layout = cute.tile_to_shape(atom, (TILE_M, TILE_N), order=(0, 1))
    # Q rows past h (h < 64) lie outside the tensor: TMA fills them with zeros
    tma_q, mQ_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mQ, sQ_layout, (TILE_M, D_QK))
    m_blocks = (h + TILE_M - 1) // TILE_M
    # head blocks of one token adjacent on x: the second CTA's gather hits the rows the first pulled into L2
    grid = (m_blocks * tokens, num_splits, 1)
    return (mIdx, mOut, mLse, mPO, mPL), (atom, sQ_layout, sP_layout), (tma_q, mQ_tma), (m_blocks, grid)


@cute.jit
def cta_coords(tma_q: cute.CopyAtom, m_blocks: Int32):
    """This thread and CTA in the sparse grid -> (tidx, warp_idx, wg (its warpgroup), m_block (head block),
    token, split); warp 0 prefetches Q's TMA descriptor."""
    tidx, _, _ = cute.arch.thread_idx()
    bx, split, _ = cute.arch.block_idx()
    m_block = bx % m_blocks
    token = bx // m_blocks
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    wg = cute.arch.make_warp_uniform(tidx // 128)
    if warp_idx == 0:
        cpasync.prefetch_descriptor(tma_q)
    return tidx, warp_idx, wg, m_block, token, split


def make_q_pipe(storage, dtype) -> pipeline.PipelineTmaAsync:
    """Q's one-stage TMA pipeline on storage.q_mbar: warp 0 loads the tile (load_q), the consumers wait (wait_q)."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=storage.q_mbar.data_ptr(), num_stages=1,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_THREADS // 32),
        tx_count=TILE_M * D_QK * dtype.width // 8)


def split_range(split: Int32, split_len: Int32, topk: Int32):
    """This split's indices [start, end) of the token's top-k and its tile count, whole 64-row tiles but the
    last (0 past the end) -> (start, end, n_tiles)."""
    start = split * split_len
    end = cutlass.min(start + split_len, topk)
    return start, end, cutlass.max((end - start + TILE_N - 1) // TILE_N, 0)


@cute.jit
def load_q(warp_idx: Int32, tma_q: cute.CopyAtom, mQ_tma: cute.Tensor, sQ: cute.Tensor,
           q_pipe: pipeline.PipelineTmaAsync, token: Int32, m_block: Int32):
    """Warp 0 of the producer: heads 64 m_block.. of `token` into sQ [64, 576], one TMA on q_pipe."""
    if warp_idx == 0:
        gQ = cute.local_tile(mQ_tma[None, None, token], (TILE_M, D_QK), (m_block, 0))
        tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                         cute.group_modes(gQ, 0, 2))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        q_pipe.producer_acquire(q_state)
        cute.copy(tma_q, tQg, tQs, tma_bar_ptr=q_pipe.producer_get_barrier(q_state))


@cute.jit
def wait_q(q_pipe: pipeline.PipelineTmaAsync):
    """A consumer thread: wait until load_q's tile has landed."""
    q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
    q_pipe.consumer_wait(q_state)


@cute.jit
def row_slots(mIdx: cute.Tensor, token: Int32, pos: Int32, end: Int32) -> cute.Tensor:
    """The cache slots of a producer thread's rows of one tile: indices pos + 16 i (i < 4) of the token, -1
    past the split's end -> int32 [4] in registers."""
    slots = cute.make_rmem_tensor(ROW_PASSES, Int32)
    for i in cutlass.range_constexpr(ROW_PASSES):
        slots[i] = -1
        if pos + ROWS_PER_PASS * i < end:
            slots[i] = mIdx[token, pos + ROWS_PER_PASS * i]
    return slots


@cute.jit
def slot_source(slot: Int32, row_elems: cutlass.Constexpr[int]):
    """What a gathered row's copies read: (bytes per chunk, the row's offset in the cache in its elements).
    A -1 row reads 0 bytes, so the copies fill its chunks with zeros; the address is the cache's first row."""
    nbytes = Int32(0)
    row_off = Int64(0)
    if slot >= 0:
        nbytes = Int32(16)
        row_off = Int64(slot) * row_elems
    return nbytes, row_off


@cute.jit
def cp16(dst: cute.Pointer, src: cute.Pointer, nbytes: Int32):
    """16 bytes global -> shared by cp.async (L2 only); nbytes 0 writes 16 zero bytes instead."""
    nvvm.cp_async_shared_global(dst.llvm_ptr, src.llvm_ptr, 16, nvvm.LoadCacheModifierKind.CG,
                                cp_size=nbytes.ir_value())


@cute.jit
def drain_copies():
    """After a thread's last gather: no thread exits with copies (and their mbarrier arrivals) in flight."""
    cute.arch.cp_async_commit_group()
    cute.arch.cp_async_wait_group(0)


@cute.jit
def wait_gathered(pipe: pipeline.PipelineCpAsync, state: pipeline.PipelineState):
    """A consumer thread: wait for a stage the gather filled, then fence.proxy.async: cp.async wrote it
    through the generic proxy and wgmma reads it through the async proxy."""
    pipe.consumer_wait(state)
    cute.arch.fence_proxy("async.shared", space="cta")


@cute.jit
def consumer_rows(ctid: Int32):
    """A consumer thread's softmax rows -> (r0, row_m, row_l). A wgmma m64 accumulator gives each thread two
    rows, r0 and r0 + 8 (value index i: bit 1 picks the row), shared with the three other lanes of its quad;
    row_m [2] is their running max (log2 units, -inf), row_l [2] this thread's part of their sums (0)."""
    r0 = (ctid // 32) * 16 + (ctid % 32) // 4
    row_m = cute.make_rmem_tensor(2, Float32)
    row_l = cute.make_rmem_tensor(2, Float32)
    for hr in cutlass.range_constexpr(2):
        row_m[hr] = -Float32.inf
        row_l[hr] = 0.0
    return r0, row_m, row_l


@cute.jit
def _gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
          zero_init: cutlass.Constexpr[bool]):
    """acc (+)= A B over all k-blocks as one wgmma group, waited for (the operands' smem is reused next)."""
    issue_mma(tiled_mma, acc, tCrA, tCrB, zero_init)
    warpgroup.wait_group(0)
