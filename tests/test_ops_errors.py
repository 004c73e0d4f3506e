"""Every ValueError path of mlaserve.ops names the offending values."""

import pytest
import torch

from mlaserve import ops


def _dense(b=2, s_q=1, h=2, d=16, pages=4, page_size=4):
    q = torch.randn(b, s_q, h, d)
    kv = torch.randn(pages, page_size, d)
    table = torch.zeros(b, 2, dtype=torch.int32)
    table[:, 1] = 1
    seqlens = torch.full((b,), 5, dtype=torch.int32)
    return q, kv, table, seqlens


def test_mla_decode_errors():
    q, kv, table, sl = _dense()
    cases = [
        (dict(q=q[0]), "q must have 4 dims"),
        (dict(q=q.int()), "q must have dtype"),
        (dict(kv_cache=kv[..., :8]), "kv_cache last dim 8 must equal q's head dim 16"),
        (dict(kv_cache=kv.half()), "kv_cache dtype torch.float16 must match q dtype torch.float32"),
        (dict(block_table=table.long()), "block_table must have dtype"),
        (dict(block_table=table[:1]), "block_table has 1 rows, expected batch size 2"),
        (dict(cache_seqlens=sl[:1]), "cache_seqlens has 1 entries, expected 2"),
        (dict(cache_seqlens=torch.tensor([9, 1], dtype=torch.int32)), "exceeds block_table capacity 2 pages x 4 = 8"),
        (dict(cache_seqlens=torch.tensor([-1, 1], dtype=torch.int32)), "cache_seqlens must be >= 0, got min -1"),
        (dict(block_table=table + 7), "the cache has 4 pages"),
        (dict(softmax_scale=-1.0), "softmax_scale must be a positive number, got -1.0"),
        (dict(head_dim_v=17), "head_dim_v must be in (0, d_qk=16], got 17"),
        (dict(backend="nope"), "unknown backend 'nope'"),
        (dict(kv_cache=torch.zeros(4, 4, 656, dtype=torch.uint8)), "FP8 KV format is defined for d_qk=576"),
        (dict(kv_cache=torch.zeros(4, 4, 600, dtype=torch.uint8)), "must have 656 bytes per token"),
        (dict(q=torch.randn(2, 0, 2, 16)), "s_q >= 1"),
    ]
    for override, message in cases:
        args = dict(q=q, kv_cache=kv, block_table=table, cache_seqlens=sl, softmax_scale=0.1, head_dim_v=16,
                    backend="torch")
        args.update(override)
        with pytest.raises(ValueError, match=_re(message)):
            ops.mla_decode(**args)


def test_unavailable_backend_lists_what_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, kv, table, sl = _dense()
    with pytest.raises(ValueError, match=r"backend 'triton' cannot run mla_decode here: .*available on cpu: \['torch'"):
        ops.mla_decode(q, kv, table, sl, 0.1, head_dim_v=16, backend="triton")


def test_sparse_mla_errors():
    q = torch.randn(2, 3, 2, 16)
    kv = torch.randn(4, 4, 16)
    idx = torch.zeros(2, 3, 5, dtype=torch.int32)
    cases = [
        (dict(indices=idx.long()), "indices must have dtype"),
        (dict(indices=idx[:1]), r"indices shape \(1, 3, 5\) must be \[b=2, s_q=3, topk>=1\]"),
        (dict(indices=idx + 16), r"slot ids in \[0, 16\), got values in \[16, 16\]"),
        (dict(indices=idx - 2), r"got values in \[-2, -2\]"),
        (dict(kv_cache=kv.half()), "must match q dtype"),
        (dict(softmax_scale=0), "softmax_scale must be a positive number"),
    ]
    for override, message in cases:
        args = dict(q=q, kv_cache=kv, indices=idx, softmax_scale=0.1, head_dim_v=16, backend="torch")
        args.update(override)
        with pytest.raises(ValueError, match=message):
            ops.sparse_mla(**args)


def test_indexer_topk_errors():
    q = torch.randn(2, 1, 3, 8)
    w = torch.randn(2, 1, 3)
    k = torch.randn(4, 4, 8)
    table = torch.zeros(2, 2, dtype=torch.int32)
    sl = torch.tensor([3, 4], dtype=torch.int32)
    cases = [
        (dict(weights=w.half()), "weights must have dtype"),
        (dict(weights=w[:, :, :2]), r"weights shape \(2, 1, 2\) must be \[b=2, s_q=1, H_I=3\]"),
        (dict(k_cache=k[..., :4]), "k_cache last dim 4 must equal q's D_I 8"),
        (dict(topk=0), "topk must be a positive int, got 0"),
        (dict(cache_seqlens=sl[:1]), "cache_seqlens has 1 entries, expected 2"),
    ]
    for override, message in cases:
        args = dict(q=q, weights=w, k_cache=k, block_table=table, cache_seqlens=sl, topk=2, backend="torch")
        args.update(override)
        with pytest.raises(ValueError, match=message):
            ops.indexer_topk(**args)


def test_fp8_errors():
    with pytest.raises(ValueError, match=r"kv last dim must be 576, got shape \(3, 512\)"):
        ops.quantize_kv_fp8(torch.randn(3, 512))
    with pytest.raises(ValueError, match="kv must have dtype"):
        ops.quantize_kv_fp8(torch.zeros(3, 576, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"packed last dim must be 656, got shape \(2, 600\)"):
        ops.dequantize_kv_fp8(torch.zeros(2, 600, dtype=torch.uint8))
    with pytest.raises(ValueError, match="packed must have dtype"):
        ops.dequantize_kv_fp8(torch.zeros(2, 656))


def test_mixed_devices_rejected():
    q, kv, table, sl = _dense()
    with pytest.raises(ValueError, match="must be on one device"):
        ops.mla_decode(q, kv.to("meta"), table, sl, 0.1, head_dim_v=16, backend="torch")


def _re(text):
    import re
    return re.escape(text)
