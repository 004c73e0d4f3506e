"""The Triton sparse MLA and DSA indexer kernels at the benchmark shapes on a GPU, against the torch reference.

Sparse MLA tolerances follow FlashMLA's tests: every output element within 1e-3 absolute or 2/128
relative, cosine distance of the whole output <= 1e-5, lse close. Cache slots no index points to hold
NaN (bf16) or 0xFF bytes (NaN e4m3, scales and k_pe alike); four pages no request owns are poisoned too.
Indexer top-k: bf16 scores tie now and then, so sets are compared by recall (>= 0.99, printed; run
with -s to see it) and every returned slot must score within a bf16 tolerance of the reference's k-th best.
One command: python -m pytest -q tests/gpu/test_sparse_gpu.py
"""

import importlib

import pytest
import torch

from mlaserve import ops
from mlaserve.kernels import reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

triton_sparse = importlib.import_module("mlaserve.kernels.triton.sparse_mla")
triton_indexer = importlib.import_module("mlaserve.kernels.triton.indexer")

DEVICE = "cuda"
DTYPE = torch.bfloat16
SCALE = 192 ** -0.5
PAGE = 64
TOPK = 2048


def _paging(b, s_kv, gen):
    """Each request owns s_kv / PAGE shuffled pages; 4 more pages belong to nobody. -> int32 [b, pages], num_pages."""
    per_req = s_kv // PAGE
    num_pages = b * per_req + 4
    perm = torch.randperm(num_pages, device=DEVICE, generator=gen)
    return perm[:b * per_req].view(b, per_req).to(torch.int32), num_pages


def _positions_to_slots(table, pos):
    """pos int64 [b, ..., n] logical positions -> slot ids through table int32 [b, pages]."""
    b = table.shape[0]
    pages = torch.gather(table.long(), 1, (pos // PAGE).reshape(b, -1)).view(pos.shape)
    return pages * PAGE + pos % PAGE


def _sparse_case(b, s_q, h, s_kv, kv_kind, seed, causal):
    """q [b, s_q, h, 576] bf16, cache (bf16, or FP8 uint8 [.., 656]), indices int32 [b, s_q, TOPK].

    Each token picks TOPK distinct visible positions of its request (causal: the s_q tokens are the
    last ones of s_kv), ~5% of the picks are then -1, token (0, 0) has only -1.
    """
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    table, num_pages = _paging(b, s_kv, gen)
    noise = torch.rand(b, s_q, s_kv, device=DEVICE, generator=gen)
    if causal:
        last = s_kv - s_q + torch.arange(s_q, device=DEVICE)
        noise.masked_fill_(torch.arange(s_kv, device=DEVICE)[None, :] > last[:, None], -1.0)
    pos = noise.topk(TOPK, dim=-1).indices                                   # [b, s_q, TOPK]
    indices = _positions_to_slots(table, pos).to(torch.int32)
    indices.masked_fill_(torch.rand(indices.shape, device=DEVICE, generator=gen) < 0.05, -1)
    indices[0, 0] = -1
    del noise, pos

    referenced = torch.zeros(num_pages * PAGE, dtype=torch.bool, device=DEVICE)
    referenced[indices[indices >= 0].long()] = True
    rows = torch.randn(num_pages * PAGE, 576, device=DEVICE, generator=gen, dtype=DTYPE)
    if kv_kind == "fp8":
        cache = torch.empty(num_pages * PAGE, 656, dtype=torch.uint8, device=DEVICE)
        for start in range(0, rows.shape[0], 1 << 19):                       # bounded temporaries
            cache[start:start + (1 << 19)] = ops.quantize_kv_fp8(rows[start:start + (1 << 19)])
        cache[~referenced] = 0xFF
    else:
        cache = rows.masked_fill_(~referenced[:, None], float("nan"))
    del rows
    q = torch.randn(b, s_q, h, 576, device=DEVICE, generator=gen, dtype=DTYPE)
    return q, cache.view(num_pages, PAGE, -1), indices


def _assert_close(out, lse, ref_out, ref_lse, lse_tol):
    empty = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty)
    assert not out.isnan().any() and not lse.isnan().any()
    out, ref_out = out.float(), ref_out.float()
    assert (out[empty] == 0).all()
    err = (out - ref_out).abs()
    bad = (err > 1e-3) & (err > (2 / 128) * ref_out.abs())
    assert not bad.any(), f"{int(bad.sum())} elements off; worst abs err {float(err.max()):.3g}"
    x, y = out.double().flatten(), ref_out.double().flatten()
    cos_dist = float(1 - 2 * (x @ y) / (x @ x + y @ y).clamp_min(1e-30))
    assert cos_dist <= 1e-5, f"cosine distance {cos_dist:.3g}"
    lse_err = float((lse[~empty] - ref_lse[~empty]).abs().max())
    assert lse_err <= lse_tol, f"lse abs err {lse_err:.3g}"


SPARSE_CASES = [
    # b, s_q, h, s_kv, kv, causal, knobs (empty: the kernel's own choice)
    (1, 4096, 128, 32768, "bf16", True, {}),                  # the prefill benchmark shape
    (128, 2, 128, 32768, "fp8", False, {}),                   # the FP8 decode benchmark shape (> 2 GiB pool)
    (64, 1, 64, 8192, "bf16", False, {}),                     # too few programs: split top-k by default
    (64, 1, 64, 8192, "fp8", False, {"num_splits": 3, "block_n": 32}),
    (5, 2, 20, 4096, "bf16", False, {"block_h": 32}),         # a head count that needs padding
]


# The fp32 reference costs ~1 s per 100 GFLOP on the GPU; it checks at most this many tokens per case.
REF_TOKENS = 256


@pytest.mark.parametrize("b,s_q,h,s_kv,kv_kind,causal,knobs", SPARSE_CASES)
def test_sparse_mla_matches_reference(b, s_q, h, s_kv, kv_kind, causal, knobs):
    q, cache, indices = _sparse_case(b, s_q, h, s_kv, kv_kind, seed=b + s_q + h, causal=causal)
    out, lse = ops.sparse_mla(q, cache, indices, SCALE, head_dim_v=512, backend="triton", **knobs)
    # tokens checked: the all -1 one, the last one, and evenly spread others
    tokens = b * s_q
    rows = torch.unique(torch.cat([torch.linspace(0, tokens - 1, min(tokens, REF_TOKENS)).long(),
                                   torch.tensor([tokens - 1])])).to(DEVICE)
    pick = lambda t: t.reshape(tokens, *t.shape[2:])[rows].unsqueeze(0)  # noqa: E731  [1, n, ...]
    ref_out, ref_lse = reference.sparse_mla(pick(q), cache, pick(indices), SCALE, head_dim_v=512)
    _assert_close(pick(out), pick(lse), ref_out, ref_lse, lse_tol=2e-3 if kv_kind == "bf16" else 1e-2)


def test_sparse_mla_cuda_graph_replay_equals_eager():
    """Decode with split top-k inside a CUDA graph; new indices written into the static buffer replay right."""
    q, cache, indices = _sparse_case(16, 2, 64, 8192, "fp8", seed=1, causal=False)
    other = _sparse_case(16, 2, 64, 8192, "fp8", seed=1, causal=False)[2].roll(1, dims=0)
    q_static, idx_static = q.clone(), indices.clone()
    knobs = {"num_splits": 3, "block_n": 32}          # compiled already by SPARSE_CASES
    call = lambda: triton_sparse.sparse_mla(q_static, cache, idx_static, SCALE, head_dim_v=512, **knobs)  # noqa: E731
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static, lse_static = call()
    idx_static.copy_(other)
    graph.replay()
    torch.cuda.synchronize()
    eager_out, eager_lse = triton_sparse.sparse_mla(q, cache, other, SCALE, head_dim_v=512, **knobs)
    assert torch.equal(out_static, eager_out) and torch.equal(lse_static, eager_lse)


# -- indexer --

H_I, D_I = 64, 128


def _indexer_case(seqlens, s_q, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    b, s_kv = len(seqlens), max(seqlens)
    table, num_pages = _paging(b, -(-s_kv // PAGE) * PAGE, gen)
    k_cache = torch.randn(num_pages, PAGE, D_I, device=DEVICE, generator=gen, dtype=DTYPE)
    # NaN in every slot past a request's length and in the pages nobody owns
    owned = torch.zeros(num_pages * PAGE, dtype=torch.bool, device=DEVICE)
    for i, n in enumerate(seqlens):
        owned[_positions_to_slots(table[i:i + 1], torch.arange(n, device=DEVICE)[None])] = True
    k_cache.view(-1, D_I)[~owned] = float("nan")
    q = torch.randn(b, s_q, H_I, D_I, device=DEVICE, generator=gen, dtype=DTYPE)
    weights = torch.randn(b, s_q, H_I, device=DEVICE, generator=gen) * H_I ** -0.5
    return q, weights, k_cache, table, torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)


def _reference_scores(q, weights, k_cache, table, seqlens, tokens):
    """float32 scores [b, len(tokens), positions] by logical position (-inf where invisible), in token chunks."""
    b, s_q = q.shape[:2]
    positions = table.shape[1] * PAGE
    out = torch.full((b, len(tokens), positions), float("-inf"), device=DEVICE)
    for i, n in enumerate(seqlens.tolist()):
        keys = k_cache.view(-1, D_I)[_positions_to_slots(table[i:i + 1], torch.arange(n, device=DEVICE)[None])[0]]
        for c in range(0, len(tokens), 64):
            tok = torch.tensor(tokens[c:c + 64], device=DEVICE)
            s = reference.indexer_scores(q[i, tok], weights[i, tok], keys)                 # [chunk, n]
            visible = torch.arange(n, device=DEVICE)[None, :] <= (n - s_q + tok)[:, None]
            out[i, c:c + 64, :n] = s.masked_fill(~visible, float("-inf"))
    return out


def _check_topk(result, ref_scores, table, tokens, label):
    """Recall of result [b, s_q, TOPK] (rows `tokens`) against the top-k of ref_scores [b, len(tokens), positions]."""
    b, n_tok, positions = ref_scores.shape
    picked = result[:, tokens]                                                       # [b, n_tok, TOPK]
    k_visible = torch.isfinite(ref_scores).sum(-1).clamp_max(TOPK)                   # [b, n_tok]
    assert torch.equal((picked >= 0).sum(-1), k_visible), "-1 padding must match the visible key count"
    # score of each returned slot, looked up by logical position
    slot_to_pos = torch.full(((int(table.max()) + 1) * PAGE,), -1, dtype=torch.long, device=DEVICE)
    recalls, worst_gap = [], 0.0
    for i in range(b):
        slots = _positions_to_slots(table[i:i + 1], torch.arange(positions, device=DEVICE)[None])[0]
        slot_to_pos.fill_(-1)
        slot_to_pos[slots] = torch.arange(positions, device=DEVICE)
        for j in range(n_tok):
            k = int(k_visible[i, j])
            if k == 0:
                continue
            row = ref_scores[i, j]
            top_vals, top_pos = row.topk(k)
            got = picked[i, j][picked[i, j] >= 0].long()
            assert got.unique().numel() == k, "duplicate slots"
            got_pos = slot_to_pos[got]
            assert (got_pos >= 0).all()
            got_scores = row[got_pos]
            tol = 2 ** -8 * float(top_vals.abs().max())
            kth = float(top_vals[-1])
            worst_gap = max(worst_gap, kth - float(got_scores.min()))
            assert float(got_scores.min()) >= kth - tol, (i, j, float(got_scores.min()), kth)
            hit = torch.isin(got_pos, top_pos).sum()
            recalls.append(float(hit) / k)
    recall = sum(recalls) / len(recalls)
    print(f"[indexer {label}] mean recall {recall:.5f}, min {min(recalls):.5f}, "
          f"worst shortfall below the k-th score {worst_gap:.3g}")
    assert recall >= 0.99


@pytest.mark.parametrize("select", ["torch", "triton"])
def test_indexer_decode_benchmark_shape(select):
    """b 128 x s_k 32768, one new token each; scores against the reference, then top-k recall."""
    case = _indexer_case([32768] * 128, 1, seed=3)
    scores = triton_indexer.indexer_scores(*case)
    ref = _reference_scores(*case, tokens=[0])
    assert torch.equal(torch.isfinite(scores), torch.isfinite(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(scores[fin], ref[fin], atol=1e-4, rtol=1e-4)
    result = ops.indexer_topk(*case, TOPK, backend="triton", select=select)
    _check_topk(result, ref, case[3], [0], f"decode b128 s_k 32768, select={select}")


@pytest.mark.parametrize("select", ["torch", "triton"])
def test_indexer_decode_variable_lengths(select):
    """s_q 2 and lengths around (and below) topk, at page edges."""
    gen = torch.Generator().manual_seed(4)
    lens = torch.randint(100, 20000, (14,), generator=gen).tolist() + [TOPK - 1, TOPK + 1, PAGE * 40 - 1, 1]
    case = _indexer_case(lens, 2, seed=4)
    ref = _reference_scores(*case, tokens=[0, 1])
    result = ops.indexer_topk(*case, TOPK, backend="triton", select=select)
    _check_topk(result, ref, case[3], [0, 1], f"decode s_q 2 variable lengths, select={select}")


@pytest.mark.parametrize("select", ["torch", "triton"])
def test_indexer_prefill_benchmark_shape(select):
    """4096 new tokens over s_k 32768; every 32nd token (and the first and last) checked."""
    case = _indexer_case([32768], 4096, seed=5)
    tokens = sorted(set(range(0, 4096, 32)) | {4095})
    result = ops.indexer_topk(*case, TOPK, backend="triton", select=select)
    ref = _reference_scores(*case, tokens=tokens)
    _check_topk(result, ref, case[3], tokens, f"prefill 4096 x 32768, select={select}")


def test_indexer_cuda_graph_replay_equals_eager():
    case = _indexer_case([5000, 9000, 700, 12000], 1, seed=6)
    q, weights, k_cache, table, seqlens = case
    q_static, lens_static = q.clone(), seqlens.clone()
    call = lambda: triton_indexer.indexer_topk(q_static, weights, k_cache, table, lens_static, TOPK,  # noqa: E731
                                               select="triton")
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = call()
    lens_static.copy_(torch.tensor([4000, 9000, 500, 100], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    eager = triton_indexer.indexer_topk(q, weights, k_cache, table, lens_static.clone(), TOPK, select="triton")
    for a, b in zip(out_static.flatten(1).tolist(), eager.flatten(1).tolist()):
        assert sorted(a) == sorted(b)
