"""The Triton sparse MLA kernel against the torch reference, through the CPU interpreter.

fp16/fp32 only (the interpreter computes tl.dot on bf16 wrongly). Every cache slot that no
index points to holds NaN, so a kernel that reads one fails loudly.
"""

import importlib

import pytest
import torch

from mlaserve import ops
from mlaserve.kernels import fp8_format, reference

# The package attribute `sparse_mla` is the op function; the module comes from the import system.
triton_sparse = importlib.import_module("mlaserve.kernels.triton.sparse_mla")


def _make_case(b, s_q, h, d_qk, dv, topk, dtype, fp8=False, num_pages=6, page_size=16, seed=0):
    """Random q, a paged cache whose pages are only partly filled (the rest NaN), and indices.

    Returns q [b, s_q, h, d_qk], kv_cache, indices int32 [b, s_q, topk]. Indices repeat -1 at
    random places and token (0, 0) has only -1.
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s_q, h, d_qk, generator=g).to(dtype)
    kv = torch.randn(num_pages, page_size, d_qk, generator=g)
    filled = torch.randint(1, page_size + 1, (num_pages,), generator=g)          # tokens per page
    in_use = torch.arange(page_size)[None, :] < filled[:, None]                   # [pages, page_size]
    used_slots = torch.nonzero(in_use.flatten()).flatten()
    if fp8:
        cache = fp8_format.quantize(kv)
        cache[~in_use] = 0xFF            # NaN e4m3 bytes, NaN scales, NaN bf16 k_pe
    else:
        cache = kv.masked_fill(~in_use[..., None], float("nan")).to(dtype)
    pick = torch.randint(0, used_slots.numel(), (b, s_q, topk), generator=g)
    indices = used_slots[pick].to(torch.int32)
    indices[torch.rand(b, s_q, topk, generator=g) < 0.25] = -1
    indices[0, 0] = -1
    return q, cache, indices


def _reference(q, cache, indices, scale, dv):
    ref_cache = cache if cache.dtype == torch.uint8 else cache.float()
    return reference.sparse_mla(q.float(), ref_cache, indices, scale, head_dim_v=dv)


def _check(out, lse, ref_out, ref_lse, dtype):
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-3, rtol=1e-2)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref_out, **tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4 if dtype == torch.float32 else 1e-3, rtol=0)
    # The all -1 token: exactly zero output and lse -inf.
    assert (out[0, 0] == 0).all() and (lse[0, 0] == float("-inf")).all()


@pytest.mark.parametrize("dtype,h,topk,block_n,num_splits", [
    (torch.float32, 1, 37, 16, 1),
    (torch.float32, 5, 64, 16, 3),
    (torch.float16, 3, 50, 32, 1),
    (torch.float16, 16, 100, 16, 2),
    (torch.float16, 20, 40, 16, 1),      # two head blocks of 16, the second padded
])
def test_small_dims_match_reference(dtype, h, topk, block_n, num_splits):
    d_qk, dv = 64 + 16, 64
    q, cache, idx = _make_case(2, 2, h, d_qk, dv, topk, dtype, seed=h * 1000 + topk)
    scale = d_qk ** -0.5
    out, lse = ops.sparse_mla(q, cache, idx, scale, head_dim_v=dv, backend="triton",
                              block_h=16, block_n=block_n, num_splits=num_splits)
    _check(out, lse, *_reference(q, cache, idx, scale, dv), dtype)


def test_v_covers_whole_row_and_odd_widths():
    """head_dim_v == d_qk (no rope part), and a width that is not a power of two."""
    for d_qk, dv in [(64, 64), (56, 40)]:
        q, cache, idx = _make_case(1, 3, 4, d_qk, dv, 29, torch.float32, seed=d_qk)
        out, lse = triton_sparse.sparse_mla(q, cache, idx, 0.3, head_dim_v=dv, block_n=16)
        _check(out, lse, *_reference(q, cache, idx, 0.3, dv), torch.float32)


@pytest.mark.parametrize("dtype,fp8,num_splits", [
    (torch.float16, False, 1),
    (torch.float16, True, 2),
    (torch.float32, True, 1),
])
def test_deepseek_dims(dtype, fp8, num_splits):
    """d_qk 576 / dv 512, the FP8 656-byte format dequantized in the kernel."""
    d_qk, dv = fp8_format.D_QK, fp8_format.KV_LORA_RANK
    q, cache, idx = _make_case(1, 2, 3, d_qk, dv, 40, dtype, fp8=fp8, num_pages=4, seed=7)
    scale = d_qk ** -0.5
    out, lse = ops.sparse_mla(q, cache, idx, scale, head_dim_v=dv, backend="triton",
                              block_h=16, block_n=16, num_splits=num_splits)
    _check(out, lse, *_reference(q, cache, idx, scale, dv), dtype)


def test_splits_agree_with_one_program():
    """Splitting a token's top-k across programs and merging through lse changes nothing."""
    q, cache, idx = _make_case(1, 2, 4, 80, 64, 96, torch.float32, seed=3)
    one = triton_sparse.sparse_mla(q, cache, idx, 0.2, head_dim_v=64, block_n=16, num_splits=1)
    many = triton_sparse.sparse_mla(q, cache, idx, 0.2, head_dim_v=64, block_n=16, num_splits=5)
    torch.testing.assert_close(many[0], one[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(many[1], one[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("programs,num_sms", [(64, 132), (128, 132), (512, 132), (7, 132), (1, 8)])
def test_num_splits_fills_the_gpu(programs, num_sms):
    topk_blocks = 32
    s = triton_sparse.choose_num_splits(programs, topk_blocks, num_sms)
    assert 1 <= s <= topk_blocks // 4
    eff = lambda n: n / (-(-n // num_sms) * num_sms)  # noqa: E731
    # No other admissible split count fills whole waves clearly better.
    assert all(eff(programs * other) <= eff(programs * s) + 0.02 for other in range(1, topk_blocks // 4 + 1))


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="block_n"):
        triton_sparse.SparseMLAConfig(block_n=48)
