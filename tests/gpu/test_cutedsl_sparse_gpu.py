"""The CuTe DSL sparse MLA on a Hopper GPU against the torch reference, through `ops`, and CUDA-graph replay
equal to eager, for bf16/fp16 caches and the FP8 cache.

Shapes, inputs (NaN in every slot no index names; -1s scattered, as whole leading tiles and whole rows;
repeated slots) and the FlashMLA-like tolerances are scripts/cutedsl_sparse_check.py's, loaded from there
so that both check one thing. One command: python -m pytest -q tests/gpu/test_cutedsl_sparse_gpu.py
(not test_cutedsl_sparse.py: the CPU tests have that basename and tests/ has no packages).
"""

import importlib
import importlib.util
from pathlib import Path

import pytest
import torch

from mlaserve import ops
from mlaserve.kernels import reference
from mlaserve.ops.registry import BACKENDS


_UNAVAILABLE = BACKENDS["cutedsl"].unavailable_reason(torch.device("cuda"))
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"cutedsl: {_UNAVAILABLE}")

_spec = importlib.util.spec_from_file_location(
    "cutedsl_sparse_check", Path(__file__).resolve().parents[2] / "scripts" / "cutedsl_sparse_check.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)
sp = importlib.import_module("mlaserve.kernels.cutedsl.sparse_mla")


@pytest.mark.parametrize("case", list(check.cases(quick=False)), ids=check.case_name)
def test_matches_reference(case):
    ok, max_err, why = check.compare(*check.run_case(case, seed=case["b"] * 7 + case["h"]))
    assert ok, f"max abs err {max_err:.2e}: {why}"


def test_ops_dispatch_equals_direct_call():
    q, kv, idx = check.make_case(2, 2, 64, 2048, 4096, torch.bfloat16, seed=3)
    out, lse = ops.sparse_mla(q, kv, idx, check.SCALE, backend="cutedsl")
    out2, lse2 = sp.sparse_mla(q, kv, idx, check.SCALE)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("h, dtype", [(128, torch.bfloat16), (80, torch.float16), (128, "fp8"), (80, "fp8")])
def test_16_byte_stores_equal_value_stores(monkeypatch, h, dtype, num_splits):
    """Blocks of 64 heads (out, or the fp32 split partials) stored 16 bytes at a time (STORE_16B): the same
    bits as value-by-value stores (80 heads: a full block, then a partial one)."""
    if dtype == "fp8":
        q, kv, idx = check.make_fp8_case(4, 2, h, 2048, 4096, seed=h)
    else:
        q, kv, idx = check.make_case(4, 2, h, 2048, 4096, dtype, seed=h)
    out, lse = sp.sparse_mla(q, kv, idx, check.SCALE, num_splits=num_splits)
    monkeypatch.setattr(sp, "STORE_16B", False)
    out1, lse1 = sp.sparse_mla(q, kv, idx, check.SCALE, num_splits=num_splits)
    assert torch.equal(out, out1) and torch.equal(lse, lse1)


@pytest.mark.parametrize("case", [c for c in check.fp8_cases(quick=False)
                                  if c["b"] != 64 or (c["s_q"], c["h"], c["topk"]) == (2, 128, 2048)],
                         ids=check.case_name)
def test_fp8_half_ring_gives_the_same_bits(monkeypatch, case):
    """sparse_mla.FP8_HALF_RING (the FP8 kernel's bf16 tile as three column-half slots, one raw buffer read into the
    loader's registers before the next tile is gathered into it): within the reference's tolerances (NaN/0xFF in
    every slot no index names, -1s, repeats, ragged top-k, splits) and the same bits as the whole-tile ring."""
    seed = case["b"] * 7 + case["h"]
    monkeypatch.setattr(sp, "FP8_HALF_RING", False)
    out0, lse0, _, _ = check.run_case(case, seed=seed)
    monkeypatch.setattr(sp, "FP8_HALF_RING", True)
    out, lse, ref_out, ref_lse = check.run_case(case, seed=seed)
    ok, max_err, why = check.compare(out, lse, ref_out, ref_lse)
    assert ok, f"max abs err {max_err:.2e}: {why}"
    assert torch.equal(out, out0) and torch.equal(lse, lse0), "FP8_HALF_RING changed the bits"


@pytest.mark.parametrize("b, s_q, h, topk, s_kv, num_splits, q_gain, lead", [
    (4, 2, 128, 2048, 4096, None, 4.0, 0),   # logits 4x as wide: maxima rise by > 2^8 after the first tile
    (4, 1, 16, 2048, 4096, None, 1.0, 0),    # 16 heads padded to a 64-row block
    (3, 2, 32, 100, 300, None, 4.0, 0),      # ragged top-k, -1s
    (2, 3, 64, 1000, 700, None, 1.0, 0),
    (2, 2, 128, 576, 4096, 16, 4.0, 0),      # 16 splits
    (2, 1, 64, 256, 4096, None, 1.0, 64),    # the first tile all -1s: no row has a key before tile 1
    (2, 2, 128, 576, 4096, 4, 1.0, 160),     # split 0's tiles all -1s, split 1's first half too
])
def test_fp8_one_barrier_matches_reference(monkeypatch, b, s_q, h, topk, s_kv, num_splits, q_gain, lead):
    """sparse_mla.FP8_ONE_BARRIER (the FP8 kernel's consumers meeting once a tile, on P, where no row's max rises by
    more than 2^8; both barriers where one does), on the half ring and on the whole tile: within the reference's
    tolerances (NaN/0xFF in every slot no index names, -1s, repeats, ragged top-k, splits, every token's first
    `lead` indices -1, so that whole tiles have no key: the fast path before any row's max exists) and close to
    the two-barrier kernel (the running max is lazy: the same P up to rounding)."""
    q, kv, idx = check.make_fp8_case(b, s_q, h, topk, s_kv, seed=11 * b + h + int(q_gain))
    q = q * q_gain
    idx[..., :lead] = -1
    ref_out, ref_lse = reference.sparse_mla(q.double(), ops.dequantize_kv_fp8(kv).double(), idx, check.SCALE)
    monkeypatch.setattr(sp, "FP8_ONE_BARRIER", False)
    out0, lse0 = sp.sparse_mla(q, kv, idx, check.SCALE, num_splits=num_splits)
    monkeypatch.setattr(sp, "FP8_ONE_BARRIER", True)
    for half_ring in (True, False):
        monkeypatch.setattr(sp, "FP8_HALF_RING", half_ring)
        out, lse = sp.sparse_mla(q, kv, idx, check.SCALE, num_splits=num_splits)
        ok, max_err, why = check.compare(out, lse, ref_out, ref_lse)
        assert ok, f"half_ring={half_ring}: max abs err {max_err:.2e}: {why}"
        torch.testing.assert_close(out.float(), out0.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(lse, lse0, rtol=1e-5, atol=1e-5)


# sparse_mla's softmax switches (lazy rescale, tree max): the seesaw kernel's (16-bit caches)
SOFTMAX_SWITCHES = ("LAZY_RESCALE", "TREE_MAX")


@pytest.mark.parametrize("switch", ["lazy", "tree", "both"])
@pytest.mark.parametrize("h, num_splits, q_gain", [(128, 1, 1.0), (80, 3, 4.0), (64, None, 4.0)])
def test_softmax_switches_match_reference(monkeypatch, switch, h, num_splits, q_gain):
    """The softmax switches of the seesaw kernel (sparse_mla.LAZY_RESCALE, TREE_MAX), each and both on against both
    off: within the reference's tolerances, with -1 indices and NaN-poisoned slots, fp16 at h 80, logits 4x as wide
    in two cases so that row maxima jump by more than 2^8, split and unsplit; the tree max alone only reorders the
    maxima (the same maxima), so it gives the bits of both off."""
    lazy, tree = SOFTMAX_SWITCHES
    for name in (lazy, tree):
        monkeypatch.setattr(sp, name, False)
    q, kv, idx = check.make_case(3, 2, h, 2048, 4096, torch.float16 if h == 80 else torch.bfloat16,
                                 seed=h + int(q_gain))
    q = q * q_gain
    out0, lse0 = sp.sparse_mla(q, kv, idx, check.SCALE, num_splits=num_splits)
    for name in {"lazy": (lazy,), "tree": (tree,), "both": (lazy, tree)}[switch]:
        monkeypatch.setattr(sp, name, True)
    out, lse = sp.sparse_mla(q, kv, idx, check.SCALE, num_splits=num_splits)
    if switch == "tree":
        assert torch.equal(out, out0) and torch.equal(lse, lse0)
    ok, max_err, why = check.compare(out, lse, *reference.sparse_mla(q.double(), kv.double(), idx, check.SCALE))
    assert ok, f"{switch}: max abs err {max_err:.2e}: {why}"


@pytest.mark.parametrize("b, s_q, num_splits, fp8", [(2, 1, None, False), (8, 2, 1, False), (2, 2, None, True)])
def test_cuda_graph_replay_equals_eager(b, s_q, num_splits, fp8):
    if fp8:
        q, kv, idx = check.make_fp8_case(b, s_q, 128, 2048, 4096, seed=11)
    else:
        q, kv, idx = check.make_case(b, s_q, 128, 2048, 4096, torch.bfloat16, seed=11)
    sp.sparse_mla(q, kv, idx, check.SCALE, num_splits=num_splits)      # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = sp.sparse_mla(q, kv, idx, check.SCALE, num_splits=num_splits)
    q.copy_(torch.randn_like(q))
    idx.copy_(torch.roll(idx, 1, dims=-1))
    graph.replay()
    torch.cuda.synchronize()
    out, lse = sp.sparse_mla(q, kv, idx, check.SCALE, num_splits=num_splits)
    assert torch.equal(g_out, out) and torch.equal(g_lse, lse)
