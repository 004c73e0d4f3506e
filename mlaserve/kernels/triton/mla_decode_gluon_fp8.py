"""The MLA decode over the FP8 656-byte cache in Gluon for Hopper, keys on M, for up to 16 query rows per
request (h 16 s_q 1, h 8 s_q 2, ...): what the triton backend runs for FP8 KV there (MLADecodeConfig.gluon
with 16-row blocks; the tl kernel elsewhere, on the same grid).

Status (H200, bench/NOTES.md item 31): correct on the 10 shapes of scripts/gluon_fp8_check.py (splits,
causal and not, empty and one-token requests, NaN in unused slots) and 1.14-1.41x the tl FP8 kernel, but
0.64-0.85x bf16 KV: one warpgroup runs each page's chain (fragment loads, cvt, 4 MMA groups each waited
for, cross-warp softmax reductions, P^T stores, 4 more MMA groups) with nothing to overlap it, at ~4 us a
page against 1.3 us of HBM time; ptxas gives it 255 registers and 224 B of stack. Two warpgroups on
alternate pages (each its own O^T, merged at the end) are the next step.

Why: the `tl` kernel reads FP8 KV at 0.44-0.46x the speed of bf16 KV at h 16 (bench/NOTES.md items 25, 28):
it converts each 64 x 512 tile through shared memory between the cp.async wait and the MMAs, and pads 16
query rows to the MMA's M. With the keys on M instead (S^T = K Q^T, O^T = V^T P^T), both K and V^T are
wgmma A operands, which may come from registers: the e4m3 values are read from the raw TMA stage straight
into A fragments and converted there (cvt e4m3x2 -> f16x2), and the MMA's N is the 16 query rows.
The per-row, per-128-column scales never multiply an element:
- S^T = sum_g scale[key, g] * (K_g Q_g^T) over the four 128-column groups (four accumulators, scaled by row)
  plus k_pe q_pe^T (bf16, both operands from shared memory);
- O^T_g = V^T_g (P^T * scale[:, g]) for the output's 128-column group g: the scale folds into the B operand,
  P^T scaled once per group into shared memory.
Q is cast to f16 after scaling its tile by a power of two (its largest magnitude to 2^14), undone on S.

Layout: a producer warp (warp_specialize worker) TMA-loads each page of the split as three boxes of
the same cache rows (e4m3 c_kv [64, 512] in four [64, 128] boxes, fp32 scales [64, 4], bf16 k_pe [64, 64])
into a STAGES-deep ring on mbarriers; one compute warpgroup (4 warps) runs the online softmax over the keys
(M) for its 16 rows (N). Cache rows past the request's end (NaN in unused slots) have their c_kv bytes and
scales zeroed in the stage before use; their scores are masked.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from mlaserve.kernels import fp8_format
from mlaserve.kernels.triton.mla_decode_gluon import finish_rows, split_and_visibility

ROWS_PAD = gl.constexpr(16)   # query rows per CTA: the MMA's N
PAGE = gl.constexpr(64)       # cached tokens per page = per step = the MMA's M
D_V = gl.constexpr(512)
GROUP = gl.constexpr(128)     # columns per FP8 scale
D_PE = gl.constexpr(64)
ROW_BYTES = gl.constexpr(656)
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _load_partition(ckv_desc, sc_desc, kpe_desc, bt_row, ckv_smem, sc_smem, kpe_smem, ready, empty, first_page,
                    n_tiles, STAGES: gl.constexpr):
    """The producer warp: page t of the split into ring stage t % STAGES once the stage is free."""
    for t in range(n_tiles):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        row = gl.load(bt_row + first_page + t) * PAGE
        bar = ready.index(s)
        mbarrier.expect(bar, PAGE * (D_V + 4 * 4 + D_PE * 2))
        for g in gl.static_range(4):
            tma.async_copy_global_to_shared(ckv_desc, [row, g * GROUP], bar,
                                            ckv_smem.index(s).slice(g * GROUP, GROUP, dim=1))
        tma.async_copy_global_to_shared(sc_desc, [row, D_V // 4], bar, sc_smem.index(s))
        tma.async_copy_global_to_shared(kpe_desc, [row, (D_V + 16) // 2], bar, kpe_smem.index(s))


@gluon.jit
def _scale_col(sc, g: gl.constexpr, SC_LAYOUT: gl.constexpr, ROW_LAYOUT: gl.constexpr):
    """Column g of the stage's [64, 4] scales, as a per-key vector in ROW_LAYOUT."""
    cols = gl.arange(0, 4, gl.SliceLayout(0, SC_LAYOUT))
    v = gl.sum(gl.where(cols[None, :] == g, sc, 0.0), 1)
    return gl.convert_layout(v, ROW_LAYOUT)


@gluon.jit
def _k_operand(ckv, g: gl.constexpr, A_LAYOUT: gl.constexpr):
    """K_g [64 keys, 128 columns] of a stage as an f16 wgmma A operand in registers."""
    return ckv.slice(g * GROUP, GROUP, dim=1).load(A_LAYOUT).to(gl.float16)


@gluon.jit
def _group_scores(ckv, q_smem, g: gl.constexpr, zero_s, A_LAYOUT: gl.constexpr):
    """K_g Q_g^T [64 keys, 16 rows] for the 128-column group g (A from registers, waited for)."""
    a = _k_operand(ckv, g, A_LAYOUT)
    acc = warpgroup_mma(a, q_smem.slice(g * GROUP, GROUP, dim=1).permute((1, 0)), zero_s, use_acc=False,
                        is_async=True)
    acc, a = warpgroup_mma_wait(0, deps=[acc, a])
    return acc


@gluon.jit
def _vt_operand(ckv, g: gl.constexpr, A_LAYOUT: gl.constexpr):
    """V^T_g [128 columns, 64 keys] of a stage as an f16 wgmma A operand in registers."""
    return ckv.slice(g * GROUP, GROUP, dim=1).permute((1, 0)).load(A_LAYOUT).to(gl.float16)


@gluon.jit
def _compute_partition(q_smem, qpe_smem, ckv_smem, sc_smem, kpe_smem, pt_smem, ready, empty, n_tiles, start, seqlen,
                       vis_len, min_vis, c_scale, qk_scale, STAGES: gl.constexpr, S_LAYOUT: gl.constexpr,
                       O_LAYOUT: gl.constexpr):
    """The compute warpgroup: online softmax over the split's pages, keys on M -> (O^T per group, max, sum)."""
    KEY_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)     # per key (M) of S^T
    ROW_S: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)     # per query row (N) of S^T
    ROW_O: gl.constexpr = gl.SliceLayout(0, O_LAYOUT)
    A_S: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_LAYOUT, k_width=2)
    A_O: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    SC_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [4, 1], [1, 0])
    ZL: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])

    m_i = gl.full([ROWS_PAD], float("-inf"), gl.float32, ROW_S)
    l_acc = gl.zeros([PAGE, ROWS_PAD], gl.float32, S_LAYOUT)
    o0 = gl.zeros([GROUP, ROWS_PAD], gl.float32, O_LAYOUT)
    o1 = gl.zeros([GROUP, ROWS_PAD], gl.float32, O_LAYOUT)
    o2 = gl.zeros([GROUP, ROWS_PAD], gl.float32, O_LAYOUT)
    o3 = gl.zeros([GROUP, ROWS_PAD], gl.float32, O_LAYOUT)
    vis = gl.convert_layout(vis_len, ROW_S)
    zero_s = gl.zeros([PAGE, ROWS_PAD], gl.float32, S_LAYOUT)
    for t in range(n_tiles):
        s = t % STAGES
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        ckv = ckv_smem.index(s)
        tok0 = start + t * PAGE
        if tok0 + PAGE > seqlen:
            # cache rows past the request's end: zero their e4m3 bytes and scales (NaN * 0 is NaN)
            keep = (gl.arange(0, PAGE, gl.SliceLayout(1, ZL)) < seqlen - tok0)[:, None]
            for g in gl.static_range(4):
                box = ckv.slice(g * GROUP, GROUP, dim=1)
                x = box.load(ZL)
                box.store(gl.where(keep, x, gl.zeros_like(x)))
            scs = sc_smem.index(s)
            keep_sc = (gl.arange(0, PAGE, gl.SliceLayout(1, SC_LAYOUT)) < seqlen - tok0)[:, None]
            y = scs.load(SC_LAYOUT)
            scs.store(gl.where(keep_sc, y, gl.zeros_like(y)))
            gl.thread_barrier()
        # -- S^T = sum_g scale_g * K_g Q_g^T (f16) + k_pe q_pe^T (bf16), keys on M: one group's A operand
        #    in registers at a time, its product folded into S^T by the per-key scale --
        sc = sc_smem.index(s).load(SC_LAYOUT)
        c0 = _scale_col(sc, 0, SC_LAYOUT, KEY_S)
        c1 = _scale_col(sc, 1, SC_LAYOUT, KEY_S)
        c2 = _scale_col(sc, 2, SC_LAYOUT, KEY_S)
        c3 = _scale_col(sc, 3, SC_LAYOUT, KEY_S)
        s_pe = warpgroup_mma(kpe_smem.index(s), qpe_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        sco = _group_scores(ckv, q_smem, 0, zero_s, A_S) * c0[:, None]
        sco += _group_scores(ckv, q_smem, 1, zero_s, A_S) * c1[:, None]
        sco += _group_scores(ckv, q_smem, 2, zero_s, A_S) * c2[:, None]
        sco += _group_scores(ckv, q_smem, 3, zero_s, A_S) * c3[:, None]
        s_pe = warpgroup_mma_wait(0, deps=[s_pe])     # retired by the first group's wait already
        sco = sco * c_scale + s_pe * qk_scale
        # -- online softmax along the keys (M) --
        if tok0 + PAGE > min_vis:
            keys = tok0 + gl.arange(0, PAGE, KEY_S)
            sco = gl.where(keys[:, None] < vis[None, :], sco, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sco, 0))
        m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_base)
        p = gl.exp2(sco - m_base[None, :])
        l_acc = l_acc * alpha[None, :] + p
        m_i = m_new
        # -- P^T scaled by each group's per-key scale: the B operands of O^T_g --
        pt_smem.index(0).store((p * c0[:, None]).to(gl.float16))
        pt_smem.index(1).store((p * c1[:, None]).to(gl.float16))
        pt_smem.index(2).store((p * c2[:, None]).to(gl.float16))
        pt_smem.index(3).store((p * c3[:, None]).to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        a_o = gl.convert_layout(alpha, ROW_O)[None, :]
        v0 = _vt_operand(ckv, 0, A_O)
        o0 = warpgroup_mma(v0, pt_smem.index(0), o0 * a_o, is_async=True)
        v1 = _vt_operand(ckv, 1, A_O)
        o1 = warpgroup_mma(v1, pt_smem.index(1), o1 * a_o, is_async=True)
        o0, v0 = warpgroup_mma_wait(1, deps=[o0, v0])
        v2 = _vt_operand(ckv, 2, A_O)
        o2 = warpgroup_mma(v2, pt_smem.index(2), o2 * a_o, is_async=True)
        o1, v1 = warpgroup_mma_wait(1, deps=[o1, v1])
        v3 = _vt_operand(ckv, 3, A_O)
        o3 = warpgroup_mma(v3, pt_smem.index(3), o3 * a_o, is_async=True)
        o2, o3, v2, v3 = warpgroup_mma_wait(0, deps=[o2, o3, v2, v3])
        gl.thread_barrier()                       # every warp is done with the stage and P^T
        mbarrier.arrive(empty.index(s))
    return o0, o1, o2, o3, m_i, gl.sum(l_acc, 0)


@gluon.jit
def _store_group(o, g: gl.constexpr, inv_l, rows, row_ok, b, split, num_splits, ROWS, out_ptr, po_ptr,
                 stride_pob, stride_pos, IS_SPLIT: gl.constexpr, DTYPE: gl.constexpr, O_LAYOUT: gl.constexpr):
    """O^T_g [128, 16] normalized into out [.., row, 128 g + c] (or the fp32 split partials)."""
    cols = g * GROUP + gl.arange(0, GROUP, gl.SliceLayout(1, O_LAYOUT))
    o = o * inv_l[None, :]
    mask = (cols < D_V)[:, None] & row_ok[None, :]
    if IS_SPLIT:
        base = po_ptr + b.to(gl.int64) * stride_pob + split * stride_pos
        gl.store(base + rows[None, :] * D_V + cols[:, None], o, mask=mask)
    else:
        base = out_ptr + b.to(gl.int64) * ROWS * D_V
        gl.store(base + rows[None, :] * D_V + cols[:, None], o.to(DTYPE), mask=mask)


@gluon.jit
def _mla_decode_fp8_kernel(ckv_desc, sc_desc, kpe_desc, q_ptr, bt_ptr, seqlens_ptr, out_ptr, lse_ptr, po_ptr, pl_ptr,
                           qk_scale, num_splits, H, S_Q, ROWS, stride_qb, stride_btb, stride_pob, stride_pos,
                           CAUSAL: gl.constexpr, IS_SPLIT: gl.constexpr, STAGES: gl.constexpr,
                           DTYPE: gl.constexpr):
    """Grid (b, num_splits); 4 warps + the producer warp. q [b, ROWS, 576] (row = token j * H + head, ROWS <= 16);
    the cache as [pages * 64, 656] bytes behind three descriptors. out [b * ROWS, 512], lse [b * ROWS]; with
    splits po [b, splits, ROWS, 512] / pl [b, splits, ROWS] fp32 instead."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWS_PAD, 16])
    O_LAYOUT: gl.constexpr = S_LAYOUT
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    ROW_O: gl.constexpr = gl.SliceLayout(0, O_LAYOUT)

    b = gl.program_id(0)
    split = gl.program_id(1)
    rows = gl.arange(0, ROWS_PAD, ROW_O)
    row_ok = rows < ROWS
    seqlen, start, n_tiles, vis_len, min_vis = split_and_visibility(seqlens_ptr, b, split, num_splits, rows, H, S_Q,
                                                                    CAUSAL)

    # -- Q: c part to f16 after a power-of-two scaling of the tile (largest magnitude to 2^14), k_pe part bf16 --
    Q_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(gl.float16, [ROWS_PAD, D_V], Q_SMEM)
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [ROWS_PAD, D_PE], Q_SMEM)
    qr = gl.arange(0, ROWS_PAD, gl.SliceLayout(1, QL))
    q_rows = q_ptr + b.to(gl.int64) * stride_qb + qr * (D_V + D_PE)
    qc = gl.load(q_rows[:, None] + gl.arange(0, D_V, gl.SliceLayout(0, QL))[None, :],
                 mask=(qr < ROWS)[:, None], other=0.0).to(gl.float32)
    amax = gl.max(gl.max(gl.abs(qc), 1), 0)
    e = gl.floor(gl.log2(gl.maximum(amax, 1e-30)))
    q_mul = gl.exp2(14.0 - e)
    q_smem.store((qc * q_mul).to(gl.float16))
    qpe = gl.load(q_rows[:, None] + D_V + gl.arange(0, D_PE, gl.SliceLayout(0, QL))[None, :],
                  mask=(qr < ROWS)[:, None], other=0.0)
    qpe_smem.store(qpe.to(gl.bfloat16))

    CKV_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    SC_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    KPE_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    PT_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PAGE, ROWS_PAD], gl.float16)
    ckv_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, PAGE, D_V], CKV_SMEM)
    sc_smem = gl.allocate_shared_memory(gl.float32, [STAGES, PAGE, 4], SC_SMEM)
    kpe_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D_PE], KPE_SMEM)
    pt_smem = gl.allocate_shared_memory(gl.float16, [4, PAGE, ROWS_PAD], PT_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()

    bt_row = bt_ptr + b.to(gl.int64) * stride_btb
    o0, o1, o2, o3, m_i, l_i = gl.warp_specialize(
        [(_compute_partition, (q_smem, qpe_smem, ckv_smem, sc_smem, kpe_smem, pt_smem, ready, empty, n_tiles, start,
                               seqlen, vis_len, min_vis, qk_scale / q_mul, qk_scale, STAGES, S_LAYOUT, O_LAYOUT)),
         (_load_partition, (ckv_desc, sc_desc, kpe_desc, bt_row, ckv_smem, sc_smem, kpe_smem, ready, empty,
                            start // PAGE, n_tiles, STAGES))],
        [1], [24])

    # -- epilogue: normalize; rows that saw no key get out = 0, lse = -inf --
    inv_l, lse = finish_rows(m_i, l_i, ROW_O)
    _store_group(o0, 0, inv_l, rows, row_ok, b, split, num_splits, ROWS, out_ptr, po_ptr, stride_pob, stride_pos,
                 IS_SPLIT, DTYPE, O_LAYOUT)
    _store_group(o1, 1, inv_l, rows, row_ok, b, split, num_splits, ROWS, out_ptr, po_ptr, stride_pob, stride_pos,
                 IS_SPLIT, DTYPE, O_LAYOUT)
    _store_group(o2, 2, inv_l, rows, row_ok, b, split, num_splits, ROWS, out_ptr, po_ptr, stride_pob, stride_pos,
                 IS_SPLIT, DTYPE, O_LAYOUT)
    _store_group(o3, 3, inv_l, rows, row_ok, b, split, num_splits, ROWS, out_ptr, po_ptr, stride_pob, stride_pos,
                 IS_SPLIT, DTYPE, O_LAYOUT)
    if IS_SPLIT:
        gl.store(pl_ptr + b * (num_splits * ROWS) + split * ROWS + rows, lse, mask=row_ok)
    else:
        gl.store(lse_ptr + b * ROWS + rows, lse, mask=row_ok)


# bf16 only: the fp16 specializations compile but have not run on a GPU (the tl kernel takes fp16)
_GL_DTYPES = {torch.bfloat16: gl.bfloat16}


def supports(q: torch.Tensor, kv_cache: torch.Tensor, head_dim_v: int) -> bool:
    """Whether this kernel takes the call: a Hopper GPU, a contiguous page-64 FP8 cache, <= 16 query rows per
    request, bf16 q with d_qk 576, d_v 512."""
    b, s_q, h, d_qk = q.shape
    return (q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] == 9
            and kv_cache.dtype == torch.uint8 and kv_cache.dim() == 3 and kv_cache.is_contiguous()
            and kv_cache.shape[1] == PAGE.value and kv_cache.shape[2] == ROW_BYTES.value
            and s_q * h <= ROWS_PAD.value and q.dtype in _GL_DTYPES and d_qk == D_V.value + D_PE.value
            and head_dim_v == D_V.value)


def mla_decode_gluon_fp8(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, plan, out, lse,
                         stages: int = 4) -> None:
    """ops.mla_decode's semantics for the calls `supports` takes, into out [b, s_q, h, 512] and lse [b, s_q, h]
    (contiguous, b > 0); `plan` from mla_decode_plan.plan_mla_decode with 16-row programs."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from mlaserve.kernels.triton.mla_decode import combine_splits
    assert fp8_format.PACKED_BYTES == ROW_BYTES.value
    b, s_q, h, _ = q.shape
    rows, page = s_q * h, PAGE.value
    flat = kv_cache.view(-1, ROW_BYTES.value)
    ckv_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    sc_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    kpe_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    ckv_desc = TensorDescriptor.from_tensor(flat.view(torch.float8_e4m3fn), [page, GROUP.value], ckv_layout)
    sc_desc = TensorDescriptor.from_tensor(flat.view(torch.float32), [page, 4], sc_layout)
    kpe_desc = TensorDescriptor.from_tensor(flat.view(torch.bfloat16), [page, D_PE.value], kpe_layout)
    qc = q.contiguous()
    split = plan.num_splits > 1
    po, pl = (plan.partial_out, plan.partial_lse) if split else (out, lse)
    _mla_decode_fp8_kernel[(b, plan.num_splits)](
        ckv_desc, sc_desc, kpe_desc, qc, block_table, cache_seqlens, out, lse, po, pl,
        softmax_scale * LOG2E.value, plan.num_splits, h, s_q, rows, qc.stride(0), block_table.stride(0),
        po.stride(0), po.stride(1),
        CAUSAL=causal, IS_SPLIT=split, STAGES=stages, DTYPE=_GL_DTYPES[q.dtype], num_warps=4)
    if split:
        combine_splits(plan, out, lse)
