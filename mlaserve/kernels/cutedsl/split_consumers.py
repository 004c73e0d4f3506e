"""The math of the "split" consumer pair that two CuTe DSL kernels share: the bf16/fp16 sparse MLA
(sparse_mla_kernel.py) and the FP8 sparse MLA (sparse_mla_fp8_kernel.py). (The bf16/fp16 dense decode,
mla_decode_kernel.py, and the bf16/fp16 sparse seesaw kernel, sparse_mla_seesaw_kernel.py, have the seesaw instead;
they share finish_rows, and the sparse one also move_row_max, exp_p, scale_rows, sparse_key_bias and store_sparse.)
All of them store whole 64-row blocks 16 bytes at a time after a transpose within each quad (store_block_16b;
store_dense_block and store_sparse wrap it).

Two consumer warpgroups (256 threads) share a 64-row tile: consumer w computes S_w for keys 32w..32w+32
of the tile (a wgmma m64n32 accumulator) and O_w for columns 256w..256w+256. Each thread of a wgmma m64
accumulator holds two rows, r0 and r0 + 8 (value index i: bit 1 picks the row, `(i // 2) % 2`), shared
with the three other lanes of its quad; value i = v0 + 2 v1 + 4 v2 sits in column pair v0, row half v1,
8-column group v2. The two consumers meet on named barriers BAR_MAX (row maxima, later row sums) and
BAR_P (P complete in smem). Everything here is inlined into the calling kernel at trace time: moving the
kernels' copies here left their SASS instruction for instruction the same (sm_90a, all six specializations).
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import dsl_user_op

BAR_MAX = 1           # named barriers (0 is __syncthreads)
BAR_P = 2
BAR_P_FREE = 4        # + w (one_barrier_p): consumer w may store its half of P, the other's P V before has read P
CONSUMER_THREADS = 256
HALF_V = 256          # columns of O per consumer
BLOCK_ROWS = 64       # query rows (heads) of a CTA
LAZY_RESCALE_LOG2 = 8.0  # quad_row_max(lazy=True): how far (log2 units) a row's max may rise before it moves


def row_of(i: int) -> int:
    """Which of a thread's two accumulator rows value i belongs to."""
    return (i // 2) % 2


def key_of(i: int) -> int:
    """Which of a thread's distinct keys (S columns) value i = v0 + 2 v1 + 4 v2 belongs to: j = v0 + 2 v2,
    half as many as its values."""
    return (i % 2) + 2 * (i // 4)


def split_tiled_mmas(dtype):
    """The pair's two MMAs for 16-bit operands: S_w = Q K_w^T at m64n32 (both K-major) and O_w += P V_w at
    m64n256 (V read as MN-major B from the K-major cache tile)."""
    qk = sm90_utils.make_trivial_tiled_mma(dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
                                           Float32, (1, 1, 1), (64, 32))
    pv = sm90_utils.make_trivial_tiled_mma(dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
                                           Float32, (1, 1, 1), (64, HALF_V))
    return qk, pv


@cute.jit
def sparse_key_bias(bias: cute.Tensor, tScS: cute.Tensor, key0: Int32, end: Int32, mIdx: cute.Tensor,
                    token: Int32):
    """bias[j] = 0 or -inf for each distinct key j (key_of) of this thread's S values: -inf where the
    key's position key0 + column is past `end` or its index mIdx[token, position] is -1."""
    for i in cutlass.range_constexpr(cute.size(tScS)):
        if const_expr(row_of(i) == 0):
            j = key_of(i)
            pos = key0 + tScS[i][1]
            bias[j] = -Float32.inf
            if pos < end:
                if mIdx[token, pos] >= 0:
                    bias[j] = 0.0


@cute.jit
def rescale_to_tile_max(acc_s: cute.Tensor, row_m: cute.Tensor, row_l: cute.Tensor, alpha: cute.Tensor,
                        m_base: cute.Tensor, s_max: cute.Tensor, r0: Int32, cw: Int32, ctid: Int32):
    """The online-softmax step of one tile (S in log2 units in acc_s): the rows' maxima over this consumer's
    keys (quad shuffles), exchanged with the other consumer through s_max [64, 2] and BAR_MAX; then the new
    running max row_m, alpha = exp2(old - new), row_l *= alpha, and m_base (move_row_max)."""
    mx = cute.make_rmem_tensor(2, Float32)
    mx[0] = -Float32.inf
    mx[1] = -Float32.inf
    fold_row_max(acc_s, mx)
    for hr in cutlass.range_constexpr(2):
        mx[hr] = cute.arch.fmax(mx[hr], cute.arch.shuffle_sync_bfly(mx[hr], offset=1))
        mx[hr] = cute.arch.fmax(mx[hr], cute.arch.shuffle_sync_bfly(mx[hr], offset=2))
        if ctid % 4 == 0:
            s_max[r0 + 8 * hr, cw] = mx[hr]
    cute.arch.barrier(barrier_id=BAR_MAX, number_of_threads=CONSUMER_THREADS)
    for hr in cutlass.range_constexpr(2):
        move_row_max(row_m, row_l, alpha, m_base, hr,
                     cute.arch.fmax(row_m[hr], cute.arch.fmax(mx[hr], s_max[r0 + 8 * hr, 1 - cw])))


@cute.jit
def fold_row_max(acc_s: cute.Tensor, mx: cute.Tensor, tree: cutlass.Constexpr[bool] = False):
    """mx[r] = max(mx[r], this thread's values of row r in acc_s), for its two rows. `tree`: each row's values
    folded pairwise (depth log2 n, not a chain of n dependent FMNMX), then mx[r] folded in; the same maxima."""
    if const_expr(not tree):
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            mx[row_of(i)] = cute.arch.fmax(mx[row_of(i)], acc_s[i])
    else:
        for hr in cutlass.range_constexpr(2):
            mx[hr] = cute.arch.fmax(mx[hr], _tree_max([acc_s[i] for i in range(cute.size(acc_s)) if row_of(i) == hr]))


def _tree_max(vals: list):
    """The max of traced values, folded pairwise (plain Python at trace time: the DSL rewrites loops only in
    cute.jit functions)."""
    if len(vals) == 1:
        return vals[0]
    half = len(vals) // 2
    return cute.arch.fmax(_tree_max(vals[:half]), _tree_max(vals[half:]))


@cute.jit
def quad_row_max(mx: cute.Tensor, row_m: cute.Tensor, row_l: cute.Tensor, lazy: cutlass.Constexpr[bool] = False):
    """The seesaw consumers' step d: mx [2] (this thread's maxima of its two rows, the running max folded
    in) reduced over the quad that shares the rows, then move_row_max -> (alpha, m_base), each [2].

    `lazy`: a row keeps its running max unless the new one exceeds it by more than LAZY_RESCALE_LOG2 (so P
    stays <= 2^LAZY_RESCALE_LOG2, exact in fp32 sums and bf16 / fp16 operands alike), which leaves alpha
    exactly 1 on most tiles, so that rescale_rows skips O's rescale; the first finite max is always taken."""
    alpha = cute.make_rmem_tensor(2, Float32)
    m_base = cute.make_rmem_tensor(2, Float32)
    for hr in cutlass.range_constexpr(2):
        mx[hr] = cute.arch.fmax(mx[hr], cute.arch.shuffle_sync_bfly(mx[hr], offset=1))
        mx[hr] = cute.arch.fmax(mx[hr], cute.arch.shuffle_sync_bfly(mx[hr], offset=2))
        if const_expr(lazy):
            # -inf - -inf is NaN, which compares false: a row that has seen no key takes the new max
            if mx[hr] - row_m[hr] <= LAZY_RESCALE_LOG2:
                mx[hr] = row_m[hr]
        move_row_max(row_m, row_l, alpha, m_base, hr, mx[hr])
    return alpha, m_base


@cute.jit
def move_row_max(row_m: cute.Tensor, row_l: cute.Tensor, alpha: cute.Tensor, m_base: cute.Tensor,
                 hr: cutlass.Constexpr[int], m_new: Float32):
    """Row hr's running max row_m[hr] to m_new: alpha[hr] = exp2(old - new), row_l[hr] *= alpha[hr]. m_base[hr]
    is the max to exponentiate against: 0 for a row that has seen no key yet (its m stays -inf), so that
    its P is 0, not NaN."""
    m_base[hr] = m_new
    if m_new == -Float32.inf:
        m_base[hr] = 0.0
    alpha[hr] = cute.arch.exp2(row_m[hr] - m_base[hr])
    row_m[hr] = m_new
    row_l[hr] = row_l[hr] * alpha[hr]


@cute.jit
def exp_p(acc_s: cute.Tensor, m_base: cute.Tensor, row_l: cute.Tensor, rP: cute.Tensor, scale=None):
    """P = exp2(S - m_base) in place in acc_s (S in log2 units) and in rP's dtype in rP, its rows' sums
    added into row_l. With `scale`, acc_s holds the unscaled S and P = exp2(S scale - m_base), one FFMA a value."""
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        if const_expr(scale is None):
            x = acc_s[i] - m_base[row_of(i)]
        else:
            x = acc_s[i] * scale - m_base[row_of(i)]     # contracted to one FFMA
        p = cute.arch.exp2(x)
        acc_s[i] = p
        row_l[row_of(i)] = row_l[row_of(i)] + p
    rP.store(acc_s.load().to(rP.element_type))


@cute.jit
def publish_p(acc_s: cute.Tensor, m_base: cute.Tensor, row_l: cute.Tensor, rP: cute.Tensor, tPsP: cute.Tensor):
    """P_w = exp2(S_w - m) (added into row_l) -> smem as this consumer's 32 columns of P, made visible to
    wgmma's async proxy, then BAR_P: after it both halves of P are in smem."""
    exp_p(acc_s, m_base, row_l, rP)
    cute.autovec_copy(rP, tPsP)
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=BAR_P, number_of_threads=CONSUMER_THREADS)


@cute.jit
def one_barrier_p(acc_s: cute.Tensor, row_m: cute.Tensor, row_l: cute.Tensor, alpha: cute.Tensor,
                  m_base: cute.Tensor, rP: cute.Tensor, tPsP: cute.Tensor, s_max: cute.Tensor, r0: Int32, cw: Int32,
                  ctid: Int32, wait_free) -> Int32:
    """rescale_to_tile_max and publish_p on one barrier a page where no row's max rises by more than
    LAZY_RESCALE_LOG2 (quad_row_max's lazy rule), which after the first page is nearly every page.

    P_w = exp2(S_w - m_base) against the running max goes into rP while this thread's maxima of its two rows are
    folded from the same S (acc_s, in log2 units, kept). Once the other consumer's P V of the page before has
    read P (BAR_P_FREE + cw, which the caller's arrive_p_free opens; skipped where `wait_free` is false, on the
    first page), P_w goes into smem and both consumers meet on BAR_P once, with an OR of "some value of mine rose
    by more than LAZY_RESCALE_LOG2 above its row's running max" (a row with no key yet has max -inf: any finite
    value rises). None rose: that P stands, row_l takes its sums, the running max stays, alpha is 1 and O needs
    no rescale. Some rose (every thread of both consumers sees the same answer): the split pair's two-barrier
    step from the same S, rescale_to_tile_max then publish_p, P stored over the first. -> 1 where O_w needs
    scale_rows(acc_o, alpha), else 0.

    Against the two barriers every page: one exchange of the two consumers a page instead of two (the maxima's
    smem round trip, its shuffles and the move gone), O's rescale gone. The running max is lazy, so the bits
    differ from the exact max's; P <= 2^LAZY_RESCALE_LOG2 stays exact in bf16 and the fp32 sums."""
    sums = cute.make_rmem_tensor(2, Float32)
    pair = cute.make_rmem_tensor(2, Float32)
    sums[0] = 0.0
    sums[1] = 0.0
    for j in cutlass.range_constexpr(cute.size(acc_s) // 2):
        for e in cutlass.range_constexpr(2):
            i = 2 * j + e
            p = cute.arch.exp2(acc_s[i] - m_base[row_of(i)])
            pair[e] = p
            sums[row_of(i)] = sums[row_of(i)] + p
        cute.make_tensor(rP.iterator + 2 * j, cute.make_layout(2)).store(pair.load().to(rP.element_type))
    mx = cute.make_rmem_tensor(2, Float32)
    mx[0] = -Float32.inf
    mx[1] = -Float32.inf
    fold_row_max(acc_s, mx)
    # -inf - -inf (no key yet, none in this page) is NaN, which compares false: its P is exp2(-inf - 0) = 0
    rose = Int32(0)
    if (mx[0] - row_m[0] > LAZY_RESCALE_LOG2) | (mx[1] - row_m[1] > LAZY_RESCALE_LOG2):
        rose = Int32(1)
    if wait_free:
        cute.arch.barrier(barrier_id=BAR_P_FREE + cw, number_of_threads=CONSUMER_THREADS)
    cute.autovec_copy(rP, tPsP)
    cute.arch.fence_proxy("async.shared", space="cta")
    moved = barrier_any(rose, BAR_P, CONSUMER_THREADS)
    if moved != 0:
        rescale_to_tile_max(acc_s, row_m, row_l, alpha, m_base, s_max, r0, cw, ctid)
        publish_p(acc_s, m_base, row_l, rP, tPsP)
    else:
        row_l[0] = row_l[0] + sums[0]
        row_l[1] = row_l[1] + sums[1]
    return moved


@cute.jit
def arrive_p_free(cw: Int32):
    """After this consumer's P V of a page has been waited for: the other consumer may store its half of the next
    page's P (one_barrier_p's BAR_P_FREE)."""
    cute.arch.barrier_arrive(barrier_id=BAR_P_FREE + 1 - cw, number_of_threads=CONSUMER_THREADS)


@dsl_user_op
def barrier_any(pred: Int32, barrier_id: int, threads: int, *, loc=None, ip=None) -> Int32:
    """Named barrier `barrier_id` over `threads` threads as cute.arch.barrier (bar.red waits and orders memory as
    bar.sync), which also returns in every one of them 1 if any thread's `pred` is non-zero, else 0."""
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Int32(pred).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred q, p;\nsetp.ne.b32 q, $1, 0;\n"
        f"bar.red.or.pred p, {barrier_id}, {threads}, q;\n"
        "selp.b32 $0, 1, 0, p;\n}\n", "=r,r,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def scale_rows(acc_o: cute.Tensor, alpha: cute.Tensor):
    """O_w *= alpha per row."""
    for i in cutlass.range_constexpr(cute.size(acc_o)):
        acc_o[i] = acc_o[i] * alpha[row_of(i)]


@cute.jit
def rescale_rows(acc_o: cute.Tensor, alpha: cute.Tensor, lazy: cutlass.Constexpr[bool]):
    """O_w *= alpha per row before a P V: with `lazy` (the max moved by quad_row_max(lazy=True)), only where some
    row of the warp moved its max (alpha != 1), a warp-uniform branch around the FMULs."""
    if const_expr(lazy):
        if cute.arch.vote_any_sync((alpha[0] != 1.0) | (alpha[1] != 1.0)):
            scale_rows(acc_o, alpha)
    else:
        scale_rows(acc_o, alpha)


@cute.jit
def finish_rows(row_m: cute.Tensor, row_l: cute.Tensor, s_sum: cute.Tensor, r0: Int32, cw: Int32, ctid: Int32,
                inv_l: cute.Tensor, lse: cute.Tensor, barrier_id: cutlass.Constexpr[int] = BAR_MAX):
    """After the last tile: the rows' whole sums (quad shuffles, then both consumers through s_sum [64, 2]
    and named barrier `barrier_id`) -> inv_l = 1 / sum and lse = natural-log logsumexp (0 and -inf for a row
    with no key). Both consumers' row_l must be at the same final max row_m. s_sum may be the maxima's
    buffer: the other consumer read this one's maxima before the last BAR_P. (The seesaw kernels pass their
    own barrier: their ids 1 and 2 are the per-consumer "P ready" barriers.)"""
    for hr in cutlass.range_constexpr(2):
        row_l[hr] = row_l[hr] + cute.arch.shuffle_sync_bfly(row_l[hr], offset=1)
        row_l[hr] = row_l[hr] + cute.arch.shuffle_sync_bfly(row_l[hr], offset=2)
        if ctid % 4 == 0:
            s_sum[r0 + 8 * hr, cw] = row_l[hr]
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=CONSUMER_THREADS)
    for hr in cutlass.range_constexpr(2):
        total = s_sum[r0 + 8 * hr, 0] + s_sum[r0 + 8 * hr, 1]
        inv_l[hr] = 0.0
        lse[hr] = -Float32.inf
        if total > 0.0:
            inv_l[hr] = 1.0 / total
            lse[hr] = (row_m[hr] + cute.math.log2(total, fastmath=False)) * math.log(2.0)


@cute.jit
def store_sparse(acc_o: cute.Tensor, inv_l: cute.Tensor, lse: cute.Tensor, tOcO: cute.Tensor, r0: Int32,
                 cw: Int32, ctid: Int32, head0: Int32, h: Int32, token: Int32, split: Int32, mOut: cute.Tensor,
                 mLse: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, is_split: cutlass.Constexpr[bool],
                 store16: cutlass.Constexpr[bool] = False):
    """The sparse kernels' epilogue: heads head0 + row (< h) of `token`, O_w normalized into out [tokens, h,
    512] (out's dtype) and lse into [tokens, h], or fp32 into the split partials [splits, tokens, h, ...].
    `store16`: a block of 64 heads goes out in 16-byte stores (store_block_16b), value by value otherwise."""
    if const_expr(store16):
        if head0 + BLOCK_ROWS <= h:
            if const_expr(is_split):
                # partials [splits, tokens, h, 512] fp32
                store_block_16b(acc_o, inv_l, mPO.iterator.toint(), Int64((split * mPO.shape[1] + token) * h + head0),
                                r0, cw, ctid, "f32")
            else:
                store_block_16b(acc_o, inv_l, mOut.iterator.toint(), Int64(token * h + head0), r0, cw, ctid,
                                "bf16" if const_expr(mOut.element_type == cutlass.BFloat16) else "f16")
        else:
            _store_values(acc_o, inv_l, tOcO, cw, head0, h, token, split, mOut, mPO, is_split)
    else:
        _store_values(acc_o, inv_l, tOcO, cw, head0, h, token, split, mOut, mPO, is_split)
    if cw == 0 and ctid % 4 == 0:
        for hr in cutlass.range_constexpr(2):
            head = head0 + r0 + 8 * hr
            if head < h:
                if const_expr(is_split):
                    mPL[split, token, head] = lse[hr]
                else:
                    mLse[token, head] = lse[hr]


@cute.jit
def _store_values(acc_o: cute.Tensor, inv_l: cute.Tensor, tOcO: cute.Tensor, cw: Int32, head0: Int32, h: Int32,
                  token: Int32, split: Int32, mOut: cute.Tensor, mPO: cute.Tensor, is_split: cutlass.Constexpr[bool]):
    """store_sparse's values one by one (heads past h left out)."""
    for i in cutlass.range_constexpr(cute.size(acc_o)):
        head = head0 + tOcO[i][0]
        if head < h:
            val = acc_o[i] * inv_l[row_of(i)]
            col = cw * HALF_V + tOcO[i][1]
            if const_expr(is_split):
                mPO[split, token, head, col] = val
            else:
                mOut[token, head, col] = val.to(mOut.element_type)


@cute.jit
def store_dense_block(acc_o: cute.Tensor, inv_l: cute.Tensor, mOut: cute.Tensor, mPO: cute.Tensor, batch: Int32,
                      split: Int32, m_block: Int32, rows: Int32, r0: Int32, cw: Int32, ctid: Int32,
                      is_split: cutlass.Constexpr[bool], out_type: cutlass.Constexpr[str]):
    """The dense decode kernels' whole 64-row block m_block of a request: O into out [b, rows, 512] (out_type
    "bf16" / "f16"), or the fp32 partials [b, splits, rows, 512] of its split, in 16-byte stores."""
    if const_expr(is_split):
        store_block_16b(acc_o, inv_l, mPO.iterator.toint(),
                        Int64((batch * mPO.shape[1] + split) * rows + m_block * BLOCK_ROWS), r0, cw, ctid, "f32")
    else:
        store_block_16b(acc_o, inv_l, mOut.iterator.toint(), Int64(batch * rows + m_block * BLOCK_ROWS), r0, cw,
                        ctid, out_type)


@cute.jit
def store_dense_lse(lse: cute.Tensor, mLse: cute.Tensor, mPL: cute.Tensor, batch: Int32, split: Int32,
                    m_block: Int32, rows: Int32, r0: Int32, cw: Int32, ctid: Int32, is_split: cutlass.Constexpr[bool]):
    """The dense decode kernels' lse of the thread's two rows of block m_block (one thread a quad of consumer 0),
    into lse [b, rows] or the split's partial lse [b, splits, rows]; rows past the request's `rows` left out."""
    if cw == 0 and ctid % 4 == 0:
        for hr in cutlass.range_constexpr(2):
            r = m_block * BLOCK_ROWS + r0 + 8 * hr
            if r < rows:
                if const_expr(is_split):
                    mPL[batch, split, r] = lse[hr]
                else:
                    mLse[batch, r] = lse[hr]


@cute.jit
def store_block_16b(acc_o: cute.Tensor, inv_l: cute.Tensor, out_base: Int64, first_row: Int64, r0: Int32, cw: Int32,
                    ctid: Int32, out_type: cutlass.Constexpr[str]):
    """A consumer's O half of a whole 64-row block, normalized, into an output of 512 columns a row ("bf16",
    "f16", or "f32" for split partials): rows first_row .. first_row + 63 of the output at address out_base
    (16-byte aligned), in 16-byte stores (store_rows_16b, store_rows_16b_f32). acc_o is scaled in place."""
    for i in cutlass.range_constexpr(cute.size(acc_o)):
        acc_o[i] = acc_o[i] * inv_l[row_of(i)]
    width = 4 if const_expr(out_type == "f32") else 2
    row_addr = cute.make_rmem_tensor(2, Int64)
    for hr in cutlass.range_constexpr(2):
        row_addr[hr] = out_base + ((first_row + r0 + 8 * hr) * (2 * HALF_V) + cw * HALF_V) * width
    if const_expr(out_type == "f32"):
        store_rows_16b_f32(acc_o, row_addr, ctid % 4)
    else:
        store_rows_16b(acc_o, row_addr, ctid % 4, out_type == "bf16")


@cute.jit
def store_rows_16b_f32(acc_o: cute.Tensor, row_addr: cute.Tensor, q: Int32):
    """store_rows_16b for fp32 (split partials): the 8 bytes a lane holds per row and column group are half a
    16-byte store, so lanes q and q ^ 1 swap a group: for each row half and each pair of groups 2n, 2n + 1,
    lane q keeps group 2n + (q & 1) and stores its columns 4 (q >> 1) .. + 3, its own 8 bytes and its
    partner's. Half the store instructions of the accumulator's 8-byte pairs."""
    lane_col = (8 * (q % 2) + 4 * (q // 2)) * 4
    for hr in cutlass.range_constexpr(2):
        for n in cutlass.range_constexpr(HALF_V // 16):
            v = [acc_o[4 * (2 * n + j) + 2 * hr + e] for j in range(2) for e in range(2)]
            _swap_pairs_store(v, row_addr[hr] + Int64(16 * n * 4 + lane_col), q)


@dsl_user_op
def _swap_pairs_store(v: list, addr: Int64, q: Int32, *, loc=None, ip=None) -> None:
    """v: 4 fp32, this lane's pairs of groups 2n (v[0:2]) and 2n + 1 (v[2:4]); lane q keeps the pair of group
    2n + (q & 1), sends the other to lane q ^ 1 and stores its own and the received pair, the even lane's
    first, as 16 bytes at `addr`."""
    llvm.inline_asm(
        None,
        [*(Float32(x).ir_value(loc=loc, ip=ip) for x in v), Int64(addr).ir_value(loc=loc, ip=ip),
         Int32(q).ir_value(loc=loc, ip=ip)],
        "{\n"
        ".reg .pred pb;\n"
        ".reg .b32 a0, a1, b0, b1, t, k0, k1, s0, s1, r0, r1, o0, o1, o2, o3;\n"
        "mov.b32 a0, $0;\n"
        "mov.b32 a1, $1;\n"
        "mov.b32 b0, $2;\n"
        "mov.b32 b1, $3;\n"
        "and.b32 t, $5, 1;\n"
        "setp.ne.b32 pb, t, 0;\n"
        "selp.b32 k0, b0, a0, pb;\n"
        "selp.b32 k1, b1, a1, pb;\n"
        "selp.b32 s0, a0, b0, pb;\n"
        "selp.b32 s1, a1, b1, pb;\n"
        "shfl.sync.bfly.b32 r0, s0, 1, 31, -1;\n"
        "shfl.sync.bfly.b32 r1, s1, 1, 31, -1;\n"
        "selp.b32 o0, r0, k0, pb;\n"
        "selp.b32 o1, r1, k1, pb;\n"
        "selp.b32 o2, k0, r0, pb;\n"
        "selp.b32 o3, k1, r1, pb;\n"
        "st.global.v4.b32 [$4], {o0, o1, o2, o3};\n"
        "}\n",
        "f,f,f,f,l,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def store_rows_16b(acc_o: cute.Tensor, row_addr: cute.Tensor, q: Int32, bf16: cutlass.Constexpr[bool]):
    """A consumer's normalized [64, 256] O half into global memory in 16-byte stores: value i = v0 + 2 v1 + 4 v2
    sits in row half v1, column 8 v2 + 2 q + v0 (q = lane % 4), so a quad's four lanes hold the 16 bytes of
    columns 8 v2 .. 8 v2 + 7 of a row between them, 4 bytes each. For each row half and each 4 column groups
    4m .. 4m + 3 the quad transposes its 4 x 4 words by shuffles and lane q stores group 4m + q whole.
    row_addr [2]: the byte addresses of the thread's two rows at its consumer's first column (16-byte
    aligned). Against a 4-byte store per pair (the accumulator's own layout): a quarter of the store
    instructions, each writing whole 32-byte sectors."""
    for hr in cutlass.range_constexpr(2):
        for m in cutlass.range_constexpr(HALF_V // 32):
            v = [acc_o[4 * (4 * m + j) + 2 * hr + e] for j in range(4) for e in range(2)]
            _pack_transpose_store(v, row_addr[hr] + Int64((32 * m + 8 * q) * 2), q, bf16)


@dsl_user_op
def _pack_transpose_store(v: list, addr: Int64, q: Int32, bf16: bool, *, loc=None, ip=None) -> None:
    """v: 8 fp32, the words w_j = (v[2j], v[2j + 1]) of this lane's column groups 4m + j; packed to bf16x2
    (fp16x2), transposed across the quad (lane q ends with w_q of lanes 0..3: two shuffle rounds, xor 2
    then xor 1, each keeping the half of the words whose index bit matches the lane's and swapping the
    other; selects put them in lane order) and stored as 16 bytes at `addr`."""
    cvt = "cvt.rn.bf16x2.f32" if bf16 else "cvt.rn.f16x2.f32"
    llvm.inline_asm(
        None,
        [*(Float32(x).ir_value(loc=loc, ip=ip) for x in v), Int64(addr).ir_value(loc=loc, ip=ip),
         Int32(q).ir_value(loc=loc, ip=ip)],
        "{\n"
        ".reg .pred pa, pb;\n"
        ".reg .b32 w0, w1, w2, w3, t, s0, s1, k0, k1, r0, r1, ka, kb, sa, sb, ra, rb, u0, u1, u2, u3, o0, o1, o2, o3;\n"
        f"{cvt} w0, $1, $0;\n"
        f"{cvt} w1, $3, $2;\n"
        f"{cvt} w2, $5, $4;\n"
        f"{cvt} w3, $7, $6;\n"
        "and.b32 t, $9, 2;\n"
        "setp.ne.b32 pa, t, 0;\n"
        "and.b32 t, $9, 1;\n"
        "setp.ne.b32 pb, t, 0;\n"
        # xor 2: keep the words whose index bit 1 is the lane's (k), send the others (s), receive the partner's r
        "selp.b32 s0, w0, w2, pa;\n"
        "selp.b32 s1, w1, w3, pa;\n"
        "selp.b32 k0, w2, w0, pa;\n"
        "selp.b32 k1, w3, w1, pa;\n"
        "shfl.sync.bfly.b32 r0, s0, 2, 31, -1;\n"
        "shfl.sync.bfly.b32 r1, s1, 2, 31, -1;\n"
        # xor 1 on index bit 0: ka, kb = word q of lanes q and q ^ 2; ra, rb = of lanes q ^ 1 and q ^ 3
        "selp.b32 ka, k1, k0, pb;\n"
        "selp.b32 kb, r1, r0, pb;\n"
        "selp.b32 sa, k0, k1, pb;\n"
        "selp.b32 sb, r0, r1, pb;\n"
        "shfl.sync.bfly.b32 ra, sa, 1, 31, -1;\n"
        "shfl.sync.bfly.b32 rb, sb, 1, 31, -1;\n"
        # lane order: the word of lane p sits at p ^ q among (ka, ra, kb, rb)
        "selp.b32 u0, ra, ka, pb;\n"
        "selp.b32 u1, ka, ra, pb;\n"
        "selp.b32 u2, rb, kb, pb;\n"
        "selp.b32 u3, kb, rb, pb;\n"
        "selp.b32 o0, u2, u0, pa;\n"
        "selp.b32 o1, u3, u1, pa;\n"
        "selp.b32 o2, u0, u2, pa;\n"
        "selp.b32 o3, u1, u3, pa;\n"
        "st.global.v4.b32 [$8], {o0, o1, o2, o3};\n"
        "}\n",
        "f,f,f,f,f,f,f,f,l,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
