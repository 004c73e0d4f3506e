"""Paged MLA decode in Triton: split-KV attention over the latent cache, bf16/fp16 or FP8 KV.

The absorbed form is MQA with one shared latent head (DESIGN.md): every query row
(head x new token) of a request attends over the same cached rows [c_kv | k_pe], and V is
the c_kv part. One program owns BLOCK_H query rows of one request — heads and new tokens
packed together as the M dimension of the dots (64 rows map to one Hopper wgmma) — and one
KV split of that request. It streams BLOCK_N cached tokens per step, loads each tile once
and uses it for both QK (nope part as two column halves, plus the rope part) and PV (the
halves are V), with an online softmax in exp2. Each step fetches the next tile's page ids,
so the pipeliner streams KV tiles `num_stages` deep. Tiles every query row sees whole skip
all masking; only the last one or two tiles of a request are masked (causal, length). FP8
rows are dequantized in registers (e4m3 x the row's per-128-column scale, as bf16 values).
A second kernel combines the splits through their lse.

Knobs (`MLADecodeConfig`): `v_split=2` gives two programs one query block, each accumulating
one half of V (both compute the full QK): half the accumulator registers, twice the QK work.
`lazy_rescale` rescales the [BLOCK_H, d_v] accumulators only when a row's running max grows
by more than 2^8 (P then stays <= 256), instead of on every step.

The split count comes from shapes only (`choose_num_splits`), never from cache_seqlens on
the host; each program derives its token range from its request's length on the device,
so a call can be captured in a CUDA graph. `plan_mla_decode` does the host work once per
step (config, split count, workspace); `mla_decode(..., plan=...)` only launches.
"""

import dataclasses
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaserve.kernels import fp8_format
from mlaserve.kernels.triton.common import fp8_kv_values
from mlaserve.kernels.triton.mla_decode_plan import (  # noqa: F401  (re-exported: the planning API)
    DEFAULT_CONFIGS, MLADecodeConfig, MLADecodePlan, choose_num_splits, decode_config, default_config,
    full_wave_splits, plan_mla_decode, uses_fp8_mma, workspace_numel)
from mlaserve.kernels.triton.work_order import grid_order

_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------
# kernels
@triton.jit
def _tile_mask(in_seq, offs_c, LIMIT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[BLOCK_N, C] load mask: rows in the sequence (if ROWS) and columns below LIMIT (if COLS)."""
    if ROWS and COLS:
        return in_seq[:, None] & (offs_c < LIMIT)[None, :]
    elif ROWS:
        return in_seq[:, None]
    else:
        return (offs_c < LIMIT)[None, :]


@triton.jit
def _load_nope_half(kv_ptr, row_off, in_seq, col0, COMPUTE: tl.constexpr, BLOCK_N: tl.constexpr,
                    HALF: tl.constexpr, HEAD_DIM_V: tl.constexpr, IS_FP8: tl.constexpr, MASKED: tl.constexpr):
    """c_kv columns col0 .. col0 + HALF of BLOCK_N cached rows -> [BLOCK_N, HALF] in COMPUTE.

    row_off int64 [BLOCK_N]: each row's offset (elements; bytes for FP8). in_seq bool [BLOCK_N]
    (used when MASKED): rows past the request's length read as 0, never as the cache's contents.
    FP8: e4m3 bytes times the row's scale of each 128-column tile (a half spans two tiles).
    """
    offs_c = tl.arange(0, HALF)
    # the row mask only on tail tiles; the column mask only when head_dim_v is padded
    mask = _tile_mask(in_seq, col0 + offs_c, HEAD_DIM_V, MASKED, 2 * HALF > HEAD_DIM_V)
    ptrs = kv_ptr + row_off[:, None] + (col0 + offs_c)[None, :]
    if IS_FP8:
        tl.static_assert(HALF == 2 * 128)
        scale_ptr = (kv_ptr + row_off + 512).to(tl.pointer_type(tl.float32)) + col0 // 128
        if MASKED:
            vals = tl.load(ptrs.to(tl.pointer_type(tl.float8e4nv)), mask=mask, other=0.0)
            s_lo = tl.load(scale_ptr, mask=in_seq, other=0.0)
            s_hi = tl.load(scale_ptr + 1, mask=in_seq, other=0.0)
        else:
            vals = tl.load(ptrs.to(tl.pointer_type(tl.float8e4nv)))
            s_lo = tl.load(scale_ptr)
            s_hi = tl.load(scale_ptr + 1)
        scale = tl.where(offs_c[None, :] < 128, s_lo[:, None], s_hi[:, None])
        tile = fp8_kv_values(vals.to(tl.float32) * scale, COMPUTE)
    elif MASKED or 2 * HALF > HEAD_DIM_V:
        tile = tl.load(ptrs, mask=mask, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _load_pe(kv_ptr, row_off, in_seq, COMPUTE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_PE: tl.constexpr,
             HEAD_DIM_V: tl.constexpr, DIM_PE: tl.constexpr, IS_FP8: tl.constexpr, MASKED: tl.constexpr):
    """k_pe (the DIM_PE columns after c_kv) of BLOCK_N cached rows -> [BLOCK_N, BLOCK_PE] in COMPUTE."""
    offs_c = tl.arange(0, BLOCK_PE)
    mask = _tile_mask(in_seq, offs_c, DIM_PE, MASKED, BLOCK_PE > DIM_PE)
    if IS_FP8:
        ptrs = (kv_ptr + row_off + 528)[:, None].to(tl.pointer_type(tl.bfloat16)) + offs_c[None, :]
    else:
        ptrs = kv_ptr + row_off[:, None] + (HEAD_DIM_V + offs_c)[None, :]
    if MASKED or BLOCK_PE > DIM_PE:
        return tl.load(ptrs, mask=mask, other=0.0).to(COMPUTE)
    return tl.load(ptrs).to(COMPUTE)


@triton.jit
def _tile_pages(bt_row, start_n, seqlen, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Block-table entries of the tile at start_n: one page id (tiles never straddle pages: PAGE_SIZE a
    multiple of BLOCK_N; tiles start at multiples of BLOCK_N) or int32 [BLOCK_N].

    Reads only entries of the request's own pages (the rest of its row may hold anything): a tile
    start past the request's end is clamped to its last token, rows past the end read page 0.
    """
    if PAGE_SIZE % BLOCK_N == 0:
        pages = tl.load(bt_row + tl.maximum(tl.minimum(start_n, seqlen - 1), 0) // PAGE_SIZE)
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        pages = tl.load(bt_row + offs_n // PAGE_SIZE, mask=offs_n < seqlen, other=0)
    return pages


@triton.jit
def _attend_tile(acc_a, acc_b, m_i, l_i, q_a, q_b, q_pe, kv_ptr, page, start_n, seqlen, vis_len,
                 stride_page, stride_tok, col_a, col_b, qk_scale,
                 COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, HALF: tl.constexpr, BLOCK_PE: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 DIM_PE: tl.constexpr, V_SPLIT: tl.constexpr, IS_FP8: tl.constexpr, MASKED: tl.constexpr,
                 LAZY_RESCALE: tl.constexpr):
    """One online-softmax step over cached tokens start_n .. start_n + BLOCK_N (the shared inner loop).

    acc_a/acc_b fp32 [BLOCK_H, HALF]; m_i (log2 units)/l_i fp32 [BLOCK_H]; q_a/q_b [BLOCK_H, HALF];
    q_pe [BLOCK_H, BLOCK_PE]; page: the tile's page id(s) from `_tile_pages`; vis_len int32 [BLOCK_H]:
    keys each row may see (MASKED tiles only; unmasked tiles lie wholly inside every row's visible range).
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    in_seq = offs_n < seqlen
    # -- rows of the paged cache --
    if PAGE_SIZE % BLOCK_N == 0:
        # the tile lies in one page: a scalar base plus constant offsets keeps copy addresses out of registers
        row_off = page.to(tl.int64) * stride_page + ((start_n % PAGE_SIZE) + tl.arange(0, BLOCK_N)) * stride_tok
    else:
        row_off = page.to(tl.int64) * stride_page + (offs_n % PAGE_SIZE) * stride_tok
    kv_a = _load_nope_half(kv_ptr, row_off, in_seq, col_a, COMPUTE, BLOCK_N, HALF, HEAD_DIM_V, IS_FP8, MASKED)
    kv_b = _load_nope_half(kv_ptr, row_off, in_seq, col_b, COMPUTE, BLOCK_N, HALF, HEAD_DIM_V, IS_FP8, MASKED)
    # -- compute qk (scaled into log2 units) --
    s = tl.dot(q_a, tl.trans(kv_a), input_precision=DOT_PRECISION)
    s = tl.dot(q_b, tl.trans(kv_b), s, input_precision=DOT_PRECISION)
    if DIM_PE > 0:
        kv_pe = _load_pe(kv_ptr, row_off, in_seq, COMPUTE, BLOCK_N, BLOCK_PE, HEAD_DIM_V, DIM_PE, IS_FP8, MASKED)
        s = tl.dot(q_pe, tl.trans(kv_pe), s, input_precision=DOT_PRECISION)
    s = s * qk_scale
    if MASKED:
        s = tl.where(offs_n[None, :] < vis_len[:, None], s, float("-inf"))
    # -- online softmax --
    m_tile = tl.max(s, 1)
    if LAZY_RESCALE:
        # keep each row's running max until some row's grows by more than 2^8: exp2(s - m) stays <= 256,
        # harmless in fp32 and bf16, and the [BLOCK_H, d_v] accumulators are rescaled only on the few
        # steps that need it (-inf > -inf + 8 is false, so rows that saw nothing yet never ask for one)
        if tl.max((m_tile > m_i + 8.0).to(tl.int32), 0) > 0:
            m_new = tl.maximum(m_i, m_tile)
            alpha = tl.math.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
            l_i = l_i * alpha
            acc_a = acc_a * alpha[:, None]
            if V_SPLIT == 1:
                acc_b = acc_b * alpha[:, None]
            m_i = m_new
        p = tl.math.exp2(s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
        l_i = l_i + tl.sum(p, 1)
        p = p.to(COMPUTE)
        acc_a = tl.dot(p, kv_a, acc_a, input_precision=DOT_PRECISION)
        if V_SPLIT == 1:
            acc_b = tl.dot(p, kv_b, acc_b, input_precision=DOT_PRECISION)
        m_new = m_i
    else:
        m_new = tl.maximum(m_i, m_tile)
        if MASKED:
            # a row that has seen no key yet keeps m = -inf; exponentiate against 0 so that it stays 0, not NaN
            m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_base = m_new
        alpha = tl.math.exp2(m_i - m_base)
        p = tl.math.exp2(s - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- compute pv --
        p = p.to(COMPUTE)
        acc_a = tl.dot(p, kv_a, acc_a * alpha[:, None], input_precision=DOT_PRECISION)
        if V_SPLIT == 1:
            acc_b = tl.dot(p, kv_b, acc_b * alpha[:, None], input_precision=DOT_PRECISION)
    return acc_a, acc_b, m_new, l_i


@triton.jit
def _mla_decode_kernel(
    q_ptr, kv_ptr, bt_ptr, seqlens_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, order_ptr,
    qk_scale, num_splits, H, S_Q, ROWS,
    stride_qb, stride_qs, stride_qh, stride_page, stride_tok, stride_btb,
    stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
    stride_pob, stride_pos, stride_por, stride_plb, stride_pls,
    CAUSAL: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr, BLOCK_PE: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, DIM_PE: tl.constexpr, V_SPLIT: tl.constexpr, IS_FP8: tl.constexpr,
    IS_SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr, LAZY_RESCALE: tl.constexpr, ORDERED: tl.constexpr,
):
    """Grid (b * row blocks * V_SPLIT, num_splits). Writes out/lse directly with one split, else partials.

    The programs of one request and split are adjacent, so that they read its KV tiles while the L2
    still holds them; b rides on the first grid axis, which (unlike the others) allows 2^31 programs.
    ORDERED: the request axis runs through order_ptr (work_order.grid_order: longest first).
    """
    num_hv = tl.cdiv(ROWS, BLOCK_H) * V_SPLIT
    pid_b = tl.program_id(0) // num_hv
    if ORDERED:
        pid_b = tl.load(order_ptr + pid_b)
    pid_hv = tl.program_id(0) % num_hv
    pid_s = tl.program_id(1)
    pid_h = pid_hv // V_SPLIT
    v_part = pid_hv % V_SPLIT
    # this program's V half is loaded as "a"; with V_SPLIT == 1 the program owns both halves
    col_a = v_part * HALF
    col_b = (1 - v_part) * HALF

    offs_r = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)     # query rows: new token j = r // H, head = r % H
    row_ok = offs_r < ROWS
    tok = offs_r // H
    head = offs_r % H
    seqlen = tl.load(seqlens_ptr + pid_b)
    if CAUSAL:
        vis_len = seqlen - S_Q + 1 + tok                  # new token j sees positions 0 .. seqlen - S_Q + j
        min_vis = tl.maximum(seqlen - S_Q + 1, 0)
    else:
        vis_len = tl.zeros([BLOCK_H], dtype=tl.int32) + seqlen
        min_vis = seqlen

    # -- load q: [BLOCK_H, HALF] x 2 and [BLOCK_H, BLOCK_PE] --
    q_row = q_ptr + pid_b.to(tl.int64) * stride_qb + tok * stride_qs + head * stride_qh
    offs_c = tl.arange(0, HALF)
    q_a = tl.load(q_row[:, None] + (col_a + offs_c)[None, :],
                  mask=row_ok[:, None] & ((col_a + offs_c) < HEAD_DIM_V)[None, :], other=0.0)
    q_b = tl.load(q_row[:, None] + (col_b + offs_c)[None, :],
                  mask=row_ok[:, None] & ((col_b + offs_c) < HEAD_DIM_V)[None, :], other=0.0)
    offs_pe = tl.arange(0, BLOCK_PE)
    q_pe = tl.load(q_row[:, None] + (HEAD_DIM_V + offs_pe)[None, :],
                   mask=row_ok[:, None] & (offs_pe < DIM_PE)[None, :], other=0.0)

    # -- this split's tokens: the request's length cut into num_splits runs of whole tiles --
    split_len = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    start = pid_s * split_len
    end = tl.minimum(start + split_len, seqlen)
    full_end = tl.maximum(tl.minimum(end, (min_vis // BLOCK_N) * BLOCK_N), start)  # tiles every row sees whole

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_a = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    bt_row = bt_ptr + pid_b.to(tl.int64) * stride_btb
    # each step fetches the next tile's page ids, so that no KV address waits on a load of its own step
    # (the pipeliner then streams KV tiles num_stages - 1 steps ahead instead of spending a stage on them)
    page = _tile_pages(bt_row, start, seqlen, BLOCK_N, PAGE_SIZE)
    for start_n in tl.range(start, full_end, BLOCK_N, num_stages=NUM_STAGES):
        next_page = _tile_pages(bt_row, start_n + BLOCK_N, seqlen, BLOCK_N, PAGE_SIZE)
        acc_a, acc_b, m_i, l_i = _attend_tile(
            acc_a, acc_b, m_i, l_i, q_a, q_b, q_pe, kv_ptr, page, start_n, seqlen, vis_len,
            stride_page, stride_tok, col_a, col_b, qk_scale, COMPUTE, DOT_PRECISION, PAGE_SIZE,
            BLOCK_N, HALF, BLOCK_PE, HEAD_DIM_V, DIM_PE, V_SPLIT, IS_FP8, False, LAZY_RESCALE)
        page = next_page
    page = _tile_pages(bt_row, full_end, seqlen, BLOCK_N, PAGE_SIZE)
    for start_n in tl.range(full_end, end, BLOCK_N, num_stages=NUM_STAGES):
        next_page = _tile_pages(bt_row, start_n + BLOCK_N, seqlen, BLOCK_N, PAGE_SIZE)
        acc_a, acc_b, m_i, l_i = _attend_tile(
            acc_a, acc_b, m_i, l_i, q_a, q_b, q_pe, kv_ptr, page, start_n, seqlen, vis_len,
            stride_page, stride_tok, col_a, col_b, qk_scale, COMPUTE, DOT_PRECISION, PAGE_SIZE,
            BLOCK_N, HALF, BLOCK_PE, HEAD_DIM_V, DIM_PE, V_SPLIT, IS_FP8, True, LAZY_RESCALE)
        page = next_page

    # -- epilogue: normalize; rows that saw no key get out = 0, lse = -inf --
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)
    out_a = acc_a * inv_l[:, None]
    out_b = acc_b * inv_l[:, None]
    mask_a = row_ok[:, None] & ((col_a + offs_c) < HEAD_DIM_V)[None, :]
    mask_b = row_ok[:, None] & ((col_b + offs_c) < HEAD_DIM_V)[None, :]
    if IS_SPLIT:
        po_row = part_out_ptr + pid_b.to(tl.int64) * stride_pob + pid_s * stride_pos + offs_r * stride_por
        tl.store(po_row[:, None] + (col_a + offs_c)[None, :], out_a, mask=mask_a)
        if V_SPLIT == 1:
            tl.store(po_row[:, None] + (col_b + offs_c)[None, :], out_b, mask=mask_b)
        tl.store(part_lse_ptr + pid_b * stride_plb + pid_s * stride_pls + offs_r, lse, mask=row_ok & (v_part == 0))
    else:
        o_row = out_ptr + pid_b.to(tl.int64) * stride_ob + tok * stride_os + head * stride_oh
        tl.store(o_row[:, None] + (col_a + offs_c)[None, :], out_a.to(out_ptr.dtype.element_ty), mask=mask_a)
        if V_SPLIT == 1:
            tl.store(o_row[:, None] + (col_b + offs_c)[None, :], out_b.to(out_ptr.dtype.element_ty), mask=mask_b)
        tl.store(lse_ptr + pid_b * stride_lb + tok * stride_ls + head, lse, mask=row_ok & (v_part == 0))


@triton.jit
def _combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, num_splits, H, TOTAL_ROWS,
    stride_pob, stride_pos, stride_por, stride_plb, stride_pls,
    stride_ob, stride_os, stride_oh, stride_lb, stride_ls, ROWS,
    HEAD_DIM_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Grid (cdiv(b * ROWS, BLOCK_R), cdiv(HEAD_DIM_V, BLOCK_C)): for BLOCK_R of the batch's b * ROWS query rows,
    out = sum_s exp(lse_s - lse) * out_s over the splits, lse = log sum_s exp(lse_s). The splits are read
    SPLIT_CHUNK at a time ([BLOCK_R, SPLIT_CHUNK, BLOCK_C] tiles); combine_config makes that every split of a
    row (up to 128) in one load, so that the loads are in flight together, not a chain of dependent ones."""
    g = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)      # rows of the whole batch, request-major
    row_ok = g < TOTAL_ROWS
    pid_b = g // ROWS
    r = g % ROWS
    lse_rows = part_lse_ptr + pid_b * stride_plb + r
    offs_s = tl.arange(0, BLOCK_S)
    lse_s = tl.load(lse_rows[:, None] + offs_s[None, :] * stride_pls,
                    mask=row_ok[:, None] & (offs_s < num_splits)[None, :], other=float("-inf"))
    m = tl.max(lse_s, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lse_s - m[:, None]), 1)
    empty = total == 0.0
    inv_total = 1.0 / tl.where(empty, 1.0, total)

    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < HEAD_DIM_V
    po_rows = part_out_ptr + pid_b.to(tl.int64) * stride_pob + r * stride_por
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        offs = s0 + tl.arange(0, SPLIT_CHUNK)
        ok = row_ok[:, None] & (offs < num_splits)[None, :]                       # [R, S]
        w = tl.exp(tl.load(lse_rows[:, None] + offs[None, :] * stride_pls, mask=ok, other=float("-inf"))
                   - m[:, None]) * inv_total[:, None]
        o = tl.load(po_rows[:, None, None] + offs[None, :, None] * stride_pos + offs_c[None, None, :],
                    mask=ok[:, :, None] & c_ok[None, None, :], other=0.0)        # [R, S, C]
        acc += tl.sum(w[:, :, None] * o, 1)
    tok = r // H
    head = r % H
    o_rows = out_ptr + pid_b.to(tl.int64) * stride_ob + tok * stride_os + head * stride_oh
    tl.store(o_rows[:, None] + offs_c[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & c_ok[None, :])
    if tl.program_id(1) == 0:
        lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, total)))
        tl.store(lse_ptr + pid_b * stride_lb + tok * stride_ls + head, lse, mask=row_ok)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


class CombineConfig(NamedTuple):
    """The split combine's launch: BLOCK_R rows x BLOCK_C columns per program, SPLIT_CHUNK splits per load."""
    block_r: int
    block_c: int
    split_chunk: int
    num_warps: int


def combine_config(total_rows: int, num_splits: int, d_v: int) -> CombineConfig:
    """The combine's launch for b * s_q * h rows of `num_splits` partials: every split of a row in one load (up to
    128), 128 columns, and as many rows per program as keep a program's [rows, splits, 128] fp32 tile at 16384
    values (at most 16 rows). All of a program's loads are then in flight at once, where the rule before read 8
    splits at a time: scripts/combine_sweep.py on the H200 (whole decode calls, bench/NOTES.md item 46) took b 1
    h 128 from 45.2 to 35.9 us, b 4 h 128 from 85.0 to 79.5, b 4 h 64 from 70.0 to 59.8 (the CuTe kernel) and
    Triton's b 1 h 16 from 31.2 to 27.5, b 4 h 16 from 58.8 to 56.2; the best of 13-21 configs at every shape."""
    block_c = min(128, max(32, triton.next_power_of_2(d_v)))
    split_chunk = min(128, triton.next_power_of_2(num_splits))
    block_r = max(1, min(16, 16384 // (split_chunk * block_c), triton.next_power_of_2(total_rows)))
    return CombineConfig(block_r, block_c, split_chunk, 4)


def combine_splits(plan: MLADecodePlan, out: torch.Tensor, lse: torch.Tensor) -> None:
    """out [b, s_q, h, d_v], lse [b, s_q, h] from the plan's per-split partials (the combine of the Triton and
    the CuTe DSL decodes). Launching it as a programmatic dependent of the split kernel (launch_pdl, with
    griddepcontrol) measured no faster after the CuTe kernel and twice as slow after the Triton one at b 1
    h 16 (74.9 against 35.2 us), so it is an ordinary launch."""
    b, s_q, h, d_v = out.shape
    po, pl = plan.partial_out, plan.partial_lse
    total_rows = b * s_q * h
    cfg = combine_config(total_rows, plan.num_splits, d_v)
    _combine_kernel[(triton.cdiv(total_rows, cfg.block_r), triton.cdiv(d_v, cfg.block_c))](
        po, pl, out, lse, plan.num_splits, h, total_rows,
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), s_q * h,
        HEAD_DIM_V=d_v, BLOCK_R=cfg.block_r, BLOCK_S=triton.next_power_of_2(plan.num_splits),
        SPLIT_CHUNK=cfg.split_chunk, BLOCK_C=cfg.block_c, num_warps=cfg.num_warps)


def mla_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal=True, head_dim_v=512,
               num_splits: int | None = None, config: MLADecodeConfig | None = None,
               plan: MLADecodePlan | None = None):
    """Absorbed MLA over a paged latent cache (semantics of mlaserve.kernels.reference.mla_decode).

    q [b, s_q, h, d_qk] bf16/fp16/fp32; kv_cache [pages, page_size, d_qk] in q's dtype or uint8
    [pages, page_size, 656] (FP8); block_table int32 [b, max_pages]; cache_seqlens int32 [b].
    Returns out [b, s_q, h, head_dim_v] in q's dtype and lse float32 [b, s_q, h] (natural log).
    Without `plan`, one is made here (`num_splits`/`config` override its choices).
    """
    b, s_q, h, d_qk = q.shape
    kv_fp8 = kv_cache.dtype == torch.uint8
    page_size = kv_cache.shape[1]
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("Triton's CPU interpreter computes tl.dot on bfloat16 wrongly (triton#11584): "
                         "use fp16/fp32 on the CPU, or backend='torch'")
    if plan is None:
        plan = plan_mla_decode(b, s_q, h, head_dim_v, block_table.shape[1], page_size, kv_fp8, q.device,
                               num_splits=num_splits, config=config)
    elif b > plan.max_batch or plan.rows != s_q * h or plan.head_dim_v != head_dim_v:
        raise ValueError(f"plan for <= {plan.max_batch} requests x {plan.rows} rows, head_dim_v {plan.head_dim_v} "
                         f"does not fit q {tuple(q.shape)} with head_dim_v {head_dim_v}")
    cfg = plan.config
    out = torch.empty(b, s_q, h, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=q.device)
    if b == 0:
        return out, lse
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("q, kv_cache and block_table must be contiguous in their last dim")
    block_v = max(32, triton.next_power_of_2(head_dim_v))
    dim_pe = (fp8_format.ROPE_DIM if kv_fp8 else d_qk - head_dim_v)
    if kv_fp8 and head_dim_v != fp8_format.KV_LORA_RANK:
        raise ValueError(f"FP8 KV needs head_dim_v {fp8_format.KV_LORA_RANK}, got {head_dim_v}")
    if cfg.gluon and cfg.block_h == 64:
        from mlaserve.kernels.triton import mla_decode_gluon, mla_decode_gluon_seesaw
        seesaw = mla_decode_gluon_seesaw.supports(q, kv_cache, head_dim_v) and cfg.num_stages == 2
        if seesaw or mla_decode_gluon.supports(q, kv_cache, head_dim_v):
            order = grid_order(cache_seqlens, b * triton.cdiv(s_q * h, 64), plan.num_splits)
            if seesaw:    # bf16 KV
                mla_decode_gluon_seesaw.mla_decode_gluon_seesaw(q, kv_cache, block_table, cache_seqlens.contiguous(),
                                                                softmax_scale, causal, plan, out, lse, order=order)
            else:
                mla_decode_gluon.mla_decode_gluon(q, kv_cache, block_table, cache_seqlens.contiguous(), softmax_scale,
                                                  causal, plan, out, lse, stages=cfg.num_stages, order=order)
            return out, lse
    if cfg.gluon and cfg.block_h == 16 and uses_fp8_mma(cfg, kv_fp8, block_table.shape[1], plan.num_splits, s_q):
        from mlaserve.kernels.triton import mla_decode_gluon_fp8mma
        if mla_decode_gluon_fp8mma.supports(q, kv_cache, head_dim_v):
            mla_decode_gluon_fp8mma.mla_decode_gluon_fp8mma(q, kv_cache, block_table, cache_seqlens.contiguous(),
                                                            softmax_scale, causal, plan, out, lse,
                                                            order=grid_order(cache_seqlens, b, plan.num_splits))
            return out, lse
    if cfg.gluon and cfg.block_h in (16, 32):
        from mlaserve.kernels.triton import mla_decode_gluon_narrow
        if mla_decode_gluon_narrow.supports(q, kv_cache, head_dim_v):
            mla_decode_gluon_narrow.mla_decode_gluon_narrow(q, kv_cache, block_table, cache_seqlens.contiguous(),
                                                            softmax_scale, causal, plan, out, lse,
                                                            order=grid_order(cache_seqlens, b, plan.num_splits))
            return out, lse
    if cfg.gluon and cfg.block_h == 64 and s_q * h <= 32:
        # no Gluon here: the tl kernel's own config for <= 32 rows (32-row blocks, 3 stages) on the same grid
        cfg = dataclasses.replace(cfg, block_h=32, num_stages=3, gluon=False)
    split = plan.num_splits > 1
    po, pl = (plan.partial_out, plan.partial_lse) if split else (out, lse)  # unused pointers when not split
    grid = (b * triton.cdiv(s_q * h, cfg.block_h) * cfg.v_split, plan.num_splits)
    order = grid_order(cache_seqlens, grid[0], plan.num_splits)
    _mla_decode_kernel[grid](
        q, kv_cache, block_table, cache_seqlens.contiguous(), out, lse, po, pl,
        cache_seqlens if order is None else order,
        softmax_scale * _LOG2E, plan.num_splits, h, s_q, s_q * h,
        q.stride(0), q.stride(1), q.stride(2), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        CAUSAL=causal, COMPUTE=_TL_DTYPES[q.dtype], DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PAGE_SIZE=page_size, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, HALF=block_v // 2,
        BLOCK_PE=max(16, triton.next_power_of_2(dim_pe)) if dim_pe else 16, HEAD_DIM_V=head_dim_v, DIM_PE=dim_pe,
        V_SPLIT=cfg.v_split, IS_FP8=kv_fp8, IS_SPLIT=split, NUM_STAGES=cfg.num_stages, LAZY_RESCALE=cfg.lazy_rescale,
        ORDERED=order is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split:
        combine_splits(plan, out, lse)
    return out, lse
