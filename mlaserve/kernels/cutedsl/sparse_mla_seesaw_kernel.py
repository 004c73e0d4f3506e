"""The Hopper (sm_90a) sparse MLA (DSA) kernel with the dense decode kernel's "seesaw" consumers.

The grid, the Q load and the cp.async gather of the selected rows are sparse_mla_kernel.py's (this class
inherits its `__call__`, `_smem` and `_gather`); the consumers are mla_decode_kernel.py's seesaw: consumer
w owns the tiles t % 2 == w (ring stage w), computes the whole S = Q K_t^T of its tile at m64n64, publishes
P(t) and the running max m(t) through smem, and both consumers add P(t) V_t into their 256 columns of O
(the owner with P from registers, the other from smem). Differences from the dense kernel:
- the mask is per key, from the token's index row (-1 or past the split's end: -inf), the same for every
  head row of the CTA; rows that were masked were also zero-filled by the gather, so no V row needs
  zeroing before P V;
- cp.async writes the ring through the generic proxy, so each consumer fences (fence.proxy.async) after
  every full-barrier wait before its wgmma reads the stage;
- the empty barrier counts one lane per consumer warp (PipelineCpAsync arrives per calling thread);
- the producer warpgroup keeps 40 registers for the gather's address math, so the consumers get 232
  (128 * 40 + 256 * 232 = 384 * 168), not the dense kernel's 240.
The row finish (whole row sums, 1 / sum, lse) and the epilogue are split_consumers.py's finish_rows (with
this kernel's own barrier BAR_SUM: ids 1 and 2 are the "P ready" barriers) and store_sparse.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from mlaserve.kernels.cutedsl.mla_decode_kernel import _acc_as_a_operand, _issue, _kv_state
from mlaserve.kernels.cutedsl.sparse_mla_kernel import (
    CONSUMER_REGS, NUM_STAGES, PRODUCER_REGS, TILE_M, TILE_N, SparseMLASm90, _v_view, consumer_rows, cta_coords,
    load_q, split_range, wait_gathered, wait_q)
from mlaserve.kernels.cutedsl.split_consumers import (
    CONSUMER_THREADS, HALF_V, exp_p, finish_rows, key_of, move_row_max, row_of, scale_rows, sparse_key_bias,
    store_sparse)

BAR_P_READY = 1       # + w: consumer w arrives once P and m of its tile are in smem (0 is __syncthreads)
BAR_SUM = 3           # both consumers: row sums exchanged at the end


class SparseMLASeesawSm90(SparseMLASm90):
    """Compiled per (dtype, split), launched like SparseMLASm90 (its `__call__`, with this class's MMAs and
    max buffer)."""

    ROW_MAX_COLS = 1      # sMax [64]: the running max m(t) its owner published with P(t)

    def _tiled_mmas(self) -> tuple:
        """S: one warpgroup, M 64 x N 64 (the whole tile); O: one warpgroup, M 64 x N 256 (its half of V),
        with P from smem (the other consumer's tile) or from registers (its own)."""
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, (1, 1, 1), (TILE_M, TILE_N))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (1, 1, 1), (TILE_M, HALF_V))
        tiled_mma_pv_rs = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (1, 1, 1), (TILE_M, HALF_V), a_source=warpgroup.OperandSource.RMEM)
        return tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_rs

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ_tma: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor,
               mOut: cute.Tensor, mLse: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, h: Int32, topk: Int32,
               m_blocks: Int32, split_len: Int32, scale_log2: Float32, sQ_layout: cute.ComposedLayout,
               sKV_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma,
               tiled_mma_pv: cute.TiledMma, tiled_mma_pv_rs: cute.TiledMma):
        tidx, warp_idx, wg, m_block, token, split = cta_coords(tma_q, m_blocks)
        storage, kv_pipe, q_pipe, sQ, sKV, sP = self._smem(sQ_layout, sKV_layout, sP_layout)
        sMax = storage.row_max.get_tensor(cute.make_layout(TILE_M))
        sSum = storage.row_sum.get_tensor(cute.make_layout((TILE_M, 2)))
        start, end, n_tiles = split_range(split, split_len, topk)

        if wg == 0:
            # ---------------- producer: Q (TMA, warp 0), then the gather (all 128 threads) ----------------
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            load_q(warp_idx, tma_q, mQ_tma, sQ, q_pipe, token, m_block)
            self._gather(tidx, token, start, end, n_tiles, mKV, mIdx, storage.sKV.data_ptr(), kv_pipe)
        else:
            # ---------------- consumers: the seesaw ----------------
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            cw = wg - 1                  # owns tiles t % 2 == cw (ring stage cw) and columns 256cw.. of O
            ctid = tidx % 128
            thr_qk = tiled_mma_qk.get_slice(ctid)
            thr_pv = tiled_mma_pv.get_slice(ctid)
            thr_pv_rs = tiled_mma_pv_rs.get_slice(ctid)
            sVt_w = cute.local_tile(_v_view(sKV), (HALF_V, TILE_N, NUM_STAGES), (cw, 0, 0))  # [256, 64, stages]
            tSrQ = tiled_mma_qk.make_fragment_A(thr_qk.partition_A(sQ))
            tSrK = tiled_mma_qk.make_fragment_B(thr_qk.partition_B(sKV))
            tOrPs = tiled_mma_pv.make_fragment_A(thr_pv.partition_A(sP))
            tOrV = tiled_mma_pv.make_fragment_B(thr_pv.partition_B(sVt_w))
            tOrV_rs = tiled_mma_pv_rs.make_fragment_B(thr_pv_rs.partition_B(sVt_w))
            tPsP = thr_qk.partition_C(sP)
            acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE_M, TILE_N)), Float32)
            acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((TILE_M, HALF_V)), Float32)
            acc_o.fill(0.0)
            tScS = thr_qk.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
            tOcO = thr_pv.partition_C(cute.make_identity_tensor((TILE_M, HALF_V)))
            rP = cute.make_fragment_like(acc_s, self.dtype)
            tOrP = cute.make_tensor(rP.iterator, _acc_as_a_operand(rP.layout))   # P(t) as the A operand
            n_vals = cute.size(acc_s)
            bias = cute.make_rmem_tensor(n_vals // 2, Float32)   # 0 or -inf per distinct key (key_of) of this thread

            # row_m: the max O_w and row_l are scaled to; row_l: this thread's part of the sums of its own tiles' P
            r0, row_m, row_l = consumer_rows(ctid)

            wait_q(q_pipe)
            for t in cutlass.range(cw, n_tiles, 2, unroll=1):
                own = _kv_state(t)
                # this tile's key mask, read before any wait (the indices are in L1/L2: the gather read them)
                sparse_key_bias(bias, tScS, start + t * TILE_N, end, mIdx, token)
                if t > 0:
                    # -- a, b: the other consumer's tile t - 1 into this half of O --
                    self._other_tile_pv(cw, _kv_state(t - 1), kv_pipe, sMax, r0, row_m, row_l, acc_o,
                                        tiled_mma_pv, tOrPs, tOrV)
                # -- c: S = Q K_t^T --
                wait_gathered(kv_pipe, own)
                _issue(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, own.index], True)
                warpgroup.wait_group(0)
                # -- d: mask, running max, P --
                mx = cute.make_rmem_tensor(2, Float32)
                mx[0] = row_m[0]
                mx[1] = row_m[1]
                for i in cutlass.range_constexpr(n_vals):
                    acc_s[i] = acc_s[i] * scale_log2 + bias[key_of(i)]
                    mx[row_of(i)] = cute.arch.fmax(mx[row_of(i)], acc_s[i])
                alpha = cute.make_rmem_tensor(2, Float32)
                m_base = cute.make_rmem_tensor(2, Float32)
                for hr in cutlass.range_constexpr(2):
                    mx[hr] = cute.arch.fmax(mx[hr], cute.arch.shuffle_sync_bfly(mx[hr], offset=1))
                    mx[hr] = cute.arch.fmax(mx[hr], cute.arch.shuffle_sync_bfly(mx[hr], offset=2))
                    move_row_max(row_m, row_l, alpha, m_base, hr, mx[hr])
                exp_p(acc_s, m_base, row_l, rP)
                # -- e: publish P(t), m(t) --
                cute.autovec_copy(rP, tPsP)
                if ctid % 4 == 0:
                    sMax[r0] = row_m[0]
                    sMax[r0 + 8] = row_m[1]
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier_arrive(barrier_id=BAR_P_READY + cw, number_of_threads=CONSUMER_THREADS)
                # -- f: O_w = alpha O_w + P(t) V_{t,w}, P from registers --
                scale_rows(acc_o, alpha)
                _issue(tiled_mma_pv_rs, acc_o, tOrP, tOrV_rs[None, None, None, own.index], False)
                warpgroup.wait_group(0)
                if cute.arch.lane_idx() == 0:
                    kv_pipe.consumer_release(own)

            # the last tile is the other consumer's: its P into this half of O
            if n_tiles > 0 and (n_tiles - 1) % 2 != cw:
                self._other_tile_pv(cw, _kv_state(n_tiles - 1), kv_pipe, sMax, r0, row_m, row_l, acc_o,
                                    tiled_mma_pv, tOrPs, tOrV)

            # -- epilogue: whole row sums (quad, then both consumers, both at the final max), normalize, store --
            inv_l = cute.make_rmem_tensor(2, Float32)
            lse = cute.make_rmem_tensor(2, Float32)
            finish_rows(row_m, row_l, sSum, r0, cw, ctid, inv_l, lse, barrier_id=BAR_SUM)
            store_sparse(acc_o, inv_l, lse, tOcO, r0, cw, ctid, m_block * TILE_M, h, token, split, mOut, mLse,
                         mPO, mPL, self.is_split)

    @cute.jit
    def _other_tile_pv(self, cw: Int32, st: pipeline.PipelineState, kv_pipe: pipeline.PipelineCpAsync,
                       sMax: cute.Tensor, r0: Int32, row_m: cute.Tensor, row_l: cute.Tensor, acc_o: cute.Tensor,
                       tiled_mma_pv: cute.TiledMma, tOrPs: cute.Tensor, tOrV: cute.Tensor):
        """Steps a, b for the other consumer's tile (state st), as in mla_decode_kernel.py: wait for its P
        and m, rescale this consumer's O half and row sums to that m, O_w += P V_w, release the stage."""
        cute.arch.barrier(barrier_id=BAR_P_READY + 1 - cw, number_of_threads=CONSUMER_THREADS)
        wait_gathered(kv_pipe, st)
        alpha = cute.make_rmem_tensor(2, Float32)
        m_base = cute.make_rmem_tensor(2, Float32)
        for hr in cutlass.range_constexpr(2):
            move_row_max(row_m, row_l, alpha, m_base, hr, sMax[r0 + 8 * hr])
        scale_rows(acc_o, alpha)
        _issue(tiled_mma_pv, acc_o, tOrPs, tOrV[None, None, None, st.index], False)
        warpgroup.wait_group(0)
        if cute.arch.lane_idx() == 0:
            kv_pipe.consumer_release(st)
