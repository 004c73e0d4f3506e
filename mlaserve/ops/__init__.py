"""mlaserve's public kernel API (DESIGN.md, "The public kernel API") — a contract.

Every function checks its inputs and raises `ValueError` naming the offending values,
then dispatches to a kernel backend by name (`backend=None`: the fastest available;
"torch": the reference, which runs anywhere). Value-range checks that need the data
(index bounds) run only on CPU tensors, so that GPU calls never synchronize and stay
capturable in CUDA graphs.
"""

import torch

from mlaserve.kernels import fp8_format
from mlaserve.ops import registry
from mlaserve.ops.registry import available

__all__ = ["mla_decode", "sparse_mla", "indexer_topk", "quantize_kv_fp8", "dequantize_kv_fp8", "available"]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_tensor(name, t, ndim=None, dtypes=None):
    _check(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        _check(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None:
        _check(t.dtype in dtypes, f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def _check_same_device(**tensors):
    devices = {name: t.device for name, t in tensors.items()}
    _check(len(set(devices.values())) == 1, f"all tensors must be on one device, got {devices}")


def _check_kv_cache(kv_cache, d_qk, head_dim_v, name="kv_cache"):
    _check_tensor(name, kv_cache, 3, _FLOAT_DTYPES + (torch.uint8,))
    if kv_cache.dtype == torch.uint8:
        _check(kv_cache.shape[-1] == fp8_format.PACKED_BYTES,
               f"an FP8 {name} must have {fp8_format.PACKED_BYTES} bytes per token, got shape {tuple(kv_cache.shape)}")
        _check(d_qk == fp8_format.D_QK and head_dim_v == fp8_format.KV_LORA_RANK,
               f"the FP8 KV format is defined for d_qk={fp8_format.D_QK}, head_dim_v={fp8_format.KV_LORA_RANK}; "
               f"got d_qk={d_qk}, head_dim_v={head_dim_v}")
    else:
        _check(kv_cache.shape[-1] == d_qk,
               f"{name} last dim {kv_cache.shape[-1]} must equal q's head dim {d_qk}")
    _check(kv_cache.shape[1] > 0, f"{name} page_size must be > 0, got shape {tuple(kv_cache.shape)}")


def _check_paging(block_table, cache_seqlens, b, num_pages, page_size):
    _check_tensor("block_table", block_table, 2, (torch.int32,))
    _check_tensor("cache_seqlens", cache_seqlens, 1, (torch.int32,))
    _check(block_table.shape[0] == b, f"block_table has {block_table.shape[0]} rows, expected batch size {b}")
    _check(cache_seqlens.shape[0] == b, f"cache_seqlens has {cache_seqlens.shape[0]} entries, expected {b}")
    if cache_seqlens.device.type == "cpu" and b > 0:
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        cap = block_table.shape[1] * page_size
        _check(lo >= 0, f"cache_seqlens must be >= 0, got min {lo}")
        _check(hi <= cap, f"cache_seqlens max {hi} exceeds block_table capacity "
                          f"{block_table.shape[1]} pages x {page_size} = {cap}")
        needed = (cache_seqlens.long() + page_size - 1) // page_size
        used = torch.arange(block_table.shape[1])[None, :] < needed[:, None]
        pages = block_table[used]
        if pages.numel():
            _check(int(pages.min()) >= 0 and int(pages.max()) < num_pages,
                   f"block_table holds page ids in [{int(pages.min())}, {int(pages.max())}] "
                   f"for cached tokens; the cache has {num_pages} pages")


def mla_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal=True, head_dim_v=512,
               backend=None, **options):
    """Absorbed MLA over a paged latent cache (MQA with one shared latent KV head).

    Args:
        q: [b, s_q, h, d_qk] bf16/fp16/fp32 — [q_lat, q_pe] per head.
        kv_cache: [num_pages, page_size, d_qk] in a float dtype, or uint8 [num_pages, page_size, 656] (FP8).
        block_table: int32 [b, max_pages] page ids.
        cache_seqlens: int32 [b], cached tokens per request including the s_q new ones.
        softmax_scale: float.
        causal: new token j of request i sees positions 0 .. cache_seqlens[i] - s_q + j.
        head_dim_v: V is the first head_dim_v values of each cached row.
        backend: None (fastest available), "torch", "triton", ...
        options: backend-specific tuning (e.g. the triton backend's `num_splits`).
    Returns:
        out [b, s_q, h, head_dim_v] in q's dtype, lse float32 [b, s_q, h] (natural log; -inf for empty rows).
    """
    _check_tensor("q", q, 4, _FLOAT_DTYPES)
    b, s_q, h, d_qk = q.shape
    _check(s_q >= 1 and h >= 1, f"q must have s_q >= 1 and h >= 1, got shape {tuple(q.shape)}")
    _check(0 < head_dim_v <= d_qk, f"head_dim_v must be in (0, d_qk={d_qk}], got {head_dim_v}")
    _check_kv_cache(kv_cache, d_qk, head_dim_v)
    if kv_cache.dtype != torch.uint8:
        _check(kv_cache.dtype == q.dtype, f"kv_cache dtype {kv_cache.dtype} must match q dtype {q.dtype}")
    _check_same_device(q=q, kv_cache=kv_cache, block_table=block_table, cache_seqlens=cache_seqlens)
    _check_paging(block_table, cache_seqlens, b, kv_cache.shape[0], kv_cache.shape[1])
    _check(isinstance(softmax_scale, (float, int)) and softmax_scale > 0,
           f"softmax_scale must be a positive number, got {softmax_scale!r}")
    fn = registry.resolve("mla_decode", backend, q.device)
    return fn(q, kv_cache, block_table, cache_seqlens, float(softmax_scale), causal=causal,
              head_dim_v=head_dim_v, **options)


def sparse_mla(q, kv_cache, indices, softmax_scale, head_dim_v=512, backend=None, **options):
    """Absorbed MLA over the cache slots each query token selected (DSA).

    Args:
        q: [b, s_q, h, d_qk]; kv_cache as in `mla_decode`.
        indices: int32 [b, s_q, topk] slot ids (page * page_size + offset); -1 = unused.
    Returns:
        out [b, s_q, h, head_dim_v] in q's dtype, lse float32 [b, s_q, h].
    """
    _check_tensor("q", q, 4, _FLOAT_DTYPES)
    b, s_q, h, d_qk = q.shape
    _check(h >= 1, f"q must have h >= 1, got shape {tuple(q.shape)}")
    _check(0 < head_dim_v <= d_qk, f"head_dim_v must be in (0, d_qk={d_qk}], got {head_dim_v}")
    _check_kv_cache(kv_cache, d_qk, head_dim_v)
    if kv_cache.dtype != torch.uint8:
        _check(kv_cache.dtype == q.dtype, f"kv_cache dtype {kv_cache.dtype} must match q dtype {q.dtype}")
    _check_tensor("indices", indices, 3, (torch.int32,))
    _check(tuple(indices.shape[:2]) == (b, s_q) and indices.shape[2] >= 1,
           f"indices shape {tuple(indices.shape)} must be [b={b}, s_q={s_q}, topk>=1]")
    _check_same_device(q=q, kv_cache=kv_cache, indices=indices)
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    if indices.device.type == "cpu" and indices.numel():
        lo, hi = int(indices.min()), int(indices.max())
        _check(lo >= -1 and hi < num_slots,
               f"indices must be -1 or slot ids in [0, {num_slots}), got values in [{lo}, {hi}]")
    _check(isinstance(softmax_scale, (float, int)) and softmax_scale > 0,
           f"softmax_scale must be a positive number, got {softmax_scale!r}")
    fn = registry.resolve("sparse_mla", backend, q.device)
    return fn(q, kv_cache, indices, float(softmax_scale), head_dim_v=head_dim_v, **options)


def indexer_topk(q, weights, k_cache, block_table, cache_seqlens, topk, backend=None, **options):
    """DSA lightning indexer: the `topk` visible cache slots with the highest scores.

    Args:
        q: [b, s_q, H_I, D_I]; weights: float32 [b, s_q, H_I] (H_I^-0.5 already in them);
        k_cache: [num_pages, page_size, D_I]; block_table int32 [b, max_pages]; cache_seqlens int32 [b].
    Returns:
        int32 [b, s_q, topk] slot ids in any order, -1 where fewer than topk keys are visible.
    """
    _check_tensor("q", q, 4, _FLOAT_DTYPES)
    b, s_q, n_heads, d = q.shape
    _check_tensor("weights", weights, 3, (torch.float32,))
    _check(tuple(weights.shape) == (b, s_q, n_heads),
           f"weights shape {tuple(weights.shape)} must be [b={b}, s_q={s_q}, H_I={n_heads}]")
    _check_tensor("k_cache", k_cache, 3, _FLOAT_DTYPES)
    _check(k_cache.shape[-1] == d, f"k_cache last dim {k_cache.shape[-1]} must equal q's D_I {d}")
    _check(k_cache.dtype == q.dtype, f"k_cache dtype {k_cache.dtype} must match q dtype {q.dtype}")
    _check(isinstance(topk, int) and topk >= 1, f"topk must be a positive int, got {topk!r}")
    _check_same_device(q=q, weights=weights, k_cache=k_cache, block_table=block_table,
                       cache_seqlens=cache_seqlens)
    _check_paging(block_table, cache_seqlens, b, k_cache.shape[0], k_cache.shape[1])
    fn = registry.resolve("indexer_topk", backend, q.device)
    return fn(q, weights, k_cache, block_table, cache_seqlens, topk, **options)


def quantize_kv_fp8(kv):
    """kv [..., 576] bf16/fp16/fp32 -> uint8 [..., 656] (the FP8 format in DESIGN.md)."""
    _check_tensor("kv", kv, None, _FLOAT_DTYPES)
    _check(kv.dim() >= 1 and kv.shape[-1] == fp8_format.D_QK,
           f"kv last dim must be {fp8_format.D_QK}, got shape {tuple(kv.shape)}")
    return fp8_format.quantize(kv)


def dequantize_kv_fp8(packed):
    """uint8 [..., 656] -> bf16 [..., 576]."""
    _check_tensor("packed", packed, None, (torch.uint8,))
    _check(packed.dim() >= 1 and packed.shape[-1] == fp8_format.PACKED_BYTES,
           f"packed last dim must be {fp8_format.PACKED_BYTES}, got shape {tuple(packed.shape)}")
    return fp8_format.dequantize(packed)
