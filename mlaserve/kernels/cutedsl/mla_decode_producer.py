"""The producer warpgroup of the CuTe DSL dense decode (mla_decode_kernel.py, whose docstring gives the schedule):
the CTA's Q and its requests' pages through TMA into the seesaw's ring, for grid, persistent (ticket) and stream-K
launches. A mixin of MLADecodeSm90: its methods read the kernel's switches from self."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from mlaserve.kernels.cutedsl.mla_decode import T_PAGE0, T_PUB, T_QLOAD
from mlaserve.kernels.cutedsl.seesaw_consumers import (
    BAR_P_READY, CONSUMER_THREADS, D_QK, D_V, HALF_V, TILE_M, TILE_N, KVSplit)
from mlaserve.kernels.cutedsl.ticket_scheduler import ITEM_STAGES, fetch_ticket, publish_item


class SeesawProducer:
    """MLADecodeSm90's producer side (warp 0 of warpgroup 0)."""

    @cute.jit
    def _produce_item(self, tma_q: cute.CopyAtom, mQ_tma: cute.Tensor, tma_kv: cute.CopyAtom, tKVs: cute.Tensor,
                      tKVg: cute.Tensor, sQ: cute.Tensor, mBT: cute.Tensor, q_pipe, kv_pipe, q_state, kv_state,
                      batch: Int32, m_block: Int32, start: Int32, n_tiles: Int32, rank: Int32, mSched=None,
                      trace_slot: Int32 = 0, pad=0):
        """The producer's loads for one (request, row tile, split): Q once, then its pages into the ring; with
        `pad` (1, pad_items), its first page twice (the pad tile, _pad_tile)."""
        gQ = cute.local_tile(mQ_tma[None, None, batch], (TILE_M, D_QK), (m_block, 0))
        tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                         cute.group_modes(gQ, 0, 2))
        q_pipe.producer_acquire(q_state)
        if const_expr(self.trace):
            if cute.arch.lane_idx() == 0:
                self._trace(mSched, trace_slot, T_QLOAD, cute.arch.clock())
        cute.copy(tma_q, tQg, tQs, tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
        first_page = start // TILE_N
        for t in cutlass.range(n_tiles + pad, unroll=1):
            if const_expr(self.pad_items):
                page = mBT[batch, first_page + cutlass.max(t - pad, 0)]
            else:
                page = mBT[batch, first_page + t]
            if const_expr(self.kv_prefetch > 0):
                ahead = t + self.kv_prefetch - 1 - pad      # the item's tile whose page goes to L2 now
                if ahead >= 0 and ahead < n_tiles:
                    self._prefetch_page(tma_kv, tKVg, self.cluster * mBT[batch, first_page + ahead] + rank)
            if const_expr(self.kv_split):
                if const_expr(self.trace):
                    if cute.arch.lane_idx() == 0 and t == 0:
                        self._trace(mSched, trace_slot, T_PAGE0, cute.arch.clock())
                self._produce_split(tma_kv, tKVs, tKVg, kv_pipe, kv_state, self.cluster * page + rank)
            elif const_expr(self.kv_parts > 1):
                if const_expr(self.trace):
                    if cute.arch.lane_idx() == 0 and t == 0:
                        self._trace(mSched, trace_slot, T_PAGE0, cute.arch.clock())
                self._produce_parts(tma_kv, tKVs, tKVg, kv_pipe, kv_state, self.cluster * page + rank)
            else:
                kv_pipe.producer_acquire(kv_state)
                if const_expr(self.trace):
                    if cute.arch.lane_idx() == 0 and t == 0:
                        self._trace(mSched, trace_slot, T_PAGE0, cute.arch.clock())
                if const_expr(self.cluster == 1):
                    cute.copy(tma_kv, tKVg[None, page], tKVs[None, kv_state.index],
                              tma_bar_ptr=kv_pipe.producer_get_barrier(kv_state))
                else:
                    cute.copy(tma_kv, tKVg[None, self.cluster * page + rank], tKVs[None, kv_state.index],
                              tma_bar_ptr=kv_pipe.producer_get_barrier(kv_state),
                              mcast_mask=cutlass.Int16((1 << self.cluster) - 1))
            kv_state.advance()
        return kv_state

    @cute.jit
    def _prefetch_page(self, tma_kv: cute.CopyAtom, tKVg: cute.Tensor, tile: Int32):
        """This CTA's share of one page (row tile `tile` of the cache's [64 / cluster, 576] tiling) into L2: a TMA
        prefetch of each box the page is loaded in, no barrier."""
        if const_expr(self.kv_boxes > 1):
            for box in cutlass.range_constexpr(self.kv_boxes):
                cute.prefetch(tma_kv, tKVg[None, tile, box])
        else:
            cute.prefetch(tma_kv, tKVg[None, tile])

    @cute.jit
    def _produce_parts(self, tma_kv: cute.CopyAtom, tKVs: cute.Tensor, tKVg: cute.Tensor, kv_pipe, kv_state,
                       tile: Int32):
        """One page's loads as kv_parts column parts, each on its own full barrier (KVParts), so that S can start
        on the first part while the others land. `tile`: the page's row tile in the [64 / cluster, 576] tiling
        of the cache (c * page + rank)."""
        for part in cutlass.range_constexpr(self.kv_parts):
            pipe = kv_pipe.pipes[part]
            pipe.producer_acquire(kv_state)
            if const_expr(self.cluster == 1):
                cute.copy(tma_kv, tKVg[None, tile, part], tKVs[None, kv_state.index, part],
                          tma_bar_ptr=pipe.producer_get_barrier(kv_state))
            else:
                cute.copy(tma_kv, tKVg[None, tile, part], tKVs[None, kv_state.index, part],
                          tma_bar_ptr=pipe.producer_get_barrier(kv_state),
                          mcast_mask=cutlass.Int16((1 << self.cluster) - 1))

    @cute.jit
    def _produce_split(self, tma_kv: cute.CopyAtom, tKVs: cute.Tensor, tKVg: cute.Tensor, kv_pipe: KVSplit, kv_state,
                       tile: Int32):
        """One page's loads for kv_split (KVSplit): the rope columns, then the half of V the stage's owner reads (the
        owner of ring stage s is consumer s), then the other half, each part as soon as it is free, in 64-column
        boxes. `tile`: the page's row tile in the [64 / cluster, 576] tiling of the cache (c * page + rank)."""
        mask = cutlass.Int16((1 << self.cluster) - 1)
        kv_pipe.rope.producer_acquire(kv_state)
        self._load_box(tma_kv, tKVs, tKVg, tile, kv_state.index, D_V // 64, kv_pipe.rope.producer_get_barrier(kv_state),
                       mask)
        for j in cutlass.range_constexpr(2):
            w = kv_state.index ^ j
            half = kv_pipe.half_state(kv_state, w)
            kv_pipe.halves.producer_acquire(half)
            for b in cutlass.range_constexpr(HALF_V // 64):
                self._load_box(tma_kv, tKVs, tKVg, tile, kv_state.index, w * (HALF_V // 64) + b,
                               kv_pipe.halves.producer_get_barrier(half), mask)

    @cute.jit
    def _load_box(self, tma_kv: cute.CopyAtom, tKVs: cute.Tensor, tKVg: cute.Tensor, tile: Int32, stage: Int32,
                  box: Int32, barrier, mask):
        """One 64-column box of a page into ring stage `stage`, completing on `barrier` (multicast in clusters)."""
        if const_expr(self.cluster == 1):
            cute.copy(tma_kv, tKVg[None, tile, box], tKVs[None, stage, box], tma_bar_ptr=barrier)
        else:
            cute.copy(tma_kv, tKVg[None, tile, box], tKVs[None, stage, box], tma_bar_ptr=barrier, mcast_mask=mask)

    @cute.jit
    def _pad_tile(self, kv_pipe: KVSplit, st: pipeline.PipelineState, cw: Int32):
        """A pad tile of pad_items (ring state st, stage 1, owned by consumer 1): the page the producer loaded is
        waited for and freed unread, so that the item's tiles start on stage 0 with consumer 0 as their first owner.
        Consumer 0 owned the tile before (the last of an earlier item) and owns the next: it waits for consumer 1's
        "P ready" of the pad, which comes after consumer 1's last read of P and m, before it writes them again."""
        kv_pipe.wait_half(st, cw)
        kv_pipe.release_half(st, cw)
        if cw == 1:
            kv_pipe.rope.consumer_wait(st)
            kv_pipe.rope.consumer_release(st)
            cute.arch.barrier_arrive(barrier_id=BAR_P_READY + 1, number_of_threads=CONSUMER_THREADS)
        else:
            cute.arch.barrier(barrier_id=BAR_P_READY + 1, number_of_threads=CONSUMER_THREADS)


    @cute.jit
    def _produce_items(self, tma_q: cute.CopyAtom, mQ_tma: cute.Tensor, tma_kv: cute.CopyAtom, tKVs: cute.Tensor,
                       tKVg: cute.Tensor, sQ: cute.Tensor, mBT: cute.Tensor, mSeqlens: cute.Tensor,
                       mSched: cute.Tensor, mOrder: cute.Tensor, q_pipe, kv_pipe, item_pipe, q_state, kv_state,
                       storage, rows: Int32, rank: Int32, cid: Int32, n_clusters: Int32):
        """The producer warp of a persistent launch: item `cid` first, then tickets from mSched[0] (offset by the
        clusters launched) until one is past the last item; each item is handed to the consumers, then its Q and
        pages are loaded. Items are (request, pair of row tiles), request-major over the requests in mOrder's
        order (longest first); CTA r of a cluster takes row tile pair * cluster + r. The last cluster to finish
        resets the counters for the next launch."""
        pairs = cute.ceil_div(rows, TILE_M) // self.cluster
        n_items = cute.size(mSeqlens) * pairs
        item_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, ITEM_STAGES)
        chan_phase = Int32(0)
        item = cid
        while item < n_items:
            item_state = publish_item(item_pipe, item_state, storage, item)
            slot = item * self.cluster + rank     # this CTA's part of the item (traced launches)
            if const_expr(self.trace):
                if cute.arch.lane_idx() == 0:
                    self._trace(mSched, slot, T_PUB, cute.arch.clock())
            batch = Int32(mOrder[item // pairs])
            m_block = (item % pairs) * self.cluster + rank
            n_tiles = (mSeqlens[batch] + TILE_N - 1) // TILE_N
            pad = 0
            if const_expr(self.pad_items):
                pad = kv_state.index * cutlass.min(n_tiles, 1)     # the ring's stage is 1: a pad tile first
            kv_state = self._produce_item(tma_q, mQ_tma, tma_kv, tKVs, tKVg, sQ, mBT, q_pipe, kv_pipe, q_state,
                                          kv_state, batch, m_block, 0, n_tiles, rank, mSched, slot, pad)
            q_state.advance()
            item = fetch_ticket(mSched, storage, rank, n_clusters, n_items, chan_phase, self.cluster)
            chan_phase = chan_phase ^ 1
        item_state = publish_item(item_pipe, item_state, storage, item)   # past the last: the consumers stop
        if rank == 0:
            if cute.arch.lane_idx() == 0:
                done = cute.arch.atomic_add(mSched.iterator + 1, Int32(1))
                if done == n_clusters - 1:
                    # every cluster has drawn its last ticket: nobody touches the counters again in this launch
                    mSched[0] = Int32(0)
                    mSched[1] = Int32(0)
        return kv_state
