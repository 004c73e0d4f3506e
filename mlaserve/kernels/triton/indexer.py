"""The DSA lightning indexer in Triton: scores of every visible key, then top-k.

Semantics are those of `mlaserve.kernels.reference.indexer_topk`. Two phases:

1. `indexer_scores`: one program per (request, range of key positions, group of query
   tokens). For BLOCK_T tokens at a time it loads their [BLOCK_T * H_I, D_I] query rows once,
   then streams its keys through the block table BLOCK_N at a time (pipelined) and computes
   [BLOCK_N, D_I] x [D_I, BLOCK_T * H_I] (keys on the M dimension, so that the weighted sum
   over heads reduces along the accumulator's columns, inside a thread and its quad), ReLU,
   weight, sum over heads -> float32 scores by logical position, -inf where the token cannot
   see the key. D_I^-0.5 is folded into the weights (ReLU commutes with a positive scale).
   In decode (s_q 1-2: one token block) every key is read exactly once; keys no token of the
   block can see are never read.
2. top-k over the scores, positions mapped to slot ids through the block table: torch.topk,
   or a Triton radix select (one program per score row: four 8-bit histogram passes find the
   k-th largest score, a last pass writes the winners) — `select=`, per regime in TUNED_SELECT.

Memory bound: the float32 score matrix of one launch is [requests, tokens, positions]; rows
are processed in chunks so that it never exceeds `max_score_bytes` (default 1 GiB) — e.g.
a 4096-token prefill over 65536 positions (1 GiB) runs in one chunk, 131072 positions in two.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

DEFAULT_MAX_SCORE_BYTES = 1 << 30


@dataclass(frozen=True)
class IndexerConfig:
    """Launch knobs of the scoring kernel.

    A program scores positions [k * keys_per_prog, (k + 1) * keys_per_prog) of one request for one
    group of its tokens (`token_groups` groups per request), BLOCK_T tokens x BLOCK_N keys per step.
    None in `keys_per_prog` / `token_groups` means: chosen from shapes to fill the GPU.
    """
    block_n: int = 64
    block_t: int = 1
    num_warps: int = 4
    num_stages: int = 3
    keys_per_prog: int | None = None
    token_groups: int | None = None

    def __post_init__(self):
        for name in ("block_n", "block_t"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad launch knobs: num_warps={self.num_warps}, num_stages={self.num_stages}")
        if self.keys_per_prog is not None and (self.keys_per_prog < 1 or self.keys_per_prog % self.block_n):
            raise ValueError(f"keys_per_prog must be a positive multiple of block_n={self.block_n}, "
                             f"got {self.keys_per_prog}")
        if self.token_groups is not None and self.token_groups < 1:
            raise ValueError(f"token_groups must be >= 1, got {self.token_groups}")


# Measured best configs on the H200 keyed by ("decode"|"prefill", H_I); filled from scripts/tune_sparse.py.
TUNED: dict[tuple[str, int], dict] = {
    ("decode", 64): {"block_n": 256, "block_t": 1, "num_warps": 8, "num_stages": 3},
    ("prefill", 64): {"block_n": 64, "block_t": 4, "num_warps": 4, "num_stages": 3},
}
# The faster top-k selection, keyed the same way: {"select": "torch"} or {"select": "triton", "block": ...,
# "num_warps": ...} (knobs of radix_select_slots); unmeasured keys use torch.topk.
TUNED_SELECT: dict[tuple[str, int], dict] = {
    ("decode", 64): {"select": "triton", "block": 4096, "num_warps": 8},
    ("prefill", 64): {"select": "torch"},
}

# Programs per SM that the grid aims for when it chooses key ranges and token groups.
_WAVES = 4


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def resolve_config(b: int, n_tok: int, n_heads: int, positions: int, device: torch.device,
                   **knobs) -> IndexerConfig:
    """Knobs given by the caller, else TUNED, else rules; then the grid split from shapes only.

    Rules: BLOCK_T so that BLOCK_T * H_I query rows make a 128-row operand; token groups of at
    least 64 tokens; key ranges so that requests x ranges x groups is about _WAVES x the SM count.
    """
    regime = "prefill" if n_tok > 8 else "decode"
    heads_p2 = max(16, triton.next_power_of_2(n_heads))
    base = dict(block_n=64, block_t=max(1, 128 // heads_p2), num_warps=4, num_stages=3)
    base.update(TUNED.get((regime, n_heads), {}))
    base.update({k: v for k, v in knobs.items() if v is not None})
    base["block_t"] = min(base["block_t"], triton.next_power_of_2(n_tok))
    cfg = IndexerConfig(**base)
    target = _WAVES * _num_sms(device)
    groups = cfg.token_groups or max(1, min(triton.cdiv(n_tok, 64), triton.cdiv(target, b)))
    groups = min(groups, triton.cdiv(n_tok, cfg.block_t))
    keys = cfg.keys_per_prog
    if keys is None:
        ranges = max(1, min(triton.cdiv(positions, cfg.block_n), triton.cdiv(target, b * groups)))
        keys = triton.cdiv(triton.cdiv(positions, ranges), cfg.block_n) * cfg.block_n
    return IndexerConfig(cfg.block_n, cfg.block_t, cfg.num_warps, cfg.num_stages, keys, groups)


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, k_ptr, bt_ptr, seqlens_ptr, out_ptr,
    stride_qb, stride_qt, stride_qh, stride_wb, stride_wt, stride_k, stride_btb, stride_ob, stride_ot,
    S_Q, T0, N_TOK, TOKENS_PER_GROUP, KEYS_PER_PROG, POSITIONS, scale,
    H_I: tl.constexpr, D_I: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Scores of one request's positions [pid_k * KEYS_PER_PROG, +KEYS_PER_PROG) for one token group.

    q [b, s_q, H_I, D_I]; w f32 [b, s_q, H_I]; k [slots, D_I]; bt int32 [b, max_pages]; seqlens int32 [b];
    out f32 [b, N_TOK, POSITIONS] for tokens T0 .. T0 + N_TOK - 1.
    """
    pid_k = tl.program_id(0)
    pid_g = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    seqlen = tl.load(seqlens_ptr + pid_b)
    # Token t of this launch sees positions 0 .. horizon + t.
    horizon = seqlen - S_Q + T0
    first_t = pid_g * TOKENS_PER_GROUP
    last_t = tl.minimum(first_t + TOKENS_PER_GROUP, N_TOK)
    key_lo = pid_k * KEYS_PER_PROG
    key_hi = tl.minimum(key_lo + KEYS_PER_PROG, POSITIONS)

    R: tl.constexpr = BLOCK_T * BLOCK_HI
    offs_r = tl.arange(0, R)
    r_head = offs_r % BLOCK_HI
    offs_d = tl.arange(0, BLOCK_D)
    bt_row = bt_ptr + pid_b * stride_btb
    out_row = out_ptr + pid_b * stride_ob

    for t0 in range(first_t, last_t, BLOCK_T):
        # -- BLOCK_T tokens x H_I heads as the N operand; padded rows have weight 0 --
        offs_t = t0 + tl.arange(0, BLOCK_T)
        tok = t0 + offs_r // BLOCK_HI
        r_mask = (tok < last_t) & (r_head < H_I)
        q_mask = r_mask[:, None]
        if BLOCK_D != D_I:
            q_mask = q_mask & (offs_d[None, :] < D_I)
        q = tl.load(q_ptr + pid_b * stride_qb + (T0 + tok).to(tl.int64)[:, None] * stride_qt
                    + r_head[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)   # [R, BLOCK_D]
        w = tl.load(w_ptr + pid_b * stride_wb + (T0 + tok) * stride_wt + r_head, mask=r_mask, other=0.0) * scale
        t_mask = offs_t < last_t
        # Positions [key_lo, vis_hi) are visible to some token of the block; the rest only get -inf.
        vis_hi = tl.minimum(key_hi, horizon + tl.minimum(t0 + BLOCK_T, last_t))
        for n0 in range(key_lo, vis_hi, BLOCK_N):
            # -- keys through the block table; positions nobody here sees are not read --
            offs_n = n0 + tl.arange(0, BLOCK_N)
            needed = offs_n < vis_hi
            page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=needed, other=0)
            slots = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
            k_mask = needed[:, None]
            if BLOCK_D != D_I:
                k_mask = k_mask & (offs_d[None, :] < D_I)
            keys = tl.load(k_ptr + slots[:, None] * stride_k + offs_d[None, :], mask=k_mask, other=0.0)
            # -- score = sum over heads of w * relu(k . q) --
            logits = tl.dot(keys, tl.trans(q))                                               # [BLOCK_N, R]
            s = tl.sum(tl.reshape(tl.maximum(logits, 0.0) * w[None, :], [BLOCK_N, BLOCK_T, BLOCK_HI]), 2)
            visible = offs_n[:, None] <= horizon + offs_t[None, :]
            s = tl.where(visible, s, float("-inf"))                                          # [BLOCK_N, BLOCK_T]
            tl.store(out_row + offs_t[None, :].to(tl.int64) * stride_ot + offs_n[:, None], s,
                     mask=t_mask[None, :] & (offs_n[:, None] < key_hi))
        inf_lo = key_lo + tl.cdiv(tl.maximum(vis_hi - key_lo, 0), BLOCK_N) * BLOCK_N
        for n0 in range(inf_lo, key_hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            s = tl.full([BLOCK_N, BLOCK_T], float("-inf"), dtype=tl.float32)
            tl.store(out_row + offs_t[None, :].to(tl.int64) * stride_ot + offs_n[:, None], s,
                     mask=t_mask[None, :] & (offs_n[:, None] < key_hi))


def indexer_scores(q, weights, k_cache, block_table, cache_seqlens, *, token_start=0, token_end=None,
                   out=None, **knobs):
    """Indexer scores of every key position, causal.

    Args:
        q: [b, s_q, H_I, D_I]; weights: float32 [b, s_q, H_I]; k_cache: [pages, page_size, D_I];
        block_table: int32 [b, max_pages]; cache_seqlens: int32 [b] (including the s_q new tokens).
        token_start, token_end: score only tokens [token_start, token_end) of each request.
        out: optional float32 [b, token_end - token_start, max_pages * page_size] to write into.
        knobs: IndexerConfig fields (block_n, block_t, num_warps, num_stages, keys_per_prog, token_groups).
    Returns:
        float32 [b, token_end - token_start, max_pages * page_size]: score of the key at logical
        position p of the request (slot block_table[p // page_size] * page_size + p % page_size),
        -inf where the token cannot see position p.
    """
    b, s_q, n_heads, d = q.shape
    page_size = k_cache.shape[1]
    positions = block_table.shape[1] * page_size
    token_end = s_q if token_end is None else token_end
    n_tok = token_end - token_start
    if out is None:
        out = torch.empty(b, n_tok, positions, dtype=torch.float32, device=q.device)
    if b == 0 or n_tok == 0 or positions == 0:
        return out
    if k_cache.stride(-1) != 1 or k_cache.stride(0) != page_size * k_cache.stride(1):
        raise ValueError(f"k_cache must have contiguous rows and pages; got strides {k_cache.stride()}")
    if out.stride(-1) != 1:
        raise ValueError(f"out must be contiguous in its last dim; got strides {out.stride()}")
    cfg = resolve_config(b, n_tok, n_heads, positions, q.device, **knobs)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    keys = k_cache.view(-1, d)
    per_group = triton.cdiv(triton.cdiv(n_tok, cfg.token_groups), cfg.block_t) * cfg.block_t
    grid = (triton.cdiv(positions, cfg.keys_per_prog), triton.cdiv(n_tok, per_group), b)
    _indexer_scores_kernel[grid](
        q, weights, keys, block_table, cache_seqlens, out,
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1), keys.stride(0),
        block_table.stride(0), out.stride(0), out.stride(1),
        s_q, token_start, n_tok, per_group, cfg.keys_per_prog, positions, d ** -0.5,
        H_I=n_heads, D_I=d, BLOCK_HI=max(16, triton.next_power_of_2(n_heads)),
        BLOCK_D=max(16, triton.next_power_of_2(d)), PAGE_SIZE=page_size,
        BLOCK_N=cfg.block_n, BLOCK_T=cfg.block_t, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def scores_to_slots(scores, block_table, topk):
    """Top-k of a score chunk as slot ids, through torch.topk.

    scores f32 [b, n_tok, positions]; block_table int32 [b, max_pages]
    -> int32 [b, n_tok, topk], -1 for invisible picks and where fewer than topk positions exist.
    """
    b, n_tok, positions = scores.shape
    page_size = positions // block_table.shape[1]
    k = min(topk, positions)
    values, pos = scores.topk(k, dim=-1, sorted=False)                                  # [b, n_tok, k]
    pages = torch.gather(block_table, 1, (pos // page_size).view(b, -1)).view(b, n_tok, k)
    slots = (pages * page_size + (pos % page_size)).to(torch.int32)
    slots = slots.masked_fill(values == float("-inf"), -1)
    if k < topk:
        slots = torch.nn.functional.pad(slots, (0, topk - k), value=-1)
    return slots


@triton.jit
def _order_key(x):
    """float32 -> uint32 whose unsigned order is the float order (-inf smallest)."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _radix_select_kernel(scores_ptr, bt_ptr, out_ptr, POSITIONS, K, TOPK, ROWS_PER_REQ,
                         stride_sr, stride_btb, stride_or,
                         PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Top-K positions of one score row by radix select, written as slot ids.

    scores f32 [rows, POSITIONS]; out int32 [rows, TOPK]: K = min(TOPK, POSITIONS) picks in any order
    (slot id, or -1 for a -inf score), then -1 up to TOPK. Four passes of 8-bit histograms find the
    K-th largest key T; a last pass writes every key > T and the first ones == T.
    """
    row = tl.program_id(0).to(tl.int64)
    src = scores_ptr + row * stride_sr
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], dtype=tl.uint32)
    prefix_mask = tl.zeros([], dtype=tl.uint32)
    k_left = K
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], dtype=tl.int32)
        for c in tl.range(0, POSITIONS, BLOCK, num_stages=NUM_STAGES):
            in_row = c + offs < POSITIONS
            key = _order_key(tl.load(src + c + offs, mask=in_row, other=float("-inf")))
            match = in_row & ((key & prefix_mask) == prefix)
            hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=match)
        at_or_above = tl.cumsum(hist, 0, reverse=True)                      # keys with digit >= d
        digit = tl.max(tl.where(at_or_above >= k_left, bins, 0), 0)
        k_left -= tl.sum(tl.where(bins > digit, hist, 0), 0)
        prefix = prefix | (digit.to(tl.uint32) << shift)
        prefix_mask = prefix_mask | (tl.full([], 0xFF, tl.uint32) << shift)

    # -- write keys > T, and the first k_left keys == T --
    dst = out_ptr + row * stride_or
    bt_row = bt_ptr + (row // ROWS_PER_REQ) * stride_btb
    n_out = 0
    n_tied = 0
    for c in tl.range(0, POSITIONS, BLOCK, num_stages=NUM_STAGES):
        pos = c + offs
        in_row = pos < POSITIONS
        x = tl.load(src + pos, mask=in_row, other=float("-inf"))
        key = _order_key(x)
        tied = in_row & (key == prefix)
        tie_rank = n_tied + tl.cumsum(tied.to(tl.int32), 0) - 1
        take = (in_row & (key > prefix)) | (tied & (tie_rank < k_left))
        out_pos = n_out + tl.cumsum(take.to(tl.int32), 0) - 1
        page = tl.load(bt_row + pos // PAGE_SIZE, mask=take, other=0)
        slot = tl.where(x == float("-inf"), -1, page * PAGE_SIZE + pos % PAGE_SIZE)
        tl.store(dst + out_pos, slot, mask=take)
        n_out += tl.sum(take.to(tl.int32), 0)
        n_tied += tl.sum(tied.to(tl.int32), 0)
    for c in range(K, TOPK, BLOCK):
        tl.store(dst + c + offs, tl.full([BLOCK], -1, tl.int32), mask=c + offs < TOPK)


def radix_select_slots(scores, block_table, topk, block=4096, num_warps=16, num_stages=2):
    """Same contract as `scores_to_slots`, through one Triton radix-select program per score row."""
    b, n_tok, positions = scores.shape
    out = torch.empty(b, n_tok, topk, dtype=torch.int32, device=scores.device)
    if scores.stride(-1) != 1 or scores.stride(0) != n_tok * scores.stride(1):
        scores = scores.contiguous()
    _radix_select_kernel[(b * n_tok,)](
        scores, block_table, out, positions, min(topk, positions), topk, n_tok,
        scores.stride(1), block_table.stride(0), topk,
        PAGE_SIZE=positions // block_table.shape[1], BLOCK=block, NUM_STAGES=num_stages, num_warps=num_warps,
    )
    return out


_SELECTS = {"torch": scores_to_slots, "triton": radix_select_slots}


def indexer_topk(q, weights, k_cache, block_table, cache_seqlens, topk, *, max_score_bytes=DEFAULT_MAX_SCORE_BYTES,
                 select=None, **knobs):
    """Top-k cache slots by indexer score, causal.

    Args:
        q: [b, s_q, H_I, D_I]; weights: float32 [b, s_q, H_I]; k_cache: [pages, page_size, D_I];
        block_table: int32 [b, max_pages]; cache_seqlens: int32 [b]; topk: int.
        max_score_bytes: bound on the float32 score matrix alive at once (rows are chunked to fit).
        select: "torch" (torch.topk) or "triton" (radix select); None: TUNED_SELECT for the regime, else "torch".
        knobs: IndexerConfig fields for `indexer_scores`.
    Returns:
        int32 [b, s_q, topk] slot ids in any order, -1 where fewer than topk keys are visible.
    """
    b, s_q, n_heads = q.shape[:3]
    positions = block_table.shape[1] * k_cache.shape[1]
    choice = dict(TUNED_SELECT.get(("prefill" if s_q > 8 else "decode", n_heads), {"select": "torch"}))
    if select is not None:
        choice = {"select": select}
    if choice["select"] not in _SELECTS:
        raise ValueError(f"select must be one of {sorted(_SELECTS)}, got {choice['select']!r}")
    select_fn = _SELECTS[choice.pop("select")]
    result = torch.empty(b, s_q, topk, dtype=torch.int32, device=q.device)
    if b == 0:
        return result
    if positions == 0:
        return result.fill_(-1)
    row_bytes = positions * 4
    if b * s_q * row_bytes <= max_score_bytes:
        req_chunk, tok_chunk = b, s_q
    else:
        req_chunk = max(1, max_score_bytes // (s_q * row_bytes))
        tok_chunk = s_q if req_chunk > 1 else max(1, min(s_q, max_score_bytes // row_bytes))
    for r0 in range(0, b, req_chunk):
        r1 = min(r0 + req_chunk, b)
        for t0 in range(0, s_q, tok_chunk):
            t1 = min(t0 + tok_chunk, s_q)
            scores = indexer_scores(q[r0:r1], weights[r0:r1], k_cache, block_table[r0:r1], cache_seqlens[r0:r1],
                                    token_start=t0, token_end=t1, **knobs)
            result[r0:r1, t0:t1] = select_fn(scores, block_table[r0:r1], topk, **choice)
    return result
