"""Sparse MLA (DSA) in Triton: absorbed MLA over the cache slots each query token selected.

Semantics are those of `mlaserve.kernels.reference.sparse_mla`. Every query token has its own
index row, so tokens never share KV tiles; one program handles (one block of heads, one query
token, one split of its top-k):

    q [BLOCK_H, 576] stays resident; per step it gathers BLOCK_N cache rows by slot id,
    QK = q_nope . kv[:, :512]^T + q_pe . kv[:, 512:]^T      -> [BLOCK_H, BLOCK_N] fp32
    online softmax in exp2 (scale folded into log2 e),
    acc += P . kv[:, :512]                                   -> [BLOCK_H, 512] fp32
    (V is the first head_dim_v columns of the same rows: each row is loaded once per step.)

Heads go on the M dimension of the dots (padded to BLOCK_H >= 16). The head-block axis is the
fastest-varying grid axis, so the programs of one token that read the same rows run together
and the second one finds them in L2. When tokens x head blocks cannot fill the GPU (small
decode batches) the top-k is split across programs and a second kernel merges the splits
through their lse.

FP8 KV (the 656-byte format of `kernels/fp8_format.py`) is dequantized in registers: the e4m3
c_kv bytes times their per-128-tile scale, k_pe read as bf16; both converted to q's dtype.

What Triton 3.6 makes of it on sm_90a (ptxas -v, checked without a GPU): with num_stages >= 2 the
row gather becomes cp.async into a double buffer that both wgmma dots read (each row reaches shared
memory once); num_stages 3 also prefetches the index tile a step earlier. BLOCK_H 64 x BLOCK_N 64,
8 warps: 255 registers, no spills, ~217 KB shared memory, so one program per SM and the next gather
overlaps only the P.V dot — which is why BLOCK_N and num_stages are tuned per shape.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mlaserve.kernels import fp8_format
from mlaserve.kernels.triton.common import fp8_kv_values

_LOG2E = 1.4426950408889634
# Byte offsets inside one FP8 row, as constants the kernel can fold.
_FP8_SCALE_OFFSET = tl.constexpr(fp8_format.SCALE_OFFSET)
_FP8_ROPE_OFFSET = tl.constexpr(fp8_format.ROPE_OFFSET)


@dataclass(frozen=True)
class SparseMLAConfig:
    """Launch knobs; `num_splits` is how many programs share one token's top-k."""
    block_h: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    num_splits: int = 1

    def __post_init__(self):
        for name in ("block_h", "block_n"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1 or self.num_splits < 1:
            raise ValueError(f"num_stages and num_splits must be >= 1, got {self.num_stages}, {self.num_splits}")


# Measured best configs on the H200 (2026-11-30, bench/results/tune-sparse-h200-2026-11-30.json), keyed by
# (kv kind, "prefill"|"decode", h); filled from scripts/tune_sparse.py. Missing keys fall back to the rules in
# `default_config`.
TUNED: dict[tuple[str, str, int], dict] = {
    ("bf16", "prefill", 128): {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 2},
    ("bf16", "prefill", 64): {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 2},
    ("bf16", "decode", 128): {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 2},
    ("bf16", "decode", 64): {"block_h": 64, "block_n": 32, "num_warps": 8, "num_stages": 2},
    ("fp8", "decode", 128): {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 3},
    ("fp8", "decode", 64): {"block_h": 64, "block_n": 32, "num_warps": 8, "num_stages": 4},
}

# A token count at or above this is "prefill" for the TUNED lookup.
_PREFILL_TOKENS = 1024


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(programs: int, topk_blocks: int, num_sms: int, max_splits: int = 16,
                      min_blocks_per_split: int = 4) -> int:
    """Top-k splits per (token, head block) from shapes only (CUDA-graph safe).

    Picks the split count whose grid fills whole waves of `num_sms` programs best, the smallest
    one on ties (each split costs a partial write and a merge); every split keeps at least
    `min_blocks_per_split` BLOCK_N steps so that the pipeline has something to overlap.
    """
    limit = max(1, min(max_splits, topk_blocks // min_blocks_per_split))
    best, best_eff = 1, 0.0
    for s in range(1, limit + 1):
        n = programs * s
        eff = n / (triton.cdiv(n, num_sms) * num_sms)
        if eff > best_eff + 0.02:
            best, best_eff = s, eff
    return best


def default_config(tokens: int, h: int, topk: int, kv_fp8: bool, head_dim_v: int,
                   device: torch.device, q_dtype: torch.dtype = torch.bfloat16) -> SparseMLAConfig:
    """The config used when the caller passes no knobs: TUNED if measured, else rules.

    TUNED was measured with 2-byte queries; float32 ones (tests) need twice the shared memory per
    tile, so they take the rules.
    """
    regime = "prefill" if tokens >= _PREFILL_TOKENS else "decode"
    tuned = TUNED.get(("fp8" if kv_fp8 else "bf16", regime, h)) if q_dtype.itemsize == 2 else None
    if tuned is not None:
        cfg = SparseMLAConfig(**tuned)
        if regime == "prefill" or "num_splits" in tuned:
            return cfg
    else:
        block_h = min(64, max(16, triton.next_power_of_2(h)))
        if kv_fp8 and block_h == 32:
            block_h = 16   # 32 rows of mma.sync plus the dequantized tile spill registers (ptxas, sm_90a)
        wide = head_dim_v >= 256
        # float32 tiles of 64 x 576 rows, double-buffered, exceed the 227 KB of shared memory
        block_n = 64 if wide and q_dtype.itemsize == 2 else 32
        cfg = SparseMLAConfig(block_h=block_h, block_n=block_n, num_warps=8 if wide else 4,
                              num_stages=2, num_splits=1)
    programs = tokens * triton.cdiv(h, cfg.block_h)
    splits = choose_num_splits(programs, triton.cdiv(topk, cfg.block_n), _num_sms(device))
    return SparseMLAConfig(cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages, splits)


@triton.jit
def _load_kv_rows(kv_ptr, rows, valid, stride_kv, offs_v, offs_r,
                  DV: tl.constexpr, DR: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
                  KV_FP8: tl.constexpr, TILE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Cache rows `rows` (int64 [BLOCK_N]) -> (kv_v [BLOCK_N, BLOCK_DV], kv_r [BLOCK_N, BLOCK_DR]) in OUT_DTYPE.

    kv_v is columns [0, DV) (V and the nope part of K), kv_r columns [DV, DV + DR) (the rope part).
    Rows where `valid` is false read as zeros and touch no memory, so poisoned slots stay unread.
    """
    row_ptr = kv_ptr + rows * stride_kv
    mask_v = valid[:, None]
    mask_r = valid[:, None]
    if BLOCK_DV != DV:
        mask_v = mask_v & (offs_v[None, :] < DV)
    if BLOCK_DR != DR:
        mask_r = mask_r & (offs_r[None, :] < DR)
    if KV_FP8:
        # 656-byte rows: e4m3 c_kv [0, 512), fp32 scales [512, 528), bf16 k_pe [528, 656).
        NUM_TILES: tl.constexpr = BLOCK_DV // TILE
        ckv = tl.load(row_ptr[:, None] + offs_v[None, :], mask=mask_v, other=0)
        ckv = ckv.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale_ptr = (row_ptr + _FP8_SCALE_OFFSET).to(tl.pointer_type(tl.float32))
        scale = tl.load(scale_ptr[:, None] + tl.arange(0, NUM_TILES)[None, :], mask=valid[:, None], other=0.0)
        kv_v = tl.reshape(tl.reshape(ckv, [ckv.shape[0], NUM_TILES, TILE]) * scale[:, :, None],
                          [ckv.shape[0], BLOCK_DV])
        kv_v = fp8_kv_values(kv_v, OUT_DTYPE)
        pe_ptr = (row_ptr + _FP8_ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16))
        kv_r = tl.load(pe_ptr[:, None] + offs_r[None, :], mask=mask_r, other=0.0).to(OUT_DTYPE)
    else:
        kv_v = tl.load(row_ptr[:, None] + offs_v[None, :], mask=mask_v, other=0.0)
        kv_r = tl.load(row_ptr[:, None] + DV + offs_r[None, :], mask=mask_r, other=0.0)
    return kv_v, kv_r


@triton.jit
def _sparse_mla_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr,
    stride_qt, stride_qh, stride_kv, stride_it,
    stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    H, TOPK, SPLIT_LEN, qk_scale_log2,
    DV: tl.constexpr, DR: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr, TILE: tl.constexpr, NORMALIZE_TO_OUT_DTYPE: tl.constexpr,
):
    """One program: BLOCK_H heads of one token over indices [split * SPLIT_LEN, +SPLIT_LEN).

    q [T, H, DV + DR]; idx int32 [T, TOPK]; out [splits, T, H, DV]; lse f32 [splits, T, H].
    """
    pid_h = tl.program_id(0)
    pid_t = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_DR)
    mask_h = offs_h < H
    q_rows = q_ptr + pid_t * stride_qt + offs_h[:, None] * stride_qh
    q_mask_v = mask_h[:, None]
    q_mask_r = mask_h[:, None]
    if BLOCK_DV != DV:
        q_mask_v = q_mask_v & (offs_v[None, :] < DV)
    if BLOCK_DR != DR:
        q_mask_r = q_mask_r & (offs_r[None, :] < DR)
    q_nope = tl.load(q_rows + offs_v[None, :], mask=q_mask_v, other=0.0)       # [BLOCK_H, BLOCK_DV]
    q_pe = tl.load(q_rows + DV + offs_r[None, :], mask=q_mask_r, other=0.0)    # [BLOCK_H, BLOCK_DR]

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)

    start = pid_s * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, TOPK)
    idx_row = idx_ptr + pid_t * stride_it
    for n0 in range(start, end, BLOCK_N):
        # -- gather BLOCK_N rows by slot id; -1 and the tail past `end` read nothing --
        offs_n = n0 + tl.arange(0, BLOCK_N)
        slots = tl.load(idx_row + offs_n, mask=offs_n < end, other=-1)
        valid = slots >= 0
        kv_v, kv_r = _load_kv_rows(kv_ptr, slots.to(tl.int64), valid, stride_kv, offs_v, offs_r,
                                   DV, DR, BLOCK_DV, BLOCK_DR, KV_FP8, TILE, q_nope.dtype)
        # -- compute qk (log2 units) --
        qk = tl.dot(q_nope, tl.trans(kv_v))
        qk = tl.dot(q_pe, tl.trans(kv_r), qk)
        qk = tl.where(valid[None, :], qk * qk_scale_log2, float("-inf"))
        # -- online softmax; a row that has seen no valid index yet keeps m = -inf --
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(qk - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(kv_v.dtype), kv_v, acc)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)  # ln 2
    o_ptrs = out_ptr + pid_s * stride_os + pid_t * stride_ot + offs_h[:, None] * stride_oh + offs_v[None, :]
    o_mask = mask_h[:, None]
    if BLOCK_DV != DV:
        o_mask = o_mask & (offs_v[None, :] < DV)
    if NORMALIZE_TO_OUT_DTYPE:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(o_ptrs, out, mask=o_mask)
    tl.store(lse_ptr + pid_s * stride_ls + pid_t * stride_lt + offs_h, lse, mask=mask_h)


@triton.jit
def _combine_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, NUM_SPLITS, ROWS,
                           DV: tl.constexpr, BLOCK_DV: tl.constexpr, SPLITS_P2: tl.constexpr):
    """Merge per-split (normalized out, lse) of one (token, head) row.

    part_out f32 [NUM_SPLITS, ROWS, DV]; part_lse f32 [NUM_SPLITS, ROWS]; out [ROWS, DV]; lse f32 [ROWS].
    """
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_v = tl.arange(0, BLOCK_DV)
    mask_s = offs_s < NUM_SPLITS
    lse_s = tl.load(part_lse_ptr + offs_s * ROWS + row, mask=mask_s, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_ref)                                   # 0 for empty splits
    total = tl.sum(w, 0)
    part = tl.load(part_out_ptr + (offs_s[:, None] * ROWS + row) * DV + offs_v[None, :],
                   mask=mask_s[:, None] & (offs_v[None, :] < DV), other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * DV + offs_v, out.to(out_ptr.dtype.element_ty), mask=offs_v < DV)
    tl.store(lse_ptr + row, tl.where(total == 0.0, float("-inf"), m_ref + tl.log(tl.where(total == 0.0, 1.0, total))))


def _flat_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """[pages, page_size, width] -> [pages * page_size, width] without copying the cache."""
    if kv_cache.stride(-1) != 1 or kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):
        raise ValueError(f"kv_cache must have contiguous rows and pages (a view as [slots, width]); "
                         f"got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}")
    return kv_cache.view(-1, kv_cache.shape[-1])


def sparse_mla(q, kv_cache, indices, softmax_scale, head_dim_v=512, *, block_h=None, block_n=None,
               num_warps=None, num_stages=None, num_splits=None):
    """Absorbed MLA over selected cache slots.

    Args:
        q: [b, s_q, h, d_qk] bf16/fp16 (fp32 in the CPU interpreter).
        kv_cache: [pages, page_size, d_qk] in q's dtype, or uint8 [pages, page_size, 656] (FP8).
        indices: int32 [b, s_q, topk] slot ids (page * page_size + offset), -1 = unused (anywhere).
        softmax_scale: float.
        head_dim_v: V is the first head_dim_v columns of each cached row.
        block_h, block_n, num_warps, num_stages, num_splits: tuning knobs; None takes
            `default_config` (TUNED table, else rules; num_splits from shapes only).
    Returns:
        out [b, s_q, h, head_dim_v] in q's dtype, lse float32 [b, s_q, h] (natural log;
        out 0 and lse -inf for a token whose indices are all -1).
    """
    b, s_q, h, d_qk = q.shape
    topk = indices.shape[-1]
    tokens = b * s_q
    kv_fp8 = kv_cache.dtype == torch.uint8
    dr = d_qk - head_dim_v
    cfg = default_config(tokens, h, topk, kv_fp8, head_dim_v, q.device, q.dtype)
    cfg = SparseMLAConfig(block_h=block_h or cfg.block_h, block_n=block_n or cfg.block_n,
                          num_warps=num_warps or cfg.num_warps, num_stages=num_stages or cfg.num_stages,
                          num_splits=num_splits or cfg.num_splits)

    q_t = q.reshape(tokens, h, d_qk)
    if q_t.stride(-1) != 1:
        q_t = q_t.contiguous()
    idx = indices.reshape(tokens, topk)
    if idx.stride(-1) != 1:
        idx = idx.contiguous()
    kv_rows = _flat_rows(kv_cache)

    out = torch.empty(tokens, h, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(tokens, h, dtype=torch.float32, device=q.device)
    if tokens == 0:
        return out.view(b, s_q, h, head_dim_v), lse.view(b, s_q, h)

    # Splits cover whole BLOCK_N steps so that only the last split has a ragged tail.
    splits = max(1, min(cfg.num_splits, triton.cdiv(topk, cfg.block_n)))
    split_len = triton.cdiv(triton.cdiv(topk, splits), cfg.block_n) * cfg.block_n
    splits = triton.cdiv(topk, split_len)
    if splits == 1:
        part_out, part_lse = out, lse
    else:
        part_out = torch.empty(splits, tokens, h, head_dim_v, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, tokens, h, dtype=torch.float32, device=q.device)

    block_dv = triton.next_power_of_2(head_dim_v)
    grid = (triton.cdiv(h, cfg.block_h), tokens, splits)
    _sparse_mla_kernel[grid](
        q_t, kv_rows, idx, part_out, part_lse,
        q_t.stride(0), q_t.stride(1), kv_rows.stride(0), idx.stride(0),
        part_out.stride(0) if splits > 1 else 0, h * head_dim_v, head_dim_v,
        part_lse.stride(0) if splits > 1 else 0, h,
        h, topk, split_len, float(softmax_scale) * _LOG2E,
        DV=head_dim_v, DR=dr, BLOCK_DV=block_dv, BLOCK_DR=max(16, triton.next_power_of_2(max(dr, 1))),
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
        KV_FP8=kv_fp8, TILE=fp8_format.TILE, NORMALIZE_TO_OUT_DTYPE=splits == 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        _combine_splits_kernel[(tokens * h,)](
            part_out, part_lse, out, lse, splits, tokens * h,
            DV=head_dim_v, BLOCK_DV=block_dv, SPLITS_P2=triton.next_power_of_2(splits), num_warps=4,
        )
    return out.view(b, s_q, h, head_dim_v), lse.view(b, s_q, h)
