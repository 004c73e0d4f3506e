"""The work-item scheduler of the persistent CuTe dense decode's ticket launches (mla_decode_kernel.py,
MLADecodeSm90(persistent=True, streamk=False)): how each CTA ranks the requests, how CTA 0 of a cluster draws
tickets from a global counter and hands them to the other CTAs, and how a producer warp hands items to its
consumers. Everything here is inlined into the kernel at trace time; the smem fields it names (item_mbar,
chan_mbar, item_slot, chan_slot, order, sQ) are the kernel's PersistentStorage.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr

from mlaserve.kernels.cutedsl.mla_decode import RANK_ORDER_MAX_B as ORDER_MAX_B
from mlaserve.kernels.cutedsl.seesaw_consumers import CONSUMER_THREADS

BAR_ORDER = 9         # the producer warpgroup's 128 threads, around the requests' ranking (rank_requests)
ITEM_STAGES = 2       # work items the producer hands its consumers ahead


@cute.jit
def init_scheduler(storage, tidx: Int32, cluster: cutlass.Constexpr[int]):
    """The item pipe (producer warp -> both consumers, ITEM_STAGES slots) and, in clusters, the mbarriers of
    the channel by which CTA 0 hands each ticket to CTA 1. Their init is fenced and synced by the KV pipe's
    creation, which follows."""
    item_pipe = pipeline.PipelineAsync.create(
        barrier_storage=storage.item_mbar.data_ptr(), num_stages=ITEM_STAGES,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_THREADS), defer_sync=True)
    if const_expr(cluster > 1):
        if tidx == 0:
            cute.arch.mbarrier_init(storage.chan_mbar.data_ptr(), 1)
            cute.arch.mbarrier_init(storage.chan_mbar.data_ptr() + 1, cluster - 1)
    return item_pipe


@cute.jit
def rank_requests(mSeqlens: cute.Tensor, storage, order: cute.Tensor, tidx: Int32, warp_idx: Int32):
    """The producer warpgroup, before any load: order[k] = the request of rank k by length, longest first, ties
    in index order (work_order.longest_first's order), in smem. Request r's key, min(length, 2^23 - 1) * 256 +
    255 - r, is distinct for every r (b <= 256), so the ranks are a permutation whatever the lengths; each
    thread counts, for its requests, the larger keys (b broadcast smem reads each, ~1 k cycles at b 128). The
    keys are staged in sQ's space, which the first Q load overwrites once all have been read.

    Warps 1-3 do the work while warp 0, the loader, only meets them at the barriers: with warp 0 in the
    thread-dependent loops too, ptxas no longer kept the loader's TMA operands in uniform registers and wrapped
    each of its copies in a loop over the warp's lanes (BRA.U.ANY), which slowed every page's issue enough to
    make whole steps 20-26% slower on the H200."""
    b = cute.size(mSeqlens)
    keys = cute.make_tensor(cute.recast_ptr(storage.sQ.data_ptr(), dtype=Int32), cute.make_layout(ORDER_MAX_B))
    if warp_idx > 0:
        for r in cutlass.range(tidx - 32, b, 96, unroll=1):
            keys[r] = cutlass.min(mSeqlens[r], Int32((1 << 23) - 1)) * ORDER_MAX_B + (ORDER_MAX_B - 1 - r)
    cute.arch.barrier(barrier_id=BAR_ORDER, number_of_threads=128)
    if warp_idx > 0:
        for r in cutlass.range(tidx - 32, b, 96, unroll=1):
            mine = keys[r]
            k = Int32(0)
            for j in cutlass.range(b, unroll=8):
                if keys[j] > mine:
                    k = k + 1
            order[k] = cutlass.Int16(r)
        # the keys' generic reads ordered before the Q load's async-proxy writes over them
        cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=BAR_ORDER, number_of_threads=128)


@cute.jit
def publish_item(item_pipe, item_state, storage, item: Int32):
    """The producer warp hands `item` to its consumers (one past the last: stop)."""
    item_pipe.producer_acquire(item_state)
    storage.item_slot.get_tensor(cute.make_layout(ITEM_STAGES))[item_state.index] = item
    item_pipe.producer_commit(item_state)
    item_state.advance()
    return item_state


@cute.jit
def next_item(item_pipe, item_state, storage):
    """A consumer thread's next work item from the producer (one past the last: stop)."""
    item_pipe.consumer_wait(item_state)
    item = storage.item_slot.get_tensor(cute.make_layout(ITEM_STAGES))[item_state.index]
    item_pipe.consumer_release(item_state)
    item_state.advance()
    return item, item_state


@cute.jit
def fetch_ticket(mSched: cute.Tensor, storage, rank: Int32, n_clusters: Int32, n_items: Int32, chan_phase: Int32,
                 cluster: cutlass.Constexpr[int]) -> Int32:
    """The next item of this cluster: CTA 0's lane 0 draws a ticket (atomic add on mSched[0]; the first
    n_clusters items went out by cluster index) and, in a cluster, hands it to the other CTAs over a one-slot
    channel in each one's smem (st.async completing the slot's mbarrier there; each frees its slot by
    arriving on CTA 0's empty mbarrier, which counts cluster - 1 arrivals; not after the last ticket, which
    CTA 0 does not wait for and may have exited by then)."""
    lane = cute.arch.lane_idx()
    ticket = Int32(0)
    if rank == 0:
        if lane == 0:
            ticket = cute.arch.atomic_add(mSched.iterator, Int32(1)) + n_clusters
        ticket = cute.arch.shuffle_sync(ticket, 0)
    if const_expr(cluster > 1):
        full = storage.chan_mbar.data_ptr()
        empty = storage.chan_mbar.data_ptr() + 1
        slot = storage.chan_slot.data_ptr()
        if rank == 0:
            cute.arch.mbarrier_wait(empty, chan_phase ^ 1)
            if lane == 0:
                for peer in cutlass.range_constexpr(1, cluster):
                    cute.arch.store_async_dsmem(slot, ticket, full, peer)
        else:
            if lane == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(full, 4)
            cute.arch.mbarrier_wait(full, chan_phase)
            ticket = storage.chan_slot.get_tensor(cute.make_layout(2))[0]
            cute.arch.sync_warp()
            if lane == 0 and ticket < n_items:
                cute.arch.mbarrier_arrive(empty, 0)
    return ticket
