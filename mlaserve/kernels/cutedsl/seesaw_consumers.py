"""The "seesaw" consumer pair that two CuTe DSL kernels share: the bf16/fp16 dense decode
(mla_decode_kernel.py) and the bf16/fp16 sparse MLA (sparse_mla_seesaw_kernel.py); the schedule is
described in mla_decode_kernel.py's docstring.

Two consumer warpgroups (256 threads) over a 2-stage ring of [64, 576] tiles: consumer w owns the tiles
t % 2 == w (ring stage w), computes their whole S = Q K_t^T at m64n64 and publishes P(t) and the running max
through smem; both add P(t) V_t into their 256 columns of O, the owner with P from registers, the other
from smem (other_tile_pv). Everything here is inlined into the calling kernel at trace time.
"""

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from mlaserve.kernels.cutedsl.split_consumers import (LAZY_RESCALE_LOG2, exp_p, fold_row_max, move_row_max,
                                                      quad_row_max, rescale_rows, row_of)

TILE_M = 64           # query rows (heads) per CTA: one wgmma M
TILE_N = 64           # keys per ring stage
D_QK = 576
D_V = 512
HALF_V = D_V // 2     # columns of O per consumer
NUM_STAGES = 2        # = the number of consumers: consumer w's tiles always sit in stage w
BAR_P_READY = 1       # + w: consumer w arrives once P and m of its tile are in smem (0 is __syncthreads)
BAR_SUM = 3           # both consumers: row sums exchanged at the end
BAR_SUM_W = 7         # + w: consumer w's row sums published (publish_row_sums; the dense decode's 4-6 are its own)
CONSUMER_THREADS = 256


def v_view(s_kv: cute.Tensor) -> cute.Tensor:
    """The KV ring [64 keys, 576, stages] seen as V^T [512, 64 keys, stages] without moving data (MN-major B).

    Composition maps (column, key, stage) to the ring's own (key, column, stage) coordinates; the stage
    stride is the ring's 64 * 576, not 512 * 64.
    """
    return cute.composition(s_kv, cute.make_layout((D_V, TILE_N, NUM_STAGES), stride=(TILE_N, 1, TILE_N * D_QK)))


def acc_as_a_operand(acc_layout: cute.Layout) -> cute.Layout:
    """The register layout of an m64nN accumulator, ((2, 2, N/8), 1, 1), regrouped as the A operand of
    k16 wgmmas, ((2, 2, 2), 1, (N/16, 1)): each k-block of 16 keys is two of the accumulator's 8-column
    groups (the accumulator's and the A fragment's thread/value maps agree for 16-bit types)."""
    d = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    return cute.make_layout(
        ((d.shape[0][0], d.shape[0][1], d.shape[0][2][0]), d.shape[1], (d.shape[0][2][1], d.shape[2])),
        stride=((d.stride[0][0], d.stride[0][1], d.stride[0][2][0]), d.stride[1],
                (d.stride[0][2][1], d.stride[2])))


def tile_state(t: Int32) -> pipeline.PipelineState:
    """The consumer pipeline state of tile t: stage t % 2, phase flips every NUM_STAGES tiles."""
    return pipeline.PipelineState(NUM_STAGES, t, t % NUM_STAGES, (t // NUM_STAGES) % 2)


def seesaw_tiled_mmas(dtype):
    """S: one warpgroup, M 64 x N 64 (the whole tile); O: one warpgroup, M 64 x N 256 (its half of V), with P
    from smem (the other consumer's tile) or from registers (its own) -> (qk, pv, pv_rs)."""
    qk = sm90_utils.make_trivial_tiled_mma(dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
                                           Float32, (1, 1, 1), (TILE_M, TILE_N))
    pv = sm90_utils.make_trivial_tiled_mma(dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
                                           Float32, (1, 1, 1), (TILE_M, HALF_V))
    pv_rs = sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32, (1, 1, 1),
        (TILE_M, HALF_V), a_source=warpgroup.OperandSource.RMEM)
    return qk, pv, pv_rs


def seesaw_smem_layouts(dtype) -> tuple:
    """The seesaw's smem layouts, every operand K-major with the 128-byte swizzle (64 16-bit values a row): (the
    swizzle atom, Q [64, 576], the KV ring [64, 576, NUM_STAGES], P [64, 64])."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, dtype, D_QK), dtype)
    return (atom, cute.tile_to_shape(atom, (TILE_M, D_QK), order=(0, 1)),
            cute.tile_to_shape(atom, (TILE_N, D_QK, NUM_STAGES), order=(0, 1, 2)),
            cute.tile_to_shape(atom, (TILE_M, TILE_N), order=(0, 1)))


def seesaw_operands(tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, tiled_mma_pv_rs: cute.TiledMma,
                    ctid, cw, sQ: cute.Tensor, sKV: cute.Tensor, sP: cute.Tensor):
    """Consumer cw's wgmma operands over the ring (Q [64, 576], KV [64, 576, stages], P [64, 64]) and its
    accumulators (O zeroed), traced inline: (tSrQ, tSrK, tOrPs (P from smem), tOrV, tOrV_rs (V for P from
    registers), tOrP (P(t) in registers as the A operand), tPsP, acc_s, acc_o, tScS, tOcO, rP)."""
    thr_qk = tiled_mma_qk.get_slice(ctid)
    thr_pv = tiled_mma_pv.get_slice(ctid)
    thr_pv_rs = tiled_mma_pv_rs.get_slice(ctid)
    sVt_w = cute.local_tile(v_view(sKV), (HALF_V, TILE_N, NUM_STAGES), (cw, 0, 0))  # [256, 64, stages]
    acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE_M, TILE_N)), Float32)
    acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((TILE_M, HALF_V)), Float32)
    acc_o.fill(0.0)
    rP = cute.make_fragment_like(acc_s, sQ.element_type)
    return (tiled_mma_qk.make_fragment_A(thr_qk.partition_A(sQ)),
            tiled_mma_qk.make_fragment_B(thr_qk.partition_B(sKV)),
            tiled_mma_pv.make_fragment_A(thr_pv.partition_A(sP)),
            tiled_mma_pv.make_fragment_B(thr_pv.partition_B(sVt_w)),
            tiled_mma_pv_rs.make_fragment_B(thr_pv_rs.partition_B(sVt_w)),
            cute.make_tensor(rP.iterator, acc_as_a_operand(rP.layout)),
            thr_qk.partition_C(sP), acc_s, acc_o,
            thr_qk.partition_C(cute.make_identity_tensor((TILE_M, TILE_N))),
            thr_pv.partition_C(cute.make_identity_tensor((TILE_M, HALF_V))), rP)


@cute.jit
def other_tile_pv(cw: Int32, st: pipeline.PipelineState, wait_stage, release_stage, sMax: cute.Tensor, r0: Int32,
                  row_m: cute.Tensor, row_l: cute.Tensor, acc_o: cute.Tensor, tiled_mma_pv: cute.TiledMma,
                  tOrPs: cute.Tensor, tOrV: cute.Tensor, lazy: cutlass.Constexpr[bool] = False):
    """Steps a, b for the other consumer's tile (state st): wait for its P and m, rescale this consumer's
    O half and row sums to that m, O_w += P V_w, release the stage (`wait_stage(st)`, `release_stage(st)`:
    the kernel's own pipeline calls).

    Waited and released here, before this consumer waits for its own next tile: that tile's load can only
    start once both consumers have released the stage it reuses (this one, two tiles back), so a release
    held back behind a late load would delay the load after it too. The stage is already complete (its
    owner waited for it before S); waited here too so that this consumer's own reads of V are ordered after
    the load by the barrier itself."""
    other_tile_pv_issue(cw, st, wait_stage, sMax, r0, row_m, row_l, acc_o, tiled_mma_pv, tOrPs, tOrV, lazy)
    warpgroup.wait_group(0)
    release_stage(st)


@cute.jit
def other_tile_pv_issue(cw: Int32, st: pipeline.PipelineState, wait_stage, sMax: cute.Tensor, r0: Int32,
                        row_m: cute.Tensor, row_l: cute.Tensor, acc_o: cute.Tensor, tiled_mma_pv: cute.TiledMma,
                        tOrPs: cute.Tensor, tOrV: cute.Tensor, lazy: cutlass.Constexpr[bool] = False):
    """other_tile_pv's steps a, b up to the issue of O_w += P V_w: the caller waits for it (and releases the stage)
    after issuing its own next wgmma behind it. `lazy` (the owner's max moves by quad_row_max(lazy=True)): O_w's
    rescale skipped in warps where no row's max moved."""
    cute.arch.barrier(barrier_id=BAR_P_READY + 1 - cw, number_of_threads=CONSUMER_THREADS)
    wait_stage(st)
    alpha = cute.make_rmem_tensor(2, Float32)
    m_base = cute.make_rmem_tensor(2, Float32)
    for hr in cutlass.range_constexpr(2):
        move_row_max(row_m, row_l, alpha, m_base, hr, sMax[r0 + 8 * hr])
    rescale_rows(acc_o, alpha, lazy)
    issue_mma(tiled_mma_pv, acc_o, tOrPs, tOrV[None, None, None, st.index], False)


@dataclass(frozen=True)
class KVParts:
    """The KV ring of a kernel that loads each page as column parts (mla_decode.KV_PARTS): one TMA pipeline per
    part, each with its stages' full and empty barriers. Every use but S's waits and the producer's loads takes all
    parts at once, so it stands where the one pipeline of a whole page stood. A frozen dataclass, as the pipelines
    are, so that the DSL carries it through dynamic control flow."""
    pipes: tuple

    def consumer_wait(self, state: pipeline.PipelineState):
        for pipe in self.pipes:
            pipe.consumer_wait(state)

    def consumer_release(self, state: pipeline.PipelineState):
        for pipe in self.pipes:
            pipe.consumer_release(state)

    def producer_tail(self, state: pipeline.PipelineState):
        # each pipe's tail advances the state it is given through its stages: every pipe starts from a copy
        for pipe in self.pipes:
            pipe.producer_tail(state.clone())


@dataclass(frozen=True)
class KVSplit:
    """The KV ring of mla_decode.KV_SPLIT: each page in three parts, each freed by the one consumer that reads it last,
    so that the producer refills it while the rest of the page is still in use (FlashMLA frees and refills each
    64-column piece of a page as soon as it is read, bench/NOTES.md 107):
    - `rope`: columns 512..575 (the rope keys), NUM_STAGES stages, read only by the tile's S; freed by its owner
      once S is done;
    - `halves`: columns 256w..256w+255 (V's half w, also keys of S), 2 * NUM_STAGES barrier pairs, ring stage s's half
      w at 2s + w; freed by consumer w once its P V of the tile is done (the owner's S, which also reads it, is
      done before any P V of the tile starts).
    The halves' states are made from the ring's (half_state): their phase flips with the ring's."""
    rope: object
    halves: object

    def half_state(self, st: pipeline.PipelineState, w) -> pipeline.PipelineState:
        return pipeline.PipelineState(2 * NUM_STAGES, st.count, 2 * st.index + w, st.phase)

    def wait_half(self, st: pipeline.PipelineState, w):
        self.halves.consumer_wait(self.half_state(st, w))

    def release_half(self, st: pipeline.PipelineState, w):
        self.halves.consumer_release(self.half_state(st, w))

    def producer_tail(self, state: pipeline.PipelineState):
        # every stage's last arrivals: the rope's, then both halves' (each tail advances its own copy)
        self.rope.producer_tail(state.clone())
        for w in range(2):
            st = state.clone()
            for _ in range(NUM_STAGES):
                self.halves.sync_object_empty.wait(2 * st.index + w, st.phase)
                st.advance()


@cute.jit
def issue_k_blocks(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor, blocks,
                   zero_init: cutlass.Constexpr[bool]):
    """acc (+)= A B over the k-blocks `blocks` (a static sequence, in that order) as one committed wgmma group, not
    waited for: S's parts of mla_decode.KV_SPLIT, each issued once its columns have landed."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in blocks:
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


@cute.jit
def issue_mma_by_part(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor, pipes: tuple,
                      st: pipeline.PipelineState):
    """acc = A B as issue_mma(zero_init=True) does, the k-blocks in the same order, but each column part's k-blocks
    issued once that part's load has landed (pipes[p].consumer_wait): the first parts' wgmmas run while the later
    parts load. One committed group, not waited for."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, False)
    per_part = cute.size(tCrA.shape[2]) // len(pipes)
    for part in cutlass.range_constexpr(len(pipes)):
        pipes[part].consumer_wait(st)
        for k in cutlass.range_constexpr(part * per_part, (part + 1) * per_part):
            cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


@cute.jit
def issue_mma(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
              zero_init: cutlass.Constexpr[bool]):
    """acc (+)= A B over all k-blocks as one committed wgmma group, not waited for (the caller waits
    with warpgroup.wait_group before it reads acc or reuses the operands' smem)."""
    issue_k_blocks(tiled_mma, acc, tCrA, tCrB, tuple(range(cute.size(tCrA.shape[2]))), zero_init)


@cute.jit
def publish_row_sums(row_l: cute.Tensor, sSum: cute.Tensor, r0: Int32, cw: Int32, ctid: Int32, parity: Int32):
    """A consumer's final row sums (of its own tiles' P, at the final max): summed over the quad into
    sSum[row, cw, parity], then an arrival on its BAR_SUM_W barrier, which the other consumer waits on
    (take_row_sums). Published as soon as they are final, so that the consumer that ran the last tile
    normalizes and stores while the other still adds that tile's P V (2-3 k cycles an item of the H200's
    traces). The buffer alternates by item (`parity`): the other consumer reads this item's sums before it
    publishes the next item's, which this one waits for before publishing the one after."""
    for hr in cutlass.range_constexpr(2):
        row_l[hr] = row_l[hr] + cute.arch.shuffle_sync_bfly(row_l[hr], offset=1)
        row_l[hr] = row_l[hr] + cute.arch.shuffle_sync_bfly(row_l[hr], offset=2)
        if ctid % 4 == 0:
            sSum[r0 + 8 * hr, cw, parity] = row_l[hr]
    cute.arch.barrier_arrive(barrier_id=BAR_SUM_W + cw, number_of_threads=CONSUMER_THREADS)


@cute.jit
def take_row_sums(row_m: cute.Tensor, sSum: cute.Tensor, r0: Int32, cw: Int32, parity: Int32, inv_l: cute.Tensor,
                  lse: cute.Tensor):
    """After both consumers published (publish_row_sums): inv_l = 1 / the whole row sum and lse (natural log; 0
    and -inf for a row that saw no key)."""
    cute.arch.barrier(barrier_id=BAR_SUM_W + 1 - cw, number_of_threads=CONSUMER_THREADS)
    for hr in cutlass.range_constexpr(2):
        total = sSum[r0 + 8 * hr, 0, parity] + sSum[r0 + 8 * hr, 1, parity]
        inv_l[hr] = 0.0
        lse[hr] = -Float32.inf
        if total > 0.0:
            inv_l[hr] = 1.0 / total
            lse[hr] = (row_m[hr] + cute.math.log2(total, fastmath=False)) * math.log(2.0)


@cute.jit
def speculative_p(acc_s: cute.Tensor, row_m: cute.Tensor, row_l: cute.Tensor, rP: cute.Tensor, tPsP: cute.Tensor,
                  scale: Float32, tree: cutlass.Constexpr[bool]):
    """Step d with the lazy rescale, P exponentiated before the tile's max is known, and P's store of step e:
    acc_s holds the unscaled S (masked keys -inf); P = exp2(S scale - row_m) against the running max goes into rP
    (in its dtype, pairs packed as they are computed) and on into smem (tPsP), its row sums aside, while this
    thread's maxima of its two rows are folded from the same S. Where no thread of the warp saw a value more
    than LAZY_RESCALE_LOG2 above its row's running max (so the quad's max would not move the lazy max,
    quad_row_max(lazy=True)), that P stands: no shuffles, no move, alpha 1. Otherwise (a rise, or a row that has
    seen no key: -inf - -inf is NaN) the warp takes the default path from the same S, the quad's max and P
    against it, and stores that P over the first. -> alpha [2], O_w's rescale for step f. `scale`: the softmax scale
    in log2 units (acc_s holds S unscaled: the dense decode's FOLD_SCALE).

    Against the default order (max over the quad, then exponentials against it): the 32 MUFU.EX2 of a thread no
    longer wait for the max's fold, two shuffle rounds and the move, which the owner's softmax otherwise runs
    first while the tensor cores idle (bench/NOTES.md 92). P may differ from the default's in its last bit of the
    row sums (they are added in another order); it is the same P."""
    alpha = cute.make_rmem_tensor(2, Float32)
    sums = cute.make_rmem_tensor(2, Float32)
    pair = cute.make_rmem_tensor(2, Float32)
    for hr in cutlass.range_constexpr(2):
        alpha[hr] = 1.0
        sums[hr] = 0.0
    for j in cutlass.range_constexpr(cute.size(acc_s) // 2):
        for e in cutlass.range_constexpr(2):
            i = 2 * j + e
            p = cute.arch.exp2(acc_s[i] * scale - row_m[row_of(i)])     # one FFMA, then MUFU.EX2
            pair[e] = p
            sums[row_of(i)] = sums[row_of(i)] + p
        cute.make_tensor(rP.iterator + 2 * j, cute.make_layout(2)).store(pair.load().to(rP.element_type))
    # stored now, so that the stores and their swizzled addresses issue among the exponentials (after the vote
    # they would follow them)
    cute.autovec_copy(rP, tPsP)
    mx = cute.make_rmem_tensor(2, Float32)
    mx[0] = -Float32.inf
    mx[1] = -Float32.inf
    fold_row_max(acc_s, mx, tree)
    for hr in cutlass.range_constexpr(2):
        mx[hr] = mx[hr] * scale
    rise0 = mx[0] - row_m[0]
    rise1 = mx[1] - row_m[1]
    moved = (rise0 > LAZY_RESCALE_LOG2) | (rise0 != rise0) | (rise1 > LAZY_RESCALE_LOG2) | (rise1 != rise1)
    if cute.arch.vote_any_sync(moved):
        for hr in cutlass.range_constexpr(2):
            mx[hr] = cute.arch.fmax(row_m[hr], mx[hr])
        moved_alpha, m_base = quad_row_max(mx, row_m, row_l, True)
        alpha[0] = moved_alpha[0]
        alpha[1] = moved_alpha[1]
        exp_p(acc_s, m_base, row_l, rP, scale)
        cute.autovec_copy(rP, tPsP)
    else:
        for hr in cutlass.range_constexpr(2):
            row_l[hr] = row_l[hr] + sums[hr]
    return alpha
