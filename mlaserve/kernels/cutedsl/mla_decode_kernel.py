"""The Hopper (sm_90a) MLA decode kernel in CuTe DSL: one CTA = 64 query rows x one KV split of one request.

Imported only where `nvidia-cutlass-dsl` is installed (mla_decode.py loads it on first launch).

Warp roles (384 threads, three warpgroups):
- WG 0, the producer (setmaxnreg 24): warp 0 loads the CTA's Q tile once (TMA, [64, 576]) and then
  one 64-token page per stage into a 2-stage smem ring (TMA, [64, 576] per page, page id read from
  the block table); the other three warps idle out.
- WG 1 and WG 2, the consumers (setmaxnreg 240), split every tile's work in halves, so that
  neither computes anything the other also computes (Triton's kernel gives both warpgroups the
  whole QK):
    S_w = Q K_w^T     keys 32w .. 32w+32 of the page       wgmma m64n32k16, 36 k-steps
    row maxima exchanged through smem (named barrier); both then hold the same running max
    P_w = exp2(S_w - m) -> smem as columns 32w .. 32w+32 of P [64, 64] (16-bit)
    O_w += P V_w      V_w = the page's c_kv columns 256w .. 256w+256, read as MN-major B
                                                          wgmma m64n256k16, 4 k-steps
  Each consumer keeps its half of the row sums; they are added at the end.

The rows of a CTA are `m_block * 64 + r` of the request's s_q * h query rows (row = token j * h + head).
Keys each row may see: causal, new token j sees 0 .. seqlen - s_q + j. Only tiles that reach past the
smallest visible length are masked, and the cache rows past the request's end in its last page are
zeroed in smem before P V (a masked P of 0 times a NaN left in an unused slot would still be NaN).

Synchronisation inside one tile (both consumers): wait full[stage] -> S -> write maxima -> BAR_MAX ->
read maxima, P -> write P (and zero tail rows of V) -> fence.proxy.async -> BAR_P -> O += P V (waited)
-> release empty[stage]. A consumer writes the maxima of tile t+1 only after passing BAR_P of tile t
(so the other has read tile t's), and writes P of tile t+1 only after BAR_MAX of t+1, which the other
reaches only once its P V of tile t has completed: one buffer of each is enough.
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

TILE_M = 64          # query rows per CTA: one wgmma M
TILE_N = 64          # cached tokens per stage: one page
D_QK = 576
D_V = 512
HALF_N = TILE_N // 2  # keys of S per consumer
HALF_V = D_V // 2     # columns of O per consumer
NUM_STAGES = 2
PRODUCER_REGS = 24
CONSUMER_REGS = 240
THREADS = 3 * 128
BAR_MAX = 1           # named barriers (0 is __syncthreads)
BAR_P = 2
CONSUMER_THREADS = 256


def _v_view(s_kv: cute.Tensor) -> cute.Tensor:
    """The KV ring [64 keys, 576, stages] seen as V^T [512, 64 keys, stages] without moving data (MN-major B).

    Composition maps (column, key, stage) to the ring's own (key, column, stage) coordinates; the stage
    stride is the ring's 64 * 576, not 512 * 64.
    """
    return cute.composition(s_kv, cute.make_layout((D_V, TILE_N, NUM_STAGES), stride=(TILE_N, 1, TILE_N * D_QK)))


class MLADecodeSm90:
    """Compiled per (dtype, causal, split). Launched by mla_decode.py through `__call__` (a cute.jit host function)."""

    def __init__(self, dtype, causal: bool, is_split: bool):
        self.dtype = dtype
        self.causal = causal
        self.is_split = is_split

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, kv_ptr: cute.Pointer, bt_ptr: cute.Pointer, seqlens_ptr: cute.Pointer,
                 out_ptr: cute.Pointer, lse_ptr: cute.Pointer, po_ptr: cute.Pointer, pl_ptr: cute.Pointer,
                 batch: Int32, s_q: Int32, h: Int32, num_pages: Int32, max_pages: Int32, num_splits: Int32,
                 scale_log2: Float32, stream):
        """q [b, s_q * h, 576]; kv [num_pages * 64, 576]; bt int32 [b, max_pages]; seqlens int32 [b];
        out [b, s_q * h, 512] (q's dtype), lse fp32 [b, s_q * h]; partials (split only) fp32
        [b, num_splits, s_q * h, 512] and [b, num_splits, s_q * h]."""
        rows = s_q * h
        mQ = cute.make_tensor(q_ptr, cute.make_layout((rows, D_QK, batch), stride=(D_QK, 1, rows * D_QK)))
        mKV = cute.make_tensor(kv_ptr, cute.make_layout((num_pages * TILE_N, D_QK), stride=(D_QK, 1)))
        mBT = cute.make_tensor(bt_ptr, cute.make_layout((batch, max_pages), stride=(max_pages, 1)))
        mSeqlens = cute.make_tensor(seqlens_ptr, cute.make_layout(batch))
        mOut = cute.make_tensor(out_ptr, cute.make_layout((batch, rows, D_V), stride=(rows * D_V, D_V, 1)))
        mLse = cute.make_tensor(lse_ptr, cute.make_layout((batch, rows), stride=(rows, 1)))
        mPO = cute.make_tensor(po_ptr, cute.make_layout((batch, num_splits, rows, D_V),
                                                        stride=(num_splits * rows * D_V, rows * D_V, D_V, 1)))
        mPL = cute.make_tensor(pl_ptr, cute.make_layout((batch, num_splits, rows),
                                                        stride=(num_splits * rows, rows, 1)))

        # -- smem layouts: every operand K-major with the 128-byte swizzle (64 16-bit values per row) --
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, self.dtype, D_QK), self.dtype)
        sQ_layout = cute.tile_to_shape(atom, (TILE_M, D_QK), order=(0, 1))
        sKV_layout = cute.tile_to_shape(atom, (TILE_N, D_QK, NUM_STAGES), order=(0, 1, 2))
        sP_layout = cute.tile_to_shape(atom, (TILE_M, TILE_N), order=(0, 1))

        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(tma_op, mQ, sQ_layout, (TILE_M, D_QK))
        tma_kv, mKV_tma = cpasync.make_tiled_tma_atom(
            tma_op, mKV, cute.slice_(sKV_layout, (None, None, 0)), (TILE_N, D_QK))

        # S: one warpgroup, M 64 x N 32 (its half of the keys); O: one warpgroup, M 64 x N 256 (its half of V)
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, (1, 1, 1), (TILE_M, HALF_N))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (1, 1, 1), (TILE_M, HALF_V))

        @cute.struct
        class SharedStorage:
            kv_mbar: cute.struct.MemRange[cutlass.Int64, NUM_STAGES * 2]
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            row_max: cute.struct.MemRange[Float32, TILE_M * 2]
            row_sum: cute.struct.MemRange[Float32, TILE_M * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]

        self.shared_storage = SharedStorage
        grid = (cute.ceil_div(rows, TILE_M), num_splits, batch)
        self.kernel(tma_q, mQ_tma, tma_kv, mKV_tma, mBT, mSeqlens, mOut, mLse, mPO, mPL,
                    s_q, h, rows, num_splits, scale_log2, sQ_layout, sKV_layout, sP_layout,
                    tiled_mma_qk, tiled_mma_pv).launch(
            grid=grid, block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ_tma: cute.Tensor, tma_kv: cute.CopyAtom, mKV_tma: cute.Tensor,
               mBT: cute.Tensor, mSeqlens: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor,
               mPO: cute.Tensor, mPL: cute.Tensor, s_q: Int32, h: Int32, rows: Int32, num_splits: Int32,
               scale_log2: Float32, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, split, batch = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // 128)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_kv)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # 8 consumer warps each arrive once on a stage's empty barrier (one elected lane per warp)
        kv_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.kv_mbar.data_ptr(), num_stages=NUM_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_THREADS // 32),
            tx_count=TILE_N * D_QK * self.dtype.width // 8)
        q_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.q_mbar.data_ptr(), num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_THREADS // 32),
            tx_count=TILE_M * D_QK * self.dtype.width // 8)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sKV = storage.sKV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sMax = storage.row_max.get_tensor(cute.make_layout((TILE_M, 2)))
        sSum = storage.row_sum.get_tensor(cute.make_layout((TILE_M, 2)))

        # -- this split's tokens: the request's length cut into num_splits runs of whole pages --
        seqlen = mSeqlens[batch]
        split_len = ((seqlen + num_splits - 1) // num_splits + TILE_N - 1) // TILE_N * TILE_N
        start = split * split_len
        end = cutlass.min(start + split_len, seqlen)
        n_tiles = cutlass.max((end - start + TILE_N - 1) // TILE_N, 0)

        if wg == 0:
            # ---------------- producer ----------------
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                gQ = cute.local_tile(mQ_tma[None, None, batch], (TILE_M, D_QK), (m_block, 0))
                tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                                 cute.group_modes(gQ, 0, 2))
                gKV = cute.local_tile(mKV_tma, (TILE_N, D_QK), (None, 0))      # [64, 576, pages]
                tKVs, tKVg = cpasync.tma_partition(tma_kv, 0, cute.make_layout(1), cute.group_modes(sKV, 0, 2),
                                                   cute.group_modes(gKV, 0, 2))
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                q_pipe.producer_acquire(q_state)
                cute.copy(tma_q, tQg, tQs, tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, NUM_STAGES)
                first_page = start // TILE_N
                for t in cutlass.range(n_tiles, unroll=1):
                    page = mBT[batch, first_page + t]
                    kv_pipe.producer_acquire(kv_state)
                    cute.copy(tma_kv, tKVg[None, page], tKVs[None, kv_state.index],
                              tma_bar_ptr=kv_pipe.producer_get_barrier(kv_state))
                    kv_state.advance()
        else:
            # ---------------- consumers ----------------
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            cw = wg - 1                  # which half: keys 32cw.. of S, columns 256cw.. of O
            ctid = tidx % 128
            thr_qk = tiled_mma_qk.get_slice(ctid)
            thr_pv = tiled_mma_pv.get_slice(ctid)
            sK_w = cute.local_tile(sKV, (HALF_N, D_QK, NUM_STAGES), (cw, 0, 0))
            sVt = _v_view(sKV)                                                         # [512, 64, stages]
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

            # A wgmma m64 accumulator gives each thread two rows, r0 and r0 + 8 (value index i: bit 1 picks
            # the row), shared with the three other lanes of its quad.
            r0 = (ctid // 32) * 16 + (ctid % 32) // 4
            vis = cute.make_rmem_tensor(2, Int32)      # keys visible to each of the thread's rows
            row_m = cute.make_rmem_tensor(2, Float32)  # running max (log2 units)
            row_l = cute.make_rmem_tensor(2, Float32)  # this thread's part of the running sum
            for hr in cutlass.range_constexpr(2):
                r_glob = m_block * TILE_M + r0 + 8 * hr
                v = seqlen
                if const_expr(self.causal):
                    v = seqlen - s_q + 1 + r_glob // h
                vis[hr] = cutlass.min(v, seqlen)
                row_m[hr] = -Float32.inf
                row_l[hr] = 0.0
            min_vis = seqlen
            if const_expr(self.causal):
                min_vis = cutlass.max(seqlen - s_q + 1, 0)

            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            q_pipe.consumer_wait(q_state)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, NUM_STAGES)
            for t in cutlass.range(n_tiles, unroll=1):
                tok0 = start + t * TILE_N
                stage = kv_state.index
                kv_pipe.consumer_wait(kv_state)
                # -- S_w = Q K_w^T --
                _gemm(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, stage], True)
                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    acc_s[i] = acc_s[i] * scale_log2
                if tok0 + TILE_N > min_vis:
                    for i in cutlass.range_constexpr(cute.size(acc_s)):
                        if tok0 + cw * HALF_N + tScS[i][1] >= vis[(i // 2) % 2]:
                            acc_s[i] = -Float32.inf
                # -- row maxima of the whole tile: quad, then the other consumer through smem --
                mx = cute.make_rmem_tensor(2, Float32)
                mx[0] = -Float32.inf
                mx[1] = -Float32.inf
                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    mx[(i // 2) % 2] = cute.arch.fmax(mx[(i // 2) % 2], acc_s[i])
                for hr in cutlass.range_constexpr(2):
                    mx[hr] = cute.arch.fmax(mx[hr], cute.arch.shuffle_sync_bfly(mx[hr], offset=1))
                    mx[hr] = cute.arch.fmax(mx[hr], cute.arch.shuffle_sync_bfly(mx[hr], offset=2))
                    if ctid % 4 == 0:
                        sMax[r0 + 8 * hr, cw] = mx[hr]
                cute.arch.barrier(barrier_id=BAR_MAX, number_of_threads=CONSUMER_THREADS)
                alpha = cute.make_rmem_tensor(2, Float32)
                m_base = cute.make_rmem_tensor(2, Float32)
                for hr in cutlass.range_constexpr(2):
                    m_new = cute.arch.fmax(row_m[hr], cute.arch.fmax(mx[hr], sMax[r0 + 8 * hr, 1 - cw]))
                    # a row that has seen no key yet keeps m = -inf; exponentiate against 0 so it stays 0, not NaN
                    m_base[hr] = m_new
                    if m_new == -Float32.inf:
                        m_base[hr] = 0.0
                    alpha[hr] = cute.arch.exp2(row_m[hr] - m_base[hr])
                    row_m[hr] = m_new
                    row_l[hr] = row_l[hr] * alpha[hr]
                # -- P_w = exp2(S_w - m) -> smem --
                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    p = cute.arch.exp2(acc_s[i] - m_base[(i // 2) % 2])
                    acc_s[i] = p
                    row_l[(i // 2) % 2] = row_l[(i // 2) % 2] + p
                rP.store(acc_s.load().to(self.dtype))
                cute.autovec_copy(rP, tPsP)
                if tok0 + TILE_N > seqlen:
                    # cache rows past the request's end: zero this consumer's V columns (NaN * 0 is NaN)
                    for k in cutlass.range(seqlen - tok0, TILE_N, unroll=1):
                        sKV[k, cw * HALF_V + ctid, stage] = sKV.element_type(0.0)
                        sKV[k, cw * HALF_V + 128 + ctid, stage] = sKV.element_type(0.0)
                # generic-proxy smem writes (P, zeroed V) become visible to wgmma's async proxy
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=BAR_P, number_of_threads=CONSUMER_THREADS)
                # -- O_w = alpha O_w + P V_w --
                for i in cutlass.range_constexpr(cute.size(acc_o)):
                    acc_o[i] = acc_o[i] * alpha[(i // 2) % 2]
                _gemm(tiled_mma_pv, acc_o, tOrP, tOrV[None, None, None, stage], False)
                kv_pipe.consumer_release(kv_state)
                kv_state.advance()

            # -- epilogue: whole row sums (quad, then both consumers), normalize, store --
            for hr in cutlass.range_constexpr(2):
                row_l[hr] = row_l[hr] + cute.arch.shuffle_sync_bfly(row_l[hr], offset=1)
                row_l[hr] = row_l[hr] + cute.arch.shuffle_sync_bfly(row_l[hr], offset=2)
                if ctid % 4 == 0:
                    sSum[r0 + 8 * hr, cw] = row_l[hr]
            cute.arch.barrier(barrier_id=BAR_MAX, number_of_threads=CONSUMER_THREADS)
            inv_l = cute.make_rmem_tensor(2, Float32)
            lse = cute.make_rmem_tensor(2, Float32)
            for hr in cutlass.range_constexpr(2):
                total = sSum[r0 + 8 * hr, 0] + sSum[r0 + 8 * hr, 1]
                inv_l[hr] = 0.0
                lse[hr] = -Float32.inf
                if total > 0.0:
                    inv_l[hr] = 1.0 / total
                    lse[hr] = (row_m[hr] + cute.math.log2(total, fastmath=False)) * math.log(2.0)
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                r = m_block * TILE_M + tOcO[i][0]
                if r < rows:
                    val = acc_o[i] * inv_l[(i // 2) % 2]
                    col = cw * HALF_V + tOcO[i][1]
                    if const_expr(self.is_split):
                        mPO[batch, split, r, col] = val
                    else:
                        mOut[batch, r, col] = val.to(self.dtype)
            if cw == 0 and ctid % 4 == 0:
                for hr in cutlass.range_constexpr(2):
                    r = m_block * TILE_M + r0 + 8 * hr
                    if r < rows:
                        if const_expr(self.is_split):
                            mPL[batch, split, r] = lse[hr]
                        else:
                            mLse[batch, r] = lse[hr]


@cute.jit
def _gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
          zero_init: cutlass.Constexpr[bool]):
    """acc (+)= A B over all k-blocks as one wgmma group, waited for (the operands' smem is reused next)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    warpgroup.wait_group(0)
