"""The `torch` backend: the reference MLA/DSA math, float32 accumulation, any device.

Every other backend is tested against these functions. They favour clarity over
speed (a loop over requests, host reads of lengths) but stay memory-bounded so that
the benchmark can time them at real shapes. Inputs are assumed valid: `mlaserve.ops`
checks them first.
"""

import torch

from mlaserve.kernels import fp8_format

# Upper bound on the float32 elements of a gathered [tokens, topk, d] block in sparse_mla.
_SPARSE_CHUNK_ELEMS = 1 << 26


def _gather_rows(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of the cache at `slots` (int64 [n]) as float32 [n, d]; dequantizes FP8 rows only where read."""
    rows = kv_cache.reshape(-1, kv_cache.shape[-1])[slots]
    if rows.dtype == torch.uint8:
        return fp8_format.dequantize(rows, torch.float32)
    return rows.float()


def _request_slots(block_table_row: torch.Tensor, seqlen: int, page_size: int) -> torch.Tensor:
    """Slot ids (int64 [seqlen]) of a request's first `seqlen` cached tokens."""
    pos = torch.arange(seqlen, device=block_table_row.device)
    pages = block_table_row[pos // page_size].long()
    return pages * page_size + pos % page_size


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float):
    """Softmax attention with empty rows defined.

    q [m, h, d] f32, k [n, d] f32, v [n, dv] f32, visible bool [m, n] -> (out [m, h, dv] f32, lse [m, h] f32).
    Invisible keys contribute nothing, even when their values are NaN.
    """
    scores = torch.einsum("mhd,nd->mhn", q, k) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for rows with nothing visible
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    probs = probs.masked_fill(~visible[:, None, :], 0.0)
    v = v.masked_fill(~visible.any(dim=0)[:, None], 0.0)
    out = torch.einsum("mhn,nd->mhd", probs, v)
    return out, lse


def mla_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal=True, head_dim_v=512):
    """Absorbed MLA over a paged latent cache.

    q [b, s_q, h, d_qk]; kv_cache [pages, page_size, d_qk] or uint8 [pages, page_size, 656];
    block_table int32 [b, max_pages]; cache_seqlens int32 [b] (including the s_q new tokens).
    Returns out [b, s_q, h, head_dim_v] in q's dtype and lse float32 [b, s_q, h].
    """
    b, s_q, h, _ = q.shape
    page_size = kv_cache.shape[1]
    out = torch.zeros(b, s_q, h, head_dim_v, dtype=torch.float32, device=q.device)
    lse = torch.full((b, s_q, h), float("-inf"), dtype=torch.float32, device=q.device)
    for i, seqlen in enumerate(cache_seqlens.tolist()):
        if seqlen <= 0:
            continue
        kv = _gather_rows(kv_cache, _request_slots(block_table[i], seqlen, page_size))  # [n, d_qk]
        pos = torch.arange(seqlen, device=q.device)
        if causal:
            last = seqlen - s_q + torch.arange(s_q, device=q.device)  # [s_q]: last visible position
            visible = pos[None, :] <= last[:, None]
        else:
            visible = torch.ones(s_q, seqlen, dtype=torch.bool, device=q.device)
        out[i], lse[i] = _attend(q[i].float(), kv, kv[:, :head_dim_v], visible, softmax_scale)
    return out.to(q.dtype), lse


def sparse_mla(q, kv_cache, indices, softmax_scale, head_dim_v=512):
    """Absorbed MLA over selected cache slots.

    q [b, s_q, h, d_qk]; kv_cache as in mla_decode; indices int32 [b, s_q, topk] of slot ids, -1 unused.
    Returns out [b, s_q, h, head_dim_v] in q's dtype and lse float32 [b, s_q, h].
    """
    b, s_q, h, d_qk = q.shape
    topk = indices.shape[-1]
    qf = q.reshape(b * s_q, h, d_qk)
    idx = indices.reshape(b * s_q, topk).long()
    out = torch.empty(b * s_q, h, head_dim_v, dtype=torch.float32, device=q.device)
    lse = torch.empty(b * s_q, h, dtype=torch.float32, device=q.device)
    chunk = max(1, _SPARSE_CHUNK_ELEMS // max(1, topk * d_qk))
    for start in range(0, b * s_q, chunk):
        sl = slice(start, start + chunk)
        valid = idx[sl] >= 0                                        # [m, topk]
        kv = _gather_rows(kv_cache, idx[sl].clamp_min(0).flatten())
        kv = kv.view(valid.shape[0], topk, d_qk).masked_fill(~valid[..., None], 0.0)
        scores = torch.einsum("mhd,mtd->mht", qf[sl].float(), kv) * softmax_scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        lse_c = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse_c.nan_to_num(neginf=0.0)[..., None])
        out[sl] = torch.einsum("mht,mtd->mhd", probs, kv[..., :head_dim_v])
        lse[sl] = lse_c
    return out.view(b, s_q, h, head_dim_v).to(q.dtype), lse.view(b, s_q, h)


def indexer_scores(q, weights, keys):
    """DSA lightning-indexer scores for one request.

    q [s_q, H_I, D_I]; weights float32 [s_q, H_I]; keys [n, D_I] -> float32 [s_q, n]:
    score(t, s) = sum_j weights[t, j] * relu(D_I^-0.5 * q[t, j] . keys[s]).
    """
    logits = torch.einsum("thd,nd->thn", q.float(), keys.float()) * (q.shape[-1] ** -0.5)
    return torch.einsum("thn,th->tn", logits.relu(), weights.float())


def indexer_topk(q, weights, k_cache, block_table, cache_seqlens, topk):
    """Top-k cache slots by indexer score, causal.

    q [b, s_q, H_I, D_I]; weights float32 [b, s_q, H_I]; k_cache [pages, page_size, D_I];
    block_table int32 [b, max_pages]; cache_seqlens int32 [b].
    Returns int32 [b, s_q, topk]: slot ids of the best visible keys, -1 where fewer are visible.
    """
    b, s_q = q.shape[:2]
    page_size = k_cache.shape[1]
    result = torch.full((b, s_q, topk), -1, dtype=torch.int32, device=q.device)
    for i, seqlen in enumerate(cache_seqlens.tolist()):
        if seqlen <= 0:
            continue
        slots = _request_slots(block_table[i], seqlen, page_size)
        scores = indexer_scores(q[i], weights[i], _gather_rows(k_cache, slots))  # [s_q, n]
        last = seqlen - s_q + torch.arange(s_q, device=q.device)
        visible = torch.arange(seqlen, device=q.device)[None, :] <= last[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(topk, seqlen)
        top_scores, top_pos = scores.topk(k, dim=-1)
        chosen = slots[top_pos].to(torch.int32)
        result[i, :, :k] = chosen.masked_fill(top_scores == float("-inf"), -1)
    return result

