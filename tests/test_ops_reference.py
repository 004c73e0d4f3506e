"""The torch backend of mlaserve.ops against direct float64 computations written here."""

import math

import pytest
import torch

from mlaserve import ops
from mlaserve.kernels import fp8_format

NAN = float("nan")


def make_paged(seqlens, page_size, d, dtype=torch.float32, extra_pages=3, gen=None):
    """A paged cache whose used slots hold random data and every other slot NaN.

    Returns kv_cache [pages, page_size, d], block_table int32 [b, max_pages] (unused entries point
    at a poisoned page), and the dense rows per request (float64 [seqlen, d]).
    """
    pages_per = [max(1, math.ceil(n / page_size)) for n in seqlens]
    num_pages = sum(pages_per) + extra_pages
    cache = torch.full((num_pages, page_size, d), NAN, dtype=torch.float64)
    perm = torch.randperm(num_pages, generator=gen)
    poison_page = int(perm[-1])
    max_pages = max(pages_per) + 1
    table = torch.full((len(seqlens), max_pages), poison_page, dtype=torch.int32)
    dense, used = [], 0
    for i, n in enumerate(seqlens):
        rows = torch.randn(n, d, generator=gen, dtype=torch.float64)
        pages = perm[used:used + pages_per[i]]
        used += pages_per[i]
        table[i, :len(pages)] = pages.int()
        for pos in range(n):
            cache[pages[pos // page_size], pos % page_size] = rows[pos]
        dense.append(rows)
    return cache.to(dtype), table, dense


def direct_attention(q, rows, last_visible, scale, dv):
    """q float64 [s_q, h, d]; rows [n, d]; last_visible[j]: last position token j sees (-1: none)."""
    s_q, h, _ = q.shape
    out = torch.zeros(s_q, h, dv, dtype=torch.float64)
    lse = torch.full((s_q, h), -math.inf, dtype=torch.float64)
    for j in range(s_q):
        n = last_visible[j] + 1
        if n <= 0:
            continue
        k = rows[:n]
        s = q[j] @ k.T * scale                      # [h, n]
        m = s.max(dim=-1, keepdim=True).values
        p = torch.exp(s - m)
        lse[j] = (m.squeeze(-1) + torch.log(p.sum(-1)))
        out[j] = (p / p.sum(-1, keepdim=True)) @ k[:, :dv]
    return out, lse


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("s_q", [1, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_mla_decode_matches_direct(page_size, s_q, causal):
    gen = torch.Generator().manual_seed(page_size * 10 + s_q)
    d, dv, h, scale = 40, 32, 3, 0.17
    seqlens = [s_q + 5, 1 + s_q, 37, 0]
    cache, table, dense = make_paged(seqlens, page_size, d, gen=gen)
    q = torch.randn(len(seqlens), s_q, h, d, generator=gen, dtype=torch.float64)
    out, lse = ops.mla_decode(q.float(), cache.float(), table, torch.tensor(seqlens, dtype=torch.int32),
                              scale, causal=causal, head_dim_v=dv, backend="torch")
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert out.shape == (len(seqlens), s_q, h, dv) and lse.shape == (len(seqlens), s_q, h)
    for i, n in enumerate(seqlens):
        last = [n - s_q + j if causal else n - 1 for j in range(s_q)]
        ref_out, ref_lse = direct_attention(q[i], dense[i], last, scale, dv)
        torch.testing.assert_close(out[i].double(), ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[i].double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert torch.all(out[3] == 0) and torch.all(lse[3] == -math.inf)


def test_mla_decode_row_with_no_visible_key():
    # s_q larger than the cache: the first new tokens see nothing (causal), so out 0 and lse -inf
    gen = torch.Generator().manual_seed(1)
    cache, table, dense = make_paged([2], 4, 8, gen=gen)
    q = torch.randn(1, 3, 2, 8, generator=gen)
    out, lse = ops.mla_decode(q, cache, table, torch.tensor([2], dtype=torch.int32), 0.5, head_dim_v=8,
                              backend="torch")
    assert torch.all(out[0, 0] == 0) and torch.all(lse[0, 0] == -math.inf)
    assert torch.isfinite(out[0, 1:]).all() and torch.isfinite(lse[0, 1:]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mla_decode_low_precision_inputs(dtype):
    gen = torch.Generator().manual_seed(7)
    cache, table, dense = make_paged([20, 9], 8, 24, gen=gen)
    q = torch.randn(2, 1, 4, 24, generator=gen, dtype=torch.float64)
    out, lse = ops.mla_decode(q.to(dtype), cache.to(dtype), table, torch.tensor([20, 9], dtype=torch.int32),
                              0.3, head_dim_v=16, backend="torch")
    assert out.dtype == dtype
    for i, n in enumerate([20, 9]):
        ref, ref_lse = direct_attention(q[i].to(dtype).double(), dense[i].to(dtype).double(), [n - 1], 0.3, 16)
        torch.testing.assert_close(out[i].double(), ref, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(lse[i].double(), ref_lse, rtol=1e-4, atol=1e-4)


def test_mla_decode_fp8_cache_equals_dequantized_bf16():
    gen = torch.Generator().manual_seed(3)
    seqlens = [70, 3]
    cache, table, _ = make_paged(seqlens, 16, 576, gen=gen)
    packed = ops.quantize_kv_fp8(cache.float().nan_to_num(0.0))
    packed.view(-1, 656)[torch.isnan(cache.view(-1, 576)[:, 0])] = 0xFF   # FP8 NaN bytes in unused slots
    q = torch.randn(2, 2, 4, 576, generator=gen)
    sl = torch.tensor(seqlens, dtype=torch.int32)
    out8, lse8 = ops.mla_decode(q, packed, table, sl, 0.05, backend="torch")
    deq = fp8_format.dequantize(packed, torch.float32)      # the format's own values
    out32, lse32 = ops.mla_decode(q, deq, table, sl, 0.05, backend="torch")
    torch.testing.assert_close(out8, out32, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse8, lse32, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out8).all()


def test_sparse_mla_matches_direct():
    gen = torch.Generator().manual_seed(11)
    page_size, d, dv, h, topk, scale = 4, 20, 16, 3, 6, 0.25
    cache, _, _ = make_paged([30], page_size, d, gen=gen)
    num_slots = cache.shape[0] * page_size
    valid_slots = torch.nonzero(~torch.isnan(cache.view(-1, d)[:, 0])).flatten()
    b, s_q = 2, 3
    idx = valid_slots[torch.randint(len(valid_slots), (b, s_q, topk), generator=gen)].int()
    idx[0, 0, 2:] = -1                      # some unused entries
    idx[1, 2, :] = -1                       # a row with nothing selected
    idx[1, 1, 3] = idx[1, 1, 4]             # a repeated slot counts twice
    q = torch.randn(b, s_q, h, d, generator=gen, dtype=torch.float64)
    out, lse = ops.sparse_mla(q.float(), cache.float(), idx, scale, head_dim_v=dv, backend="torch")
    flat = cache.view(-1, d).double()
    for i in range(b):
        for j in range(s_q):
            sel = [int(s) for s in idx[i, j] if s >= 0]
            assert all(0 <= s < num_slots for s in sel)
            if not sel:
                assert torch.all(out[i, j] == 0) and torch.all(lse[i, j] == -math.inf)
                continue
            ref, ref_lse = direct_attention(q[i, j][None], flat[sel], [len(sel) - 1], scale, dv)
            torch.testing.assert_close(out[i, j].double(), ref[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse[i, j].double(), ref_lse[0], rtol=1e-5, atol=1e-5)


def test_indexer_topk_matches_direct():
    gen = torch.Generator().manual_seed(5)
    page_size, d, n_heads, topk = 4, 16, 3, 5
    seqlens, s_q = [13, 3, 8], 2
    cache, table, dense = make_paged(seqlens, page_size, d, gen=gen)
    q = torch.randn(len(seqlens), s_q, n_heads, d, generator=gen, dtype=torch.float64)
    w = torch.randn(len(seqlens), s_q, n_heads, generator=gen, dtype=torch.float64)
    got = ops.indexer_topk(q.float(), w.float(), cache.float(), table, torch.tensor(seqlens, dtype=torch.int32),
                           topk, backend="torch")
    assert got.dtype == torch.int32 and got.shape == (3, s_q, topk)
    for i, n in enumerate(seqlens):
        slots = [int(table[i, p // page_size]) * page_size + p % page_size for p in range(n)]
        for j in range(s_q):
            visible = n - s_q + j + 1
            scores = (torch.relu(q[i, j] @ dense[i][:visible].T * d ** -0.5) * w[i, j][:, None]).sum(0)
            k = min(topk, visible)
            want = {slots[p] for p in torch.topk(scores, k).indices.tolist()}
            row = got[i, j].tolist()
            assert set(row[:k]) == want, (i, j)
            assert row[k:] == [-1] * (topk - k)


def test_fp8_round_trip_within_e4m3_bound():
    gen = torch.Generator().manual_seed(2)
    kv = torch.randn(64, 576, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
    kv[5, 128:256] = 0.0                                    # an all-zero tile
    packed = ops.quantize_kv_fp8(kv)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 656)
    back = ops.dequantize_kv_fp8(packed)
    assert back.dtype == torch.bfloat16 and back.shape == (64, 576)
    back = fp8_format.dequantize(packed, torch.float32)
    tiles = kv[:, :512].view(64, 4, 128)
    amax = tiles.abs().amax(-1, keepdim=True)
    err = (back[:, :512].view(64, 4, 128) - tiles).abs()
    # e4m3 has 3 mantissa bits: relative step 2^-3, so rounding error <= 2^-4 of the value,
    # and values below the smallest normal (2^-6 of the scale unit) round to 2^-9 * scale absolutely.
    scale = amax / 448.0
    bound = tiles.abs() * (2 ** -4 + 2 ** -8) + scale * 2 ** -9 + 1e-12   # e4m3, then bf16 rounding
    assert torch.all(err <= bound)
    assert torch.all(back[5, 128:256] == 0)
    torch.testing.assert_close(back[:, 512:], kv[:, 512:].bfloat16().float(), rtol=0, atol=0)


def test_fp8_exact_reading_is_e4m3_times_scale():
    """dequantize(exact=True) is e4m3 * scale with no rounding (what the FP8-MMA kernel computes on), and rounding
    it to bf16 gives the format's default reading."""
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(32, 576, generator=gen) * torch.logspace(-2, 2, 32)[:, None]
    packed = ops.quantize_kv_fp8(kv)
    exact = fp8_format.dequantize(packed, torch.float64, exact=True)
    e4m3 = packed[:, :512].contiguous().view(torch.float8_e4m3fn).double().view(32, 4, 128)
    scale = packed[:, 512:528].contiguous().view(torch.float32).double()
    assert torch.equal(exact[:, :512], (e4m3 * scale[..., None]).view(32, 512))
    assert torch.equal(exact[:, 512:], packed[:, 528:].contiguous().view(torch.bfloat16).double())
    assert torch.equal(exact.bfloat16(), fp8_format.dequantize(packed))
    assert not torch.equal(exact, fp8_format.dequantize(packed, torch.float64))    # the readings do differ


def test_fp8_scales_are_bf16_values_at_most_2_pow_7():
    """Kernels multiply e4m3 values by scale * 2^120 in bf16 (kernels/triton/common.py): every scale must be
    a bf16 value below 2^8; tiles past 448 * 2^7 saturate instead of overflowing."""
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(64, 576, generator=gen) * torch.logspace(-8, 6, 64)[:, None]
    packed = ops.quantize_kv_fp8(kv)
    scales = packed[:, 512:528].contiguous().view(torch.float32)
    assert torch.equal(scales.bfloat16().float(), scales)
    assert scales.max() == 128.0 and (scales <= 128.0).all()
    amax = kv[:, :512].abs().view(64, 4, 128).amax(-1)
    ok = amax <= 448 * 128
    assert (amax[ok] / scales[ok] <= 448.0).all()                  # never clipped below the limit
    back = ops.dequantize_kv_fp8(packed).float()[:, :512].view(64, 4, 128)
    assert (back[~ok].abs().amax(-1) == 448.0 * 128).all()          # saturated past it


def test_fp8_layout_byte_for_byte():
    kv = torch.zeros(576)
    kv[:128] = 448.0 * 2          # tile 0: amax 896 -> scale 2
    kv[130] = -1.0                # tile 1: amax 1 -> scale 1/448, rounded up to a bf16 value
    kv[512] = 1.5                 # k_pe[0]
    packed = ops.quantize_kv_fp8(kv)
    assert packed.shape == (656,)
    scales = packed[512:528].view(torch.float32)
    # the smallest bf16 values >= 1/448 and >= 1e-10 (1/448 = 0x3B12 4925 in fp32 bits: rounds up to 0x3B13)
    up = torch.tensor([0x3B13, 0x2EDC], dtype=torch.int16).view(torch.bfloat16).float()
    assert up[0] >= 1 / 448 and up[1] >= 1e-10 and up[0].bfloat16().float() == up[0]
    torch.testing.assert_close(scales, torch.tensor([2.0, up[0], up[1], up[1]]), rtol=0, atol=0)
    e4m3 = packed[:512].view(torch.float8_e4m3fn).float()
    assert e4m3[0] == 448.0 and e4m3[130] == -448.0
    assert packed[528:530].view(torch.bfloat16).item() == 1.5
