"""The dense MLA decode in Gluon for 64-row blocks over bf16 page-64 caches, as a seesaw (FlashMLA's Hopper
schedule, as the CuTe kernel runs it): what the triton backend runs instead of mla_decode_gluon.py's serial page
chain where SEESAW is on (bf16 KV; FP8 KV keeps that kernel).

mla_decode_gluon.py's 8 compute warps run each page in series: S (each warpgroup 32 of its 64 keys), a row max
across the two warpgroups, P to shared memory, P V, and only then the next page; the tensor cores idle through
the softmax, and at h 64 the chain (~2.9 us a page an SM) is longer than the page's HBM time (bench/NOTES.md
items 27, 78). Here the two compute warpgroups (partitions of 4 warps) own alternate pages t (t % 2 == w, ring
stage w) and columns 256 w .. 256 w + 255 of O. For its own page t, consumer w:
  a. waits for P(t - 1) from the other consumer and reads m(t - 1), the running row max it was taken against;
  b. rescales its O half and row sums to m(t - 1), adds P(t - 1) V_{t - 1} (its column half, P from shared
     memory), waits, and releases stage t - 1;
  c. waits for page t and computes the whole S = Q K_t^T ([64, 64], K = 576);
  d. the softmax against m(t - 1): m(t), P(t), its own row sums;
  e. zeroes V rows past the request's end (last page), stores P(t) and m(t), and tells the other consumer;
  f. rescales its O half to m(t), adds P(t) V_t (P from registers), waits, and releases stage t.
So one consumer's softmax runs while the other's S and P V keep the tensor cores busy. One P buffer suffices:
P(t) is read from shared memory only by the other consumer (step b), which writes P(t + 1) only after that read
was waited for; m(t) likewise. Each consumer's row sums cover its own pages' P; at the end both are at the last
page's max and are added through shared memory, and each consumer stores its own half of O (the fp32 split
partials with splits; mla_decode.combine_splits reduces them).

Shared memory: Q [64, 576], two stages [64, 576], P [64, 64] (bf16), the maxima and row sums: 230544 bytes of the
232448 a CTA may use, as the serial kernel. With two stages, page t + 1 loads only once page t - 1 is released by
both consumers, so the order above keeps every release ahead of the next wait for a page: queueing S behind the
other page's P V (0.91-1.02x) or issuing it before the wait for P(t - 1) (0.78-0.87x) measured slower.

Measured on the H200 (bench/NOTES.md item 80): 1.07-1.19x the serial kernel (b128 h64 s_k 4k-32k, h128, s_q 2 h128,
b1/b4 h128 at 32k); in the benchmark h64 s_q 1 at 3.80-3.97 TB/s (89-93% of the copy bandwidth) and h128 at 502-534
TFLOP/s, 0.94-1.09x FlashInfer's fa3 kernel at fixed lengths, 1.08-1.31x at variable ones.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from mlaserve.kernels.triton.mla_decode_gluon import (_load_partition, finish_rows, program_item, softmax_rows_on_m,
                                                      split_and_visibility, split_pages, zero_rows_from)

BLOCK_M = gl.constexpr(64)
PAGE = gl.constexpr(64)
D_QK = gl.constexpr(576)
D_V = gl.constexpr(512)
HALF_V = gl.constexpr(256)
BOX = gl.constexpr(64)
LOG2E = gl.constexpr(1.4426950408889634)
STAGES = gl.constexpr(2)

# the triton backend's bf16 64-row decode through this kernel (False: mla_decode_gluon.py's serial one; for A/B
# runs with scripts/decode_ab.py --switch GLUON_SEESAW)
SEESAW = True
# each consumer's half of O (not the fp32 split partials: 0.96-0.97x at b 1/4 h 128) stored 16 bytes a thread
# after a pass through its ring stage, instead of from the accumulator's layout (1.00-1.03x at b 128, h 64/128)
STORE_16B = True


@gluon.jit
def _consumer(q_smem, qpe_smem, kv_smem, kpe_smem, p_smem, m_smem, l_smem, q_bar, ready, empty, p_full, l_bar,
              seqlens_ptr, qk_scale, b, split, num_splits, tile, H, S_Q, ROWS, out_ptr, lse_ptr, po_ptr, pl_ptr,
              stride_pob, stride_pos, CAUSAL: gl.constexpr, IS_SPLIT: gl.constexpr, DTYPE: gl.constexpr,
              STORE_16B: gl.constexpr, W: gl.constexpr):
    """Consumer warpgroup W: pages W, W + 2, ... of the split (steps a-f of the module docstring), then its half of
    O normalized and stored (consumer 0 also stores lse)."""
    L_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    L_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    ROW_S: gl.constexpr = gl.SliceLayout(1, L_S)
    ROW_O: gl.constexpr = gl.SliceLayout(1, L_O)
    m_cur = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)     # the max O and l are relative to
    l_w = gl.zeros([BLOCK_M], gl.float32, ROW_S)                       # row sums of this consumer's pages' P
    acc = gl.zeros([BLOCK_M, HALF_V], gl.float32, L_O)
    seqlen, start, n_tiles, vis, min_vis = split_and_visibility(
        seqlens_ptr, b, split, num_splits, tile * BLOCK_M + gl.arange(0, BLOCK_M, ROW_S), H, S_Q, CAUSAL)
    mbarrier.wait(q_bar, 0)
    if W == 0:
        if n_tiles > 0:
            acc, l_w, m_cur = _own_page(q_smem, qpe_smem, kv_smem, kpe_smem, p_smem, m_smem, ready, empty, p_full,
                                        acc, l_w, m_cur, 0, start, seqlen, vis, min_vis, qk_scale, L_S, L_O, DTYPE,
                                        W)
    for t in range(2 - W, n_tiles, 2):
        acc, l_w, m_cur = _other_page(kv_smem, p_smem, m_smem, empty, p_full, acc, l_w, m_cur, t - 1, L_O, ROW_S, W)
        acc, l_w, m_cur = _own_page(q_smem, qpe_smem, kv_smem, kpe_smem, p_smem, m_smem, ready, empty, p_full, acc,
                                    l_w, m_cur, t, start, seqlen, vis, min_vis, qk_scale, L_S, L_O, DTYPE, W)
    if n_tiles > 0:
        if (n_tiles - 1) % 2 != W:
            acc, l_w, m_cur = _other_page(kv_smem, p_smem, m_smem, empty, p_full, acc, l_w, m_cur, n_tiles - 1,
                                          L_O, ROW_S, W)
    # both consumers are at the last page's max: add the row sums
    l_smem.index(W).store(l_w)
    gl.thread_barrier()
    mbarrier.arrive(l_bar)
    mbarrier.wait(l_bar, 0)
    l_i = l_w + l_smem.index(1 - W).load(ROW_S)
    inv_l, lse = finish_rows(m_cur, l_i, ROW_O)
    o = acc * inv_l[:, None]
    rows = tile * BLOCK_M + gl.arange(0, BLOCK_M, ROW_O)
    row_ok = rows < ROWS
    if IS_SPLIT:
        _store_half(o, kv_smem.index(W), po_ptr + b.to(gl.int64) * stride_pob + split * stride_pos, tile * BLOCK_M,
                    ROWS, L_O, False, W)
        if W == 0:
            gl.store(pl_ptr + b * (num_splits * ROWS) + split * ROWS + rows, lse, mask=row_ok)
    else:
        _store_half(o.to(DTYPE), kv_smem.index(W), out_ptr + b.to(gl.int64) * ROWS * D_V, tile * BLOCK_M, ROWS, L_O,
                    STORE_16B, W)
        if W == 0:
            gl.store(lse_ptr + b * ROWS + rows, lse, mask=row_ok)


@gluon.jit
def _store_half(o, stage, base, row0, ROWS, L_O: gl.constexpr, STORE_16B: gl.constexpr, W: gl.constexpr):
    """Consumer W's half of O ([64, 256]: out's dtype or fp32) into base + row * 512 + 256 W + column, rows past ROWS
    left out. STORE_16B: through ring stage W (free once both consumers' last P V is done and the row sums are
    exchanged) into a layout of 16 contiguous bytes a thread, a warp along a row, so that every store is 16 bytes;
    otherwise from the accumulator's layout (2 adjacent values a thread and row)."""
    if STORE_16B:
        VEC: gl.constexpr = 128 // o.dtype.primitive_bitwidth
        L: gl.constexpr = gl.BlockedLayout([1, VEC], [1, 32], [4, 1], [1, 0])
        # 16-byte units XORed with row % 8: the accumulator layout's 8 rows a store reach 8 different bank groups
        buf = stage._reinterpret(o.dtype, [BLOCK_M, HALF_V], gl.SwizzledSharedLayout(VEC, 1, 8, [1, 0]))
        buf.store(o)
        gl.thread_barrier()
        o = buf.load(L)
    else:
        L: gl.constexpr = L_O
    rows = row0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, L))
    cols = W * HALF_V + gl.arange(0, HALF_V, gl.SliceLayout(0, L))
    mask = (rows < ROWS)[:, None] & (cols < D_V)[None, :]
    gl.store(base + rows[:, None] * D_V + cols[None, :], o, mask=mask)


@gluon.jit
def _own_page(q_smem, qpe_smem, kv_smem, kpe_smem, p_smem, m_smem, ready, empty, p_full, acc, l_w, m_cur, t, start,
              seqlen, vis, min_vis, qk_scale, L_S: gl.constexpr, L_O: gl.constexpr, DTYPE: gl.constexpr,
              W: gl.constexpr):
    """Steps c-f for page t, this consumer's own. -> (acc, l_w, m(t))."""
    COL_S: gl.constexpr = gl.SliceLayout(0, L_S)
    ZL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    # -- c. S of page t --
    s = t % STAGES
    mbarrier.wait(ready.index(s), (t // STAGES) & 1)
    # 0, but not to the compiler: the MMAs' shared-memory descriptors are then formed here instead of being hoisted
    # out of the loop into registers held through it (which spilled)
    z = t >> 30
    kv = kv_smem.index(s + z)
    sc = warpgroup_mma(q_smem.index(z), kv.permute((1, 0)), gl.zeros([BLOCK_M, PAGE], gl.float32, L_S),
                       use_acc=False, is_async=True)
    sc = warpgroup_mma(qpe_smem.index(z), kpe_smem.index(s + z).permute((1, 0)), sc, is_async=True)
    sc = warpgroup_mma_wait(0, deps=[sc])
    # -- d. softmax against m(t - 1) --
    tok0 = start + t * PAGE
    p, alpha, m_new = softmax_rows_on_m(sc * qk_scale, m_cur, tok0, min_vis, vis, COL_S)
    l_w = l_w * alpha + gl.sum(p, 1)
    # -- e. P(t), m(t) (and zeroed V rows past the request's end) to the other consumer --
    if tok0 + PAGE > seqlen:
        zero_rows_from(kv, seqlen - tok0, 0, D_V, ZL)
    pb = p.to(DTYPE)
    p_smem.index(0).store(pb)
    m_smem.store(m_new)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(p_full)
    # -- f. O half += P(t) V_t --
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, L_O))[:, None]
    acc = warpgroup_mma(gl.convert_layout(pb, gl.DotOperandLayout(operand_index=0, parent=L_O, k_width=2)),
                        kv.slice(W * HALF_V, HALF_V, dim=1), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    gl.thread_barrier()
    mbarrier.arrive(empty.index(s))
    return acc, l_w, m_new


@gluon.jit
def _other_page(kv_smem, p_smem, m_smem, empty, p_full, acc, l_w, m_cur, u, L_O: gl.constexpr,
                ROW_S: gl.constexpr, W: gl.constexpr):
    """Steps a-b for page u, the other consumer's: wait for its P(u) and m(u), rescale O half and row sums to m(u),
    O half += P(u) V_u, release stage u % 2. -> (acc, l_w, m(u))."""
    mbarrier.wait(p_full, u & 1)
    m_u = m_smem.load(ROW_S)
    m_base = gl.where(m_u == float("-inf"), 0.0, m_u)
    alpha = gl.exp2(m_cur - m_base)
    l_w = l_w * alpha
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, L_O))[:, None]
    z = u >> 30         # 0: descriptors formed here (see _own_page)
    acc = warpgroup_mma(p_smem.index(z), kv_smem.index(u % STAGES + z).slice(W * HALF_V, HALF_V, dim=1), acc,
                        is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    gl.thread_barrier()
    mbarrier.arrive(empty.index(u % STAGES))
    return acc, l_w, m_u


@gluon.jit
def _second_consumer(q_smem, qpe_smem, kv_smem, kpe_smem, p_smem, m_smem, l_smem, q_bar, ready, empty, p_full, l_bar,
                     seqlens_ptr, qk_scale, b, split, num_splits, tile, H, S_Q, ROWS, out_ptr, lse_ptr, po_ptr,
                     pl_ptr, stride_pob, stride_pos, CAUSAL: gl.constexpr, IS_SPLIT: gl.constexpr,
                     DTYPE: gl.constexpr, STORE_16B: gl.constexpr):
    """The worker partition's entry: _consumer as warpgroup 1."""
    _consumer(q_smem, qpe_smem, kv_smem, kpe_smem, p_smem, m_smem, l_smem, q_bar, ready, empty, p_full, l_bar,
              seqlens_ptr, qk_scale, b, split, num_splits, tile, H, S_Q, ROWS, out_ptr, lse_ptr, po_ptr, pl_ptr,
              stride_pob, stride_pos, CAUSAL, IS_SPLIT, DTYPE, STORE_16B, 1)


@gluon.jit
def _mla_decode_seesaw_kernel(q_desc, kv_desc, bt_ptr, seqlens_ptr, out_ptr, lse_ptr, po_ptr, pl_ptr, order_ptr,
                              qk_scale, num_splits, H, S_Q, ROWS, stride_btb, stride_pob, stride_pos,
                              CAUSAL: gl.constexpr, IS_SPLIT: gl.constexpr, DTYPE: gl.constexpr,
                              ORDERED: gl.constexpr, BT_EARLY: gl.constexpr, STORE_16B: gl.constexpr = False):
    """Grid (b * cdiv(ROWS, 64), num_splits); two consumer warpgroups + the producer warp. q_desc: q as
    [b * ROWS, 576] (row = token j * H + head), kv_desc: the cache as [pages * 64, 576], boxes [64, 64]. out
    [b * ROWS, 512], lse [b * ROWS]; with splits po [b, splits, ROWS, 512] / pl [b, splits, ROWS] fp32 instead.
    ORDERED: the request axis runs through order_ptr (work_order.grid_order: longest first)."""
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    b, tile, split = program_item(order_ptr, ROWS, ORDERED)
    _, start, n_tiles = split_pages(seqlens_ptr, b, split, num_splits)
    q_smem = gl.allocate_shared_memory(DTYPE, [1, BLOCK_M, D_V], SMEM)      # [1, ..]: see _consumer's z
    qpe_smem = gl.allocate_shared_memory(DTYPE, [1, BLOCK_M, BOX], SMEM)
    kv_smem = gl.allocate_shared_memory(DTYPE, [STAGES, PAGE, D_V], SMEM)
    kpe_smem = gl.allocate_shared_memory(DTYPE, [STAGES, PAGE, BOX], SMEM)
    p_smem = gl.allocate_shared_memory(DTYPE, [1, BLOCK_M, PAGE], SMEM)
    m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], FLAT)
    l_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], FLAT)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    l_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)      # both consumers' P V of the page
    mbarrier.init(p_full, count=1)
    mbarrier.init(l_bar, count=2)
    fence_async_shared()
    gl.thread_barrier()

    bt_row = bt_ptr + b.to(gl.int64) * stride_btb
    q_row0 = b * ROWS + tile * BLOCK_M
    gl.warp_specialize(
        [(_consumer, (q_smem, qpe_smem, kv_smem, kpe_smem, p_smem, m_smem, l_smem, q_bar, ready, empty, p_full, l_bar,
                      seqlens_ptr, qk_scale, b, split, num_splits, tile, H, S_Q, ROWS, out_ptr, lse_ptr, po_ptr,
                      pl_ptr, stride_pob, stride_pos, CAUSAL, IS_SPLIT, DTYPE, STORE_16B, 0)),
         (_second_consumer, (q_smem, qpe_smem, kv_smem, kpe_smem, p_smem, m_smem, l_smem, q_bar, ready, empty, p_full,
                             l_bar, seqlens_ptr, qk_scale, b, split, num_splits, tile, H, S_Q, ROWS, out_ptr, lse_ptr,
                             po_ptr, pl_ptr, stride_pob, stride_pos, CAUSAL, IS_SPLIT, DTYPE, STORE_16B)),
         (_load_partition, (q_desc, kv_desc, kv_desc, kv_desc, bt_row, q_smem.index(0), qpe_smem.index(0), kv_smem,
                            kv_smem, kpe_smem,
                            q_bar, ready, empty, q_row0, start // PAGE, n_tiles, STAGES, False, BT_EARLY))],
        [4, 1], [240, 24])


def supports(q: torch.Tensor, kv_cache: torch.Tensor, head_dim_v: int) -> bool:
    """Whether this kernel takes the call: SEESAW on, a Hopper GPU, bf16 q and cache (page 64, contiguous), d_qk
    576, d_v 512."""
    return (SEESAW and q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] == 9
            and q.dtype == torch.bfloat16 and kv_cache.dtype == torch.bfloat16 and kv_cache.dim() == 3
            and kv_cache.is_contiguous() and kv_cache.shape[1] == PAGE.value and q.shape[-1] == D_QK.value
            and kv_cache.shape[2] == D_QK.value and head_dim_v == D_V.value)


def mla_decode_gluon_seesaw(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, plan, out, lse,
                            order: torch.Tensor | None = None) -> None:
    """ops.mla_decode's semantics for the calls `supports` takes, into out [b, s_q, h, 512] and lse [b, s_q, h]
    (contiguous, b > 0); `plan` from mla_decode_plan.plan_mla_decode with a 64-row, 64-token config. `order`:
    int32 [b], the order in which the grid takes the requests (work_order.grid_order), or None for batch order."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from mlaserve.kernels.triton import mla_decode_gluon
    from mlaserve.kernels.triton.mla_decode import combine_splits
    b, s_q, h, _ = q.shape
    rows = s_q * h
    smem = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    block_m, box, page, d_qk = BLOCK_M.value, BOX.value, PAGE.value, D_QK.value
    q_desc = TensorDescriptor.from_tensor(q.contiguous().view(b * rows, d_qk), [block_m, box], smem)
    kv_desc = TensorDescriptor.from_tensor(kv_cache.view(-1, d_qk), [page, box], smem)
    split = plan.num_splits > 1
    po, pl = (plan.partial_out, plan.partial_lse) if split else (out, lse)
    _mla_decode_seesaw_kernel[(b * triton.cdiv(rows, block_m), plan.num_splits)](
        q_desc, kv_desc, block_table, cache_seqlens, out, lse, po, pl, cache_seqlens if order is None else order,
        softmax_scale * LOG2E.value, plan.num_splits, h, s_q, rows, block_table.stride(0), po.stride(0),
        po.stride(1), CAUSAL=causal, IS_SPLIT=split, DTYPE=gl.bfloat16, ORDERED=order is not None,
        BT_EARLY=mla_decode_gluon.BT_EARLY, STORE_16B=STORE_16B, num_warps=4)
    if split:
        combine_splits(plan, out, lse)
