"""The Triton DSA indexer (scores + top-k) against float64 math, through the CPU interpreter.

Inputs are built so that scores are distinct (head 0 sees a positive key component, weights
are positive), so top-k sets are well defined. Cache slots past each request's length, pages
no request owns and block-table entries past the needed pages all hold NaN.
"""

import pytest
import torch

from mlaserve import ops
from mlaserve.kernels.triton import indexer as triton_indexer

PAGE = 16


def _make_case(seqlens, s_q, n_heads, d, max_pages, dtype=torch.float32, seed=0):
    """q [b, s_q, H, D], weights f32 [b, s_q, H], k_cache [pages, PAGE, D], block_table, cache_seqlens.

    Page 0 is all NaN and fills the block-table entries that no cached token needs.
    """
    g = torch.Generator().manual_seed(seed)
    b = len(seqlens)
    num_pages = 1 + b * max_pages + 2
    q = torch.randn(b, s_q, n_heads, d, generator=g)
    q[:, :, 0, 0] = 4.0
    weights = 0.1 + torch.rand(b, s_q, n_heads, generator=g)
    keys = torch.randn(num_pages, PAGE, d, generator=g)
    keys[..., 0] = 1.0 + torch.rand(num_pages, PAGE, generator=g)
    block_table = torch.zeros(b, max_pages, dtype=torch.int32)
    free = (1 + torch.randperm(num_pages - 1, generator=g)).tolist()
    k_cache = torch.full_like(keys, float("nan"))
    for i, n in enumerate(seqlens):
        for p in range(-(-n // PAGE)):
            page = free.pop()
            block_table[i, p] = page
            filled = min(PAGE, n - p * PAGE)
            k_cache[page, :filled] = keys[page, :filled]
    return (q.to(dtype), weights, k_cache.to(dtype), block_table, torch.tensor(seqlens, dtype=torch.int32))


def _scores64(q, weights, k_cache, block_table, seqlens):
    """float64 scores [b, s_q, max_pages * PAGE] by logical position, -inf where invisible."""
    b, s_q, _, d = q.shape
    positions = block_table.shape[1] * PAGE
    out = torch.full((b, s_q, positions), float("-inf"), dtype=torch.float64)
    for i, n in enumerate(seqlens.tolist()):
        pos = torch.arange(n)
        keys = k_cache.double()[block_table[i, pos // PAGE].long(), pos % PAGE]              # [n, d]
        logits = torch.einsum("thd,nd->thn", q[i].double(), keys) * d ** -0.5
        s = torch.einsum("thn,th->tn", logits.relu(), weights[i].double())
        visible = pos[None, :] <= (n - s_q + torch.arange(s_q))[:, None]
        out[i, :, :n] = s.masked_fill(~visible, float("-inf"))
    return out


def _check_topk(result, q, weights, k_cache, block_table, seqlens, topk):
    ref = _scores64(q, weights, k_cache, block_table, seqlens)
    b, s_q, positions = ref.shape
    assert result.shape == (b, s_q, topk) and result.dtype == torch.int32
    for i in range(b):
        slots = block_table[i, torch.arange(positions) // PAGE].long() * PAGE + torch.arange(positions) % PAGE
        for j in range(s_q):
            row = ref[i, j]
            n_visible = int(torch.isfinite(row).sum())
            k = min(topk, n_visible)
            order = row.argsort(descending=True)
            if 0 < k < n_visible:  # the inputs must make the cut unambiguous for this test to mean anything
                assert row[order[k - 1]] - row[order[k]] > 1e-4
            expected = set(slots[order[:k]].tolist())
            got = result[i, j]
            assert int((got == -1).sum()) == topk - k, (i, j)
            assert set(got[got >= 0].tolist()) == expected, (i, j)


@pytest.mark.parametrize("seqlens,s_q,topk", [
    ([2 * PAGE - 1, 2 * PAGE, 2 * PAGE + 1], 3, 20),    # causal limits at page edges
    ([PAGE, 3 * PAGE + 5, 0], 2, 24),                     # fewer visible than topk; an empty request
    ([4 * PAGE], 1, 9),
])
@pytest.mark.parametrize("select", ["torch", "triton"])
def test_topk_matches_float64(seqlens, s_q, topk, select):
    case = _make_case(seqlens, s_q, n_heads=4, d=32, max_pages=5, seed=sum(seqlens) + s_q)
    result = ops.indexer_topk(*case, topk, backend="triton", select=select)
    _check_topk(result, *case, topk)


@pytest.mark.parametrize("knobs", [
    dict(block_n=16, block_t=2, keys_per_prog=32, token_groups=2),
    dict(block_n=32, block_t=4, keys_per_prog=64, token_groups=1),
    dict(block_n=16, block_t=1, keys_per_prog=16, token_groups=3),
])
def test_scores_match_float64(knobs):
    seqlens = [3 * PAGE + 7, PAGE - 1, 5 * PAGE]
    case = _make_case(seqlens, 5, n_heads=3, d=24, max_pages=5, seed=11)
    scores = triton_indexer.indexer_scores(*case, **knobs)
    ref = _scores64(*case)
    assert torch.equal(torch.isfinite(scores), torch.isfinite(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(scores[fin].double(), ref[fin], atol=1e-5, rtol=1e-5)
    assert (scores[~fin] == float("-inf")).all()


def test_fp16_deepseek_head_shape():
    """H_I 64, D_I 128 as in V3.2, fp16 keys."""
    case = _make_case([70, 2 * PAGE], 2, n_heads=64, d=128, max_pages=5, dtype=torch.float16, seed=5)
    scores = triton_indexer.indexer_scores(*case)
    ref = _scores64(*case)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(scores), fin)
    torch.testing.assert_close(scores[fin].double(), ref[fin], atol=1e-3, rtol=1e-3)


def test_score_chunks_do_not_change_the_result():
    """Rows chunked by request and by token under a small score-memory bound."""
    case = _make_case([3 * PAGE + 2, 2 * PAGE + 9], 4, n_heads=4, d=32, max_pages=4, seed=2)
    whole = triton_indexer.indexer_topk(*case, 12)
    row_bytes = 4 * PAGE * 4
    for bound in (4 * row_bytes, 2 * row_bytes, row_bytes):
        chunked = triton_indexer.indexer_topk(*case, 12, max_score_bytes=bound)
        for a, b in zip(whole.flatten(1).tolist(), chunked.flatten(1).tolist()):
            assert sorted(a) == sorted(b)
    _check_topk(whole, *case, 12)


@pytest.mark.parametrize("select", ["torch", "triton"])
def test_topk_beyond_block_table_capacity_pads(select):
    case = _make_case([2 * PAGE, PAGE + 3], 2, n_heads=4, d=32, max_pages=2, seed=9)
    result = triton_indexer.indexer_topk(*case, 3 * PAGE, select=select)
    _check_topk(result, *case, 3 * PAGE)


def test_radix_select_with_ties_and_empty_rows():
    """Ties at the cut take exactly as many as needed; -inf picks become -1; chunks smaller than a row."""
    g = torch.Generator().manual_seed(4)
    b, n_tok, positions, topk = 2, 3, 80, 12
    scores = torch.randn(b, n_tok, positions, generator=g)
    scores[0, 0, 5:] = float("-inf")                 # 5 visible keys
    scores[0, 1] = float("-inf")                     # nothing visible
    scores[1, 0, :20] = 3.0                          # 20 equal scores, 12 of them win
    scores[1, 1, ::2] = scores[1, 1, 1::2]           # every score twice
    block_table = torch.randperm(40, generator=g)[:b * 5].view(b, 5).to(torch.int32)
    got = triton_indexer.radix_select_slots(scores, block_table, topk, block=32)
    page = positions // 5
    for i in range(b):
        slot_of = block_table[i, torch.arange(positions) // page] * page + torch.arange(positions) % page
        for j in range(n_tok):
            row = scores[i, j]
            k = min(topk, int(torch.isfinite(row).sum()))
            picked = got[i, j][got[i, j] >= 0]
            assert picked.numel() == k and int((got[i, j] == -1).sum()) == topk - k
            assert len(set(picked.tolist())) == k
            pos = torch.tensor([int(torch.nonzero(slot_of == s)[0]) for s in picked.tolist()], dtype=torch.long)
            if k:
                # the picked scores are exactly the k largest, as a multiset
                assert torch.equal(row[pos].sort().values, row.topk(k).values.sort().values)


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="keys_per_prog"):
        triton_indexer.IndexerConfig(block_n=32, keys_per_prog=48)
