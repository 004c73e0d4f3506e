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
The seesaw's MMAs, operands and other-tile step are seesaw_consumers.py's (seesaw_tiled_mmas,
seesaw_operands, other_tile_pv with this kernel's stage wait and release); the row finish (whole row sums,
1 / sum, lse) and the epilogue are split_consumers.py's finish_rows (with the seesaw's barrier BAR_SUM: ids 1
and 2 are the "P ready" barriers) and store_sparse.
"""

import functools

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from mlaserve.kernels.cutedsl.seesaw_consumers import (
    BAR_P_READY, BAR_SUM, issue_mma, other_tile_pv, seesaw_operands, seesaw_tiled_mmas, tile_state)
from mlaserve.kernels.cutedsl.sparse_mla_kernel import (
    CONSUMER_REGS, PRODUCER_REGS, TILE_M, TILE_N, SparseMLASm90, consumer_rows, cta_coords, load_q, split_range,
    wait_gathered, wait_q)
from mlaserve.kernels.cutedsl.split_consumers import (
    CONSUMER_THREADS, exp_p, finish_rows, fold_row_max, key_of, quad_row_max, rescale_rows, sparse_key_bias,
    store_sparse)


class SparseMLASeesawSm90(SparseMLASm90):
    """Compiled per (dtype, split), launched like SparseMLASm90 (its `__call__`, with this class's MMAs and
    max buffer)."""

    ROW_MAX_COLS = 1      # sMax [64]: the running max m(t) its owner published with P(t)

    def __init__(self, dtype, is_split: bool, store16: bool = False, lazy_rescale: bool = False,
                 tree_max: bool = False):
        """The softmax switches are the dense seesaw's (mla_decode_kernel.MLADecodeSm90): `lazy_rescale`, a row's
        max moves only when it rises by more than split_consumers.LAZY_RESCALE_LOG2 and O's rescales are skipped
        in warps where none moved; `tree_max`, each row's max folded pairwise. (Not its fold_scale: here the
        scale and the mask's bias are one FFMA a value already.)"""
        super().__init__(dtype, is_split, store16)
        self.lazy_rescale = lazy_rescale
        self.tree_max = tree_max

    def _tiled_mmas(self) -> tuple:
        """The dense seesaw kernel's three MMAs (seesaw_consumers.seesaw_tiled_mmas)."""
        return seesaw_tiled_mmas(self.dtype)

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
            (tSrQ, tSrK, tOrPs, tOrV, tOrV_rs, tOrP, tPsP, acc_s, acc_o, tScS, tOcO, rP) = seesaw_operands(
                tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_rs, ctid, cw, sQ, sKV, sP)
            n_vals = cute.size(acc_s)
            bias = cute.make_rmem_tensor(n_vals // 2, Float32)   # 0 or -inf per distinct key (key_of) of this thread

            # row_m: the max O_w and row_l are scaled to; row_l: this thread's part of the sums of its own tiles' P
            r0, row_m, row_l = consumer_rows(ctid)

            # the gathered stage: waited with the proxy fence, released by one lane per consumer warp
            wait_stage = functools.partial(wait_gathered, kv_pipe)
            release_stage = functools.partial(_release_by_lane0, kv_pipe)
            wait_q(q_pipe)
            lazy = self.lazy_rescale
            for t in cutlass.range(cw, n_tiles, 2, unroll=1):
                own = tile_state(t)
                # this tile's key mask, read before any wait (the indices are in L1/L2: the gather read them)
                sparse_key_bias(bias, tScS, start + t * TILE_N, end, mIdx, token)
                if t > 0:
                    # -- a, b: the other consumer's tile t - 1 into this half of O --
                    other_tile_pv(cw, tile_state(t - 1), wait_stage, release_stage, sMax, r0, row_m, row_l, acc_o,
                                  tiled_mma_pv, tOrPs, tOrV, lazy)
                # -- c: S = Q K_t^T --
                wait_gathered(kv_pipe, own)
                issue_mma(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, own.index], True)
                warpgroup.wait_group(0)
                # -- d: mask, running max, P --
                mx = cute.make_rmem_tensor(2, Float32)
                mx[0] = row_m[0]
                mx[1] = row_m[1]
                for i in cutlass.range_constexpr(n_vals):
                    acc_s[i] = acc_s[i] * scale_log2 + bias[key_of(i)]
                fold_row_max(acc_s, mx, self.tree_max)
                alpha, m_base = quad_row_max(mx, row_m, row_l, lazy)
                exp_p(acc_s, m_base, row_l, rP)
                # -- e: publish P(t), m(t) --
                cute.autovec_copy(rP, tPsP)
                if ctid % 4 == 0:
                    sMax[r0] = row_m[0]
                    sMax[r0 + 8] = row_m[1]
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier_arrive(barrier_id=BAR_P_READY + cw, number_of_threads=CONSUMER_THREADS)
                # -- f: O_w = alpha O_w + P(t) V_{t,w}, P from registers --
                rescale_rows(acc_o, alpha, lazy)
                issue_mma(tiled_mma_pv_rs, acc_o, tOrP, tOrV_rs[None, None, None, own.index], False)
                warpgroup.wait_group(0)
                release_stage(own)

            # the last tile is the other consumer's: its P into this half of O
            if n_tiles > 0 and (n_tiles - 1) % 2 != cw:
                other_tile_pv(cw, tile_state(n_tiles - 1), wait_stage, release_stage, sMax, r0, row_m, row_l,
                              acc_o, tiled_mma_pv, tOrPs, tOrV, lazy)

            # -- epilogue: whole row sums (quad, then both consumers, both at the final max), normalize, store --
            inv_l = cute.make_rmem_tensor(2, Float32)
            lse = cute.make_rmem_tensor(2, Float32)
            finish_rows(row_m, row_l, sSum, r0, cw, ctid, inv_l, lse, barrier_id=BAR_SUM)
            store_sparse(acc_o, inv_l, lse, tOcO, r0, cw, ctid, m_block * TILE_M, h, token, split, mOut, mLse,
                         mPO, mPL, self.is_split, self.store16)


@cute.jit
def _release_by_lane0(kv_pipe: pipeline.PipelineCpAsync, st: pipeline.PipelineState):
    """A gathered stage's release: one lane per consumer warp (the empty barrier counts 8 arrivals)."""
    if cute.arch.lane_idx() == 0:
        kv_pipe.consumer_release(st)
