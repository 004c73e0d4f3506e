"""The CuTe DSL sparse MLA's host side on the CPU: shape checks, top-k split planning, the split merge it
shares with Triton (through the interpreter), and the `cutedsl` backend's refusal where no Hopper GPU is.
CI does not install the DSL: nothing here imports it. The kernel itself runs in
tests/gpu/test_cutedsl_sparse_gpu.py and scripts/cutedsl_sparse_check.py.
"""

import importlib
import sys

import pytest
import torch

from mlaserve import ops
from mlaserve.kernels import reference

sp = importlib.import_module("mlaserve.kernels.cutedsl.sparse_mla")
SCALE = 192 ** -0.5


def _args(b=2, s_q=3, h=16, topk=64, dtype=torch.bfloat16, kv=None, d=576):
    q = torch.zeros(b, s_q, h, d, dtype=dtype)
    kv = torch.zeros(4, 64, d, dtype=dtype) if kv is None else kv
    idx = torch.zeros(b, s_q, topk, dtype=torch.int32)
    return q, kv, idx


@pytest.mark.parametrize("change, says", [
    (dict(dtype=torch.float32), "bf16/fp16 q, got torch.float32"),
    (dict(d=512), r"q \[b, s_q, h, 576\] and head_dim_v 512, got q shape \(2, 3, 16, 512\)"),
    (dict(dtype=torch.float16, kv=torch.zeros(4, 64, 656, dtype=torch.uint8)),
     "reads the FP8 KV cache with bf16 q, got torch.float16"),
    (dict(kv=torch.zeros(4, 64, 576, dtype=torch.uint8)),
     r"FP8 kv_cache uint8 \[pages, page_size, 656\], got shape \(4, 64, 576\)"),
    (dict(kv=torch.zeros(4, 64, 576, dtype=torch.float16)), "kv_cache dtype torch.float16 must match"),
    (dict(kv=torch.zeros(4, 64, 512, dtype=torch.bfloat16)), r"kv_cache \[pages, page_size, 576\], got shape"),
])
def test_unsupported_inputs_are_named(change, says):
    q, kv, idx = _args(**change)
    with pytest.raises(ValueError, match=says):
        sp.sparse_mla(q, kv, idx, SCALE)


def test_index_and_head_dim_checks():
    q, kv, idx = _args()
    with pytest.raises(ValueError, match="head_dim_v 256"):
        sp.sparse_mla(q, kv, idx, SCALE, head_dim_v=256)
    with pytest.raises(ValueError, match="indices must be int32, got torch.int64"):
        sp.sparse_mla(q, kv, idx.long(), SCALE)
    with pytest.raises(ValueError, match=r"indices shape \(1, 3, 64\) must be \[b, s_q, topk >= 1\]"):
        sp.sparse_mla(q, kv, idx[:1], SCALE)
    # supported shapes, but the tensors are on the CPU
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        sp.sparse_mla(q, kv, idx, SCALE)


@pytest.mark.parametrize("tokens, h, topk, sms", [(1, 16, 2048, 132), (2, 128, 2048, 132), (256, 128, 2048, 132),
                                                  (3, 64, 100, 132), (1, 16, 64, 132), (7, 32, 1000, 8)])
def test_split_plan_covers_topk_in_whole_tiles(tokens, h, topk, sms):
    plan = sp.plan_splits(tokens, h, topk, sms)
    assert plan.split_len % sp.TILE_N == 0
    assert (plan.num_splits - 1) * plan.split_len < topk <= plan.num_splits * plan.split_len
    programs = tokens * -(-h // sp.TILE_M)
    if programs >= sms:
        assert plan.num_splits == 1                # the grid fills the GPU without splitting
    if topk >= 4 * sp.TILE_N and programs * 4 <= sms:
        assert plan.num_splits > 1                 # a small decode batch spreads its top-k


def test_split_plan_forced_and_limits():
    assert sp.plan_splits(1, 16, 2048, 132, num_splits=5) == sp.SparseSplitPlan(num_splits=5, split_len=448)
    assert sp.plan_splits(1, 16, 100, 132, num_splits=9).num_splits == 2     # only 2 tiles to split
    with pytest.raises(ValueError, match="num_splits must be in"):
        sp.plan_splits(1, 16, 2048, 132, num_splits=0)
    with pytest.raises(ValueError, match="32-bit offsets"):
        sp.plan_splits(40000, 128, 2048, 132)      # 40000 x 128 x 512 outputs


def test_split_merge_equals_unsplit_reference():
    """Per-split (out, lse) of the reference over each planned split, merged by the host's _combine (the
    Triton merge, interpreted on the CPU), equal the reference over the whole row: the split bounds and
    the merge are what the kernel relies on. Splits whose indices are all -1 (lse -inf) must drop out."""
    torch.manual_seed(0)
    b, s_q, h, topk = 2, 2, 4, 300
    kv = torch.randn(8, 64, 576)
    idx = torch.randint(0, 8 * 64, (b, s_q, topk), dtype=torch.int32)
    idx[0, 0, 128:256] = -1              # the whole second split of token 0 empty
    idx[1, 1] = -1                       # token 3 has nothing at all
    q = torch.randn(b, s_q, h, 576)
    plan = sp.plan_splits(b * s_q, h, topk, 132, num_splits=3)
    assert plan.num_splits == 3 and plan.split_len == 128
    po = torch.empty(plan.num_splits, b * s_q, h, 512)
    pl = torch.empty(plan.num_splits, b * s_q, h)
    for s in range(plan.num_splits):
        part = idx[..., s * plan.split_len:(s + 1) * plan.split_len]
        o, lse = reference.sparse_mla(q, kv, part, SCALE)
        po[s], pl[s] = o.reshape(b * s_q, h, 512), lse.reshape(b * s_q, h)
    assert torch.isinf(pl[1, 0]).all()
    out = torch.empty(b, s_q, h, 512)
    lse = torch.empty(b, s_q, h)
    sp._combine(po, pl, out, lse)
    ref_out, ref_lse = reference.sparse_mla(q.double(), kv.double(), idx, SCALE)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=1e-5, rtol=1e-5)
    assert (out[1, 1] == 0).all() and torch.isneginf(lse[1, 1]).all()


def test_backend_exposes_sparse_mla_and_refuses_the_cpu():
    cutedsl = importlib.import_module("mlaserve.kernels.cutedsl")
    assert cutedsl.sparse_mla is sp.sparse_mla
    q, kv, idx = _args()
    with pytest.raises(ValueError, match="backend 'cutedsl' cannot run sparse_mla here"):
        ops.sparse_mla(q, kv, idx, SCALE, backend="cutedsl")
    if importlib.util.find_spec("cutlass") is None:
        assert "cutlass" not in sys.modules       # checks and planning never import the DSL
