"""The `flashinfer` attention backend and the benchmark's FlashInfer peers against the torch reference (GPU only).

Unreferenced cache pages hold NaN and the tails of partly filled pages large finite garbage, so that any read
outside a request's tokens shows up (NaN in the tail would test FlashInfer's handling of 0 * NaN in P·V,
which real caches, zero-initialized, never exercise).
"""

import pytest
import torch

from mlaserve import ops
from mlaserve.attention import flashinfer_backend as fb
from mlaserve.attention.base import BackendConfig
from mlaserve.attention.batch import BatchLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCALE = 192 ** -0.5


@pytest.fixture(scope="module")
def device():
    reason = fb.unavailable_reason("cuda", torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)
    return torch.device("cuda")


def _rel(out, ref):
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _cache_and_tables(lens, page_size, device, gen):
    """bf16 cache [pages, page_size, 576] with poisoned unused rows; per-request page lists in random order."""
    pages = [-(-n // page_size) for n in lens]
    num_pages = sum(pages) + 3                                        # 2 pages nobody references
    order = torch.randperm(num_pages - 1, generator=gen).tolist()
    tables, start = [], 0
    for n in pages:
        tables.append([p + 1 for p in order[start:start + n]])
        start += n
    kv = torch.full((num_pages, page_size, 576), float("nan"), dtype=torch.bfloat16)
    for bt, n in zip(tables, lens):
        rows = torch.randn(len(bt) * page_size, 576, generator=gen)
        rows[n:] = 3e4                                                # tail of the last page
        kv[bt] = rows.view(len(bt), page_size, 576).to(torch.bfloat16)
    return kv.to(device), tables


@pytest.mark.parametrize("h,extend", [(16, False), (32, False), (64, False), (128, False), (64, True)])
def test_backend_matches_reference(device, h, extend):
    gen = torch.Generator().manual_seed(h)
    page_size = 64
    ext = [1, 1, 1] if not extend else [3, 1, 5]
    lens = [700, 64, 2049]
    kv, tables = _cache_and_tables(lens, page_size, device, gen)
    layout = BatchLayout.build([n - e for n, e in zip(lens, ext)], ext, tables, page_size, device)
    config = BackendConfig(num_heads=h, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                           kv_cache_dtype="auto", device=device)
    q = torch.randn(sum(ext), h, 576, generator=gen).to(torch.bfloat16).to(device)
    for scale_at_init in (True, False):
        backend = fb.FlashInferBackend(config, softmax_scale=SCALE if scale_at_init else None)
        assert not backend.extend_uses_mha(layout)
        meta = backend.plan(layout)
        assert (meta.planned_scale is not None) == scale_at_init
        out = backend.mla(q, kv, layout, meta, SCALE, 512)
        ref, _ = ops.mla_decode(q.unsqueeze(1), kv, layout.token_block_table, layout.token_seqlens, SCALE,
                                backend="torch")
        assert out.shape == (sum(ext), h, 512) and torch.isfinite(out).all()
        assert _rel(out, ref.squeeze(1)) < 1e-2


def test_adapter_lse_and_sparse_page_size_one(device):
    gen = torch.Generator().manual_seed(7)
    lens, h, tokens, topk = [3000, 1000], 128, 6, 300
    kv, tables = _cache_and_tables(lens, 64, device, gen)
    mla = fb.FlashInferMLA(device)
    # dense: natural-log lse
    table = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables], dtype=torch.int32)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    mla.plan(fb.CsrPaging.from_block_table(table, seqlens, torch.ones(2, dtype=torch.int32), 64), num_heads=h,
             page_size=64, causal=True, sm_scale=SCALE, dtype=torch.bfloat16)
    q = torch.randn(2, 1, h, 576, generator=gen).to(torch.bfloat16).to(device)
    out, lse = mla.run(q.view(2, h, 576), kv)
    ref, ref_lse = ops.mla_decode(q, kv, table.to(device), seqlens.to(device), SCALE, backend="torch")
    assert _rel(out, ref.view(2, h, 512)) < 1e-2
    assert (lse - ref_lse.view(2, h)).abs().max() < 1e-2
    # sparse: top-k slots of request 0, some -1
    slots = torch.tensor([p * 64 + o for p in tables[0] for o in range(64)][:lens[0]])
    idx = slots[torch.stack([torch.randperm(lens[0], generator=gen)[:topk] for _ in range(tokens)])].to(torch.int32)
    idx[1, 200:] = -1
    mla.plan(fb.CsrPaging.from_sparse_indices(idx), num_heads=h, page_size=1, causal=False, sm_scale=SCALE,
             dtype=torch.bfloat16)
    qs = torch.randn(tokens, h, 576, generator=gen).to(torch.bfloat16).to(device)
    out, lse = mla.run(qs, kv.view(-1, 1, 576))
    ref, ref_lse = ops.sparse_mla(qs[None], kv, idx[None].to(device), SCALE, backend="torch")
    assert _rel(out, ref[0]) < 1e-2
    assert (lse - ref_lse[0]).abs().max() < 1e-2
