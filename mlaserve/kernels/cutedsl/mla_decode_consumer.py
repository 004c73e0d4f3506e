"""The two consumer warpgroups of the CuTe DSL dense decode (mla_decode_kernel.py, whose docstring gives the
seesaw schedule): one work item's tiles, the KV_SPLIT form of S, the own tile's softmax and P V, and O's store.
A mixin of MLADecodeSm90: its methods read the kernel's switches from self."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from mlaserve.kernels.cutedsl.mla_decode import T_EPI, T_FIRST, T_LOOP, T_Q, T_SUMS
from mlaserve.kernels.cutedsl.request_rows import first_masked_key, visible_keys
from mlaserve.kernels.cutedsl.seesaw_consumers import (
    BAR_P_READY, BAR_SUM, CONSUMER_THREADS, D_QK, D_V, HALF_V, TILE_M, TILE_N, KVSplit, issue_k_blocks, issue_mma,
    issue_mma_by_part, tile_state, other_tile_pv, other_tile_pv_issue, publish_row_sums, speculative_p, take_row_sums)
from mlaserve.kernels.cutedsl.split_consumers import (
    exp_p, finish_rows, fold_row_max, quad_row_max, scale_rows, rescale_rows, store_dense_block, store_dense_lse)
from mlaserve.kernels.cutedsl.stream_k_pieces import merge_piece

BAR_WG = 4            # + w: consumer w's own 128 threads (V rows it zeroed, before its own wgmma reads them)


def s_part_blocks(w: int, first: bool) -> tuple:
    """kv_split: the k-blocks (16 columns each) of S's part issued by consumer w, as a static tuple: first the rope's
    (columns 512..575) and V half w's, then V's other half."""
    per_half = HALF_V // 16
    own = tuple(range(w * per_half, (w + 1) * per_half))
    if first:
        return tuple(range(D_V // 16, D_QK // 16)) + own
    return tuple(range((1 - w) * per_half, (2 - w) * per_half))


class SeesawConsumer:
    """MLADecodeSm90's consumer side (warpgroups 1 and 2)."""

    @cute.jit
    def _consume_item(self, kv_pipe, q_pipe, q_state, ops, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
                      tiled_mma_pv_rs: cute.TiledMma, sKV: cute.Tensor, sMax: cute.Tensor, sSum: cute.Tensor,
                      mOut: cute.Tensor, mLse: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, cw: Int32, ctid: Int32,
                      seqlen: Int32, start: Int32, n_tiles: Int32, g, batch: Int32, split: Int32, m_block: Int32,
                      s_q: Int32, h: Int32, rows: Int32, scale_log2: Float32, trace_slot: Int32 = 0, piece=None,
                      mTrace=None):
        """One consumer's part of one (request, row tile, split): its tiles of the seesaw, then its half of the
        output. `g` counts the tiles this CTA ran before (persistent launches; 0 otherwise): ring stage and owner
        of the item's tile t are those of tile g + t. `piece` (stream-K launches): (item, first tile, end tile,
        the item's tiles, slot, slots, cluster rank, smem storage) for merge_piece. `mTrace`: where traced
        launches record (mPO by default; stream-K launches' is in the schedule's buffer)."""
        (tSrQ, tSrK, tOrPs, tOrV, tOrV_rs, tOrP, tPsP, acc_s, acc_o, tScS, tOcO, rP) = ops
        mT = mPO if mTrace is None else mTrace
        # A wgmma m64 accumulator gives each thread two rows, r0 and r0 + 8 (value index i: bit 1 picks
        # the row), shared with the three other lanes of its quad.
        r0 = (ctid // 32) * 16 + (ctid % 32) // 4
        vis = cute.make_rmem_tensor(2, Int32)      # keys visible to each of the thread's rows
        row_m = cute.make_rmem_tensor(2, Float32)  # the max (log2 units) O_w and row_l are scaled to
        row_l = cute.make_rmem_tensor(2, Float32)  # this thread's part of the sums of its own tiles' P
        for hr in cutlass.range_constexpr(2):
            vis[hr] = visible_keys(seqlen, s_q, h, m_block * TILE_M + r0 + 8 * hr, self.causal)
            row_m[hr] = -Float32.inf
            row_l[hr] = 0.0
        min_vis = first_masked_key(seqlen, s_q, self.causal)

        q_pipe.consumer_wait(q_state)
        if const_expr(self.trace):
            if ctid == 0:
                self._trace(mT, trace_slot, T_Q + 4 * cw, cute.arch.clock())
        first = cw
        if const_expr(self.persistent):
            first = (cw + g) % 2
        lazy = self.lazy_rescale
        if const_expr(self.kv_split):
            self._seesaw_split(kv_pipe, ops, tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_rs, sKV, sMax, sSum, mT, cw,
                               ctid, r0, vis, row_m, row_l, min_vis, seqlen, start, n_tiles, g, first, q_state.phase,
                               scale_log2, trace_slot)
        else:
            for t in cutlass.range(first, n_tiles, 2, unroll=1):
                tok0 = start + t * TILE_N
                own = tile_state(g + t)
                if t > 0:
                    # -- a, b: the other consumer's tile t - 1 into this half of O --
                    if const_expr(self.cluster > 1):
                        # issued, not waited for: S below is queued right behind it
                        other_tile_pv_issue(cw, tile_state(g + t - 1), kv_pipe.consumer_wait, sMax, r0, row_m, row_l,
                                            acc_o, tiled_mma_pv, tOrPs, tOrV, lazy)
                    else:
                        other_tile_pv(cw, tile_state(g + t - 1), kv_pipe.consumer_wait, kv_pipe.consumer_release, sMax,
                                      r0, row_m, row_l, acc_o, tiled_mma_pv, tOrPs, tOrV, lazy)
                # -- c: S = Q K_t^T --
                if const_expr(self.kv_parts > 1):
                    issue_mma_by_part(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, own.index], kv_pipe.pipes, own)
                else:
                    kv_pipe.consumer_wait(own)
                    issue_mma(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, own.index], True)
                if const_expr(self.cluster > 1):
                    # b's wgmma ran ahead of S in the same queue: wait for it and free its stage
                    warpgroup.wait_group(1)
                    if t > 0:
                        kv_pipe.consumer_release(tile_state(g + t - 1))
                warpgroup.wait_group(0)
                # -- d, e: mask, running max, P; publish P(t), m(t) --
                alpha = self._own_tile_softmax(acc_s, row_m, row_l, rP, tPsP, tScS, vis, sMax, sSum, sKV, tok0, min_vis,
                                               seqlen, own.index, t, n_tiles, r0, cw, ctid, q_state.phase, scale_log2)
                # -- f: O_w = alpha O_w + P(t) V_{t,w}, P from registers --
                self._own_tile_pv(acc_o, alpha, tiled_mma_pv_rs, tOrP, tOrV_rs, own, kv_pipe.consumer_release, mT,
                                      trace_slot, t, first, cw, ctid)

            if const_expr(self.trace):
                if ctid == 0:
                    self._trace(mT, trace_slot, T_LOOP + 4 * cw, cute.arch.clock())
            # the last tile is the other consumer's: its P into this half of O, this consumer's row sums (final once
            # rescaled to that tile's max) published while the wgmma runs
            if n_tiles > 0 and (g + n_tiles - 1) % 2 != cw:
                last = tile_state(g + n_tiles - 1)
                if const_expr(self.early_sums):
                    other_tile_pv_issue(cw, last, kv_pipe.consumer_wait, sMax, r0, row_m, row_l, acc_o, tiled_mma_pv,
                                        tOrPs, tOrV, lazy)
                    publish_row_sums(row_l, sSum, r0, cw, ctid, q_state.phase)
                    warpgroup.wait_group(0)
                    kv_pipe.consumer_release(last)
                else:
                    other_tile_pv(cw, last, kv_pipe.consumer_wait, kv_pipe.consumer_release, sMax, r0, row_m, row_l,
                                  acc_o, tiled_mma_pv, tOrPs, tOrV, lazy)
        if const_expr(self.early_sums):
            if n_tiles == 0:
                publish_row_sums(row_l, sSum, r0, cw, ctid, q_state.phase)
        if const_expr(self.persistent):
            # every S of this item is done: the producer may load the next item's Q (during this epilogue)
            q_pipe.consumer_release(q_state)
        if const_expr(self.trace):
            if ctid == 0:
                self._trace(mT, trace_slot, T_EPI + 4 * cw, cute.arch.clock())

        # -- epilogue: whole row sums (both consumers', at the final max), normalize, store --
        inv_l = cute.make_rmem_tensor(2, Float32)
        lse = cute.make_rmem_tensor(2, Float32)
        if const_expr(self.early_sums):
            take_row_sums(row_m, sSum, r0, cw, q_state.phase, inv_l, lse)
        else:
            finish_rows(row_m, row_l, sSum[None, None, 0], r0, cw, ctid, inv_l, lse, barrier_id=BAR_SUM)
            if const_expr(self.persistent):
                # both consumers have read sSum before either writes the next item's
                cute.arch.barrier(barrier_id=BAR_SUM, number_of_threads=CONSUMER_THREADS)
        if const_expr(self.trace):
            if ctid == 0 and cw == 0:
                self._trace(mT, trace_slot, T_SUMS, cute.arch.clock())
        owner = Int32(1)         # this CTA stores the rows' output (stream-K: not a piece another one merges)
        if const_expr(self.streamk):
            owner = merge_piece(acc_o, inv_l, lse, mPO, mPL, r0, cw, ctid, piece, self.cluster)
        if owner != 0:
            full = m_block * TILE_M + TILE_M <= rows
            if const_expr(self.store16):
                if full:
                    store_dense_block(acc_o, inv_l, mOut, mPO, batch, split, m_block, rows, r0, cw, ctid,
                                      self.is_split, "bf16" if const_expr(self.dtype == cutlass.BFloat16) else "f16")
                else:
                    scale_rows(acc_o, inv_l)
                    self._store_o(acc_o, tiled_mma_pv, tOcO, mOut, mPO, cw, ctid, batch, split, m_block, rows, False)
            else:
                scale_rows(acc_o, inv_l)
                self._store_o(acc_o, tiled_mma_pv, tOcO, mOut, mPO, cw, ctid, batch, split, m_block, rows, full)
            store_dense_lse(lse, mLse, mPL, batch, split, m_block, rows, r0, cw, ctid, self.is_split)

    @cute.jit
    def _seesaw_split(self, kv_pipe: KVSplit, ops, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
                      tiled_mma_pv_rs: cute.TiledMma, sKV: cute.Tensor, sMax: cute.Tensor, sSum: cute.Tensor,
                      mT: cute.Tensor, cw: Int32, ctid: Int32, r0: Int32, vis: cute.Tensor, row_m: cute.Tensor,
                      row_l: cute.Tensor, min_vis: Int32, seqlen: Int32, start: Int32, n_tiles: Int32, g, first,
                      parity: Int32, scale_log2: Float32, trace_slot: Int32):
        """The seesaw's tiles on kv_split's ring (KVSplit), S issued before the wait for the other consumer's P. One
        own tile t of consumer w, in order:
          c1. wait for the rope columns and V's half w of tile t; issue their k-blocks of S(t) (both were freed by
              this consumer, so they land first)
          a, b. wait for P(t-1) and m(t-1); O_w rescaled; issue O_w += P(t-1) V_{t-1,w} (S(t)'s first part runs
              meanwhile, and before that while the other consumer's softmax(t-1) runs)
          c2. wait for the other half; issue its k-blocks of S(t); wait for all: free half w of tile t-1 and the rope
              columns of tile t
          d, e. softmax(t), publish P(t), m(t) (as in the default order)
          f. O_w rescaled; O_w += P(t) V_{t,w}; wait; free half w of tile t.
        Each part is freed by the one consumer that reads it last, so a page's refill starts part by part instead of
        after both consumers' P V."""
        (tSrQ, tSrK, tOrPs, tOrV, tOrV_rs, tOrP, tPsP, acc_s, acc_o, tScS, tOcO, rP) = ops
        lazy = self.lazy_rescale
        for t in cutlass.range(first, n_tiles, 2, unroll=1):
            tok0 = start + t * TILE_N
            own = tile_state(g + t)
            prev = tile_state(g + t - 1)           # used only for t > 0
            tSrK_t = tSrK[None, None, None, own.index]
            # -- c1: the rope's and V half w's k-blocks of S(t) --
            kv_pipe.rope.consumer_wait(own)
            kv_pipe.wait_half(own, cw)
            self._issue_s_part(tiled_mma_qk, acc_s, tSrQ, tSrK_t, cw, True)
            if t > 0:
                # -- a, b: the other consumer's tile t - 1 into this half of O, issued behind S(t)'s first part --
                other_tile_pv_issue(cw, prev, lambda st: kv_pipe.wait_half(st, cw), sMax, r0, row_m, row_l, acc_o,
                                    tiled_mma_pv, tOrPs, tOrV, lazy)
            # -- c2: the other half's k-blocks --
            kv_pipe.wait_half(own, 1 - cw)
            self._issue_s_part(tiled_mma_qk, acc_s, tSrQ, tSrK_t, cw, False)
            warpgroup.wait_group(0)
            if t > 0:
                kv_pipe.release_half(prev, cw)
            kv_pipe.rope.consumer_release(own)
            # -- d, e: mask, running max, P; publish P(t), m(t) --
            alpha = self._own_tile_softmax(acc_s, row_m, row_l, rP, tPsP, tScS, vis, sMax, sSum, sKV, tok0, min_vis,
                                           seqlen, own.index, t, n_tiles, r0, cw, ctid, parity, scale_log2)
            # -- f: O_w = alpha O_w + P(t) V_{t,w}, P from registers --
            self._own_tile_pv(acc_o, alpha, tiled_mma_pv_rs, tOrP, tOrV_rs, own,
                                  lambda st: kv_pipe.release_half(st, cw), mT, trace_slot, t, first, cw, ctid)

        if const_expr(self.trace):
            if ctid == 0:
                self._trace(mT, trace_slot, T_LOOP + 4 * cw, cute.arch.clock())
        if n_tiles > 0 and (g + n_tiles - 1) % 2 != cw:
            # the last tile is the other consumer's (as in the default order)
            last = tile_state(g + n_tiles - 1)
            other_tile_pv_issue(cw, last, lambda st: kv_pipe.wait_half(st, cw), sMax, r0, row_m, row_l, acc_o,
                                tiled_mma_pv, tOrPs, tOrV, lazy)
            if const_expr(self.early_sums):
                publish_row_sums(row_l, sSum, r0, cw, ctid, parity)
            warpgroup.wait_group(0)
            kv_pipe.release_half(last, cw)

    @cute.jit
    def _issue_s_part(self, tiled_mma_qk: cute.TiledMma, acc_s: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor,
                      cw: Int32, first: cutlass.Constexpr[bool]):
        """kv_split's S in two committed groups: `first`, the rope's k-blocks then V half cw's (zeroing acc_s);
        otherwise the other half's."""
        if cw == 0:
            issue_k_blocks(tiled_mma_qk, acc_s, tSrQ, tSrK, s_part_blocks(0, first), first)
        else:
            issue_k_blocks(tiled_mma_qk, acc_s, tSrQ, tSrK, s_part_blocks(1, first), first)

    @cute.jit
    def _own_tile_pv(self, acc_o: cute.Tensor, alpha: cute.Tensor, tiled_mma_pv_rs: cute.TiledMma, tOrP: cute.Tensor,
                     tOrV_rs: cute.Tensor, own, release, mT: cute.Tensor, trace_slot: Int32, t: Int32, first,
                     cw: Int32, ctid: Int32):
        """Step f of the owner's tile (state `own`): O_w = alpha O_w + P(t) V_{t,w} with P from registers, waited;
        then `release(own)` frees what this consumer read of the stage."""
        rescale_rows(acc_o, alpha, self.lazy_rescale)
        issue_mma(tiled_mma_pv_rs, acc_o, tOrP, tOrV_rs[None, None, None, own.index], False)
        warpgroup.wait_group(0)
        release(own)
        if const_expr(self.trace):
            if ctid == 0 and t < first + 2:
                self._trace(mT, trace_slot, T_FIRST + 4 * cw, cute.arch.clock())

    @cute.jit
    def _own_tile_softmax(self, acc_s: cute.Tensor, row_m: cute.Tensor, row_l: cute.Tensor, rP: cute.Tensor,
                          tPsP: cute.Tensor, tScS: cute.Tensor, vis: cute.Tensor, sMax: cute.Tensor, sSum: cute.Tensor,
                          sKV: cute.Tensor, tok0: Int32, min_vis: Int32, seqlen: Int32, stage: Int32, t: Int32,
                          n_tiles: Int32, r0: Int32, cw: Int32, ctid: Int32, parity: Int32, scale_log2: Float32):
        """Steps d and e of the owner's tile t (in ring stage `stage`), S in acc_s: mask, running max, P into rP and
        smem, m(t) into sMax, V rows past the request's end zeroed, "P(t) ready" -> alpha, O_w's rescale for f."""
        # -- d: mask, running max, P --
        if const_expr(not self.fold_scale):
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = acc_s[i] * scale_log2
        if tok0 + TILE_N > min_vis:
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                if tok0 + tScS[i][1] >= vis[(i // 2) % 2]:
                    acc_s[i] = -Float32.inf
        if const_expr(self.spec_exp):
            alpha = speculative_p(acc_s, row_m, row_l, rP, tPsP, scale_log2, self.tree_max)
        else:
            mx = cute.make_rmem_tensor(2, Float32)
            if const_expr(self.fold_scale):
                # the scale is positive: the max of the unscaled S, scaled, is the max of the scaled
                mx[0] = -Float32.inf
                mx[1] = -Float32.inf
            else:
                mx[0] = row_m[0]
                mx[1] = row_m[1]
            fold_row_max(acc_s, mx, self.tree_max)
            if const_expr(self.fold_scale):
                for hr in cutlass.range_constexpr(2):
                    mx[hr] = cute.arch.fmax(row_m[hr], mx[hr] * scale_log2)
            alpha, m_base = quad_row_max(mx, row_m, row_l, self.lazy_rescale)
            exp_p(acc_s, m_base, row_l, rP, scale_log2 if const_expr(self.fold_scale) else None)
        # -- e: publish P(t), m(t) --
        if const_expr(not self.spec_exp):
            cute.autovec_copy(rP, tPsP)      # (speculative_p stores its own)
        if ctid % 4 == 0:
            sMax[r0] = row_m[0]
            sMax[r0 + 8] = row_m[1]
        if tok0 + TILE_N > seqlen:
            # cache rows past the request's end: zero all 512 V columns of this tile (NaN * 0 is NaN)
            for k in cutlass.range(seqlen - tok0, TILE_N, unroll=1):
                for c in cutlass.range_constexpr(D_V // 128):
                    sKV[k, c * 128 + ctid, stage] = sKV.element_type(0.0)
        # generic-proxy smem writes (P, zeroed V) become visible to wgmma's async proxy
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier_arrive(barrier_id=BAR_P_READY + cw, number_of_threads=CONSUMER_THREADS)
        if const_expr(self.early_sums):
            if t == n_tiles - 1:
                # this consumer's row sums are final (the last tile is its own): out to the other one now
                publish_row_sums(row_l, sSum, r0, cw, ctid, parity)
        if tok0 + TILE_N > seqlen:
            # this consumer's own P V below reads V rows its other threads zeroed
            cute.arch.barrier(barrier_id=BAR_WG + cw, number_of_threads=128)
        return alpha

    @cute.jit
    def _store_o(self, acc_o: cute.Tensor, tiled_mma_pv: cute.TiledMma, tOcO: cute.Tensor, mOut: cute.Tensor,
                 mPO: cute.Tensor, cw: Int32, ctid: Int32, batch: Int32, split: Int32, m_block: Int32, rows: Int32,
                 full):
        """This consumer's normalized [64, 256] block of the output (or fp32 split partial) in the accumulator's
        layout: a thread's values come in pairs of adjacent columns, which autovec_copy stores as one 4-byte
        (bf16) / 8-byte (fp32) access; row by row in the last row block of a request whose s_q * h is not a
        multiple of 64 (`full` False)."""
        if const_expr(self.is_split):
            gO = cute.local_tile(mPO[batch, split, None, None], (TILE_M, HALF_V), (m_block, cw))
            rO = acc_o
        else:
            gO = cute.local_tile(mOut[batch, None, None], (TILE_M, HALF_V), (m_block, cw))
            rO = cute.make_fragment_like(acc_o, self.dtype)
            rO.store(acc_o.load().to(self.dtype))
        tOgO = tiled_mma_pv.get_slice(ctid).partition_C(gO)
        if full:
            cute.autovec_copy(rO, tOgO)
        else:
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                if m_block * TILE_M + tOcO[i][0] < rows:
                    tOgO[i] = rO[i]
