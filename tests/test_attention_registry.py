"""The attention registry: names for the flags, DSA capability, clear refusals."""

import pytest
import torch

from mlaserve.attention import registry
from mlaserve.attention.auto_backend import AutoBackend
from mlaserve.attention.base import AttentionBackend, BackendConfig
from mlaserve.attention.batch import BatchLayout, ForwardMode
from mlaserve.engine.config import EngineConfig


def test_dsa_backends_are_the_ones_with_dsa_kernels():
    assert "flashinfer" in registry.names() and "flashinfer" not in registry.names(dsa=True)
    assert registry.names(dsa=True) == ["cutedsl_mla", "torch", "triton", "auto"]
    config = BackendConfig(num_heads=4, kv_lora_rank=64, qk_rope_head_dim=16, dtype=torch.float32,
                           kv_cache_dtype="auto", device=torch.device("cpu"))
    with pytest.raises(ValueError, match="'flashinfer' has no DSA .* choose from \\['cutedsl_mla', 'torch', 'triton', 'auto'\\]"):
        registry.create("flashinfer", config, dsa=True)
    cfg = EngineConfig(model_path="unused", attention_backend="flashinfer")
    assert (cfg.nsa_prefill_backend, cfg.nsa_decode_backend) == ("auto", "auto")
    cfg = EngineConfig(model_path="unused", attention_backend="torch")
    assert (cfg.nsa_prefill_backend, cfg.nsa_decode_backend) == ("torch", "torch")


class _Fake(AttentionBackend):
    """Records which backend ran a step, so the choice is visible."""

    def __init__(self, config, name):
        super().__init__(config)
        self.name = name

    def plan(self, layout):
        return f"{self.name}-plan"

    def mla(self, q, kv_cache, layout, meta, softmax_scale, head_dim_v):
        return (self.name, meta)

    def sparse_mla(self, q, kv_cache, indices, layout, meta, softmax_scale, head_dim_v):
        return (self.name, meta)


def _cfg(heads):
    return BackendConfig(num_heads=heads, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                         kv_cache_dtype="auto", device=torch.device("cpu"))


@pytest.mark.parametrize("heads,extend,want", [
    (16, [1, 1], "triton"),        # up to 16 rows: Triton level with both peers or ahead, the primary keeps them
    (32, [1, 1], "cutedsl_mla"),   # 17-64 rows: FlashInfer's rule starts at 65, the CuTe DSL kernel's at 17
    (64, [1, 1], "cutedsl_mla"),
    (80, [1, 1], "flashinfer"),    # 65+ rows in DECODE: FlashInfer first in order of preference
    (128, [1], "flashinfer"),
    (128, [5, 3], "triton"),       # EXTEND steps stay with the primary
])
def test_auto_chooses_per_step(heads, extend, want):
    cfg = _cfg(heads)
    auto = AutoBackend(cfg, _Fake(cfg, "triton"), (_Fake(cfg, "flashinfer"), _Fake(cfg, "cutedsl_mla")))
    layout = BatchLayout.build([4] * len(extend), extend, [[1, 2]] * len(extend), 64, "cpu")
    meta = auto.plan(layout)
    assert auto.mla(None, None, layout, meta, 0.1, 512) == (want, f"{want}-plan")


def test_auto_without_peer_and_for_dsa():
    cfg = _cfg(128)
    primary = _Fake(cfg, "triton")
    auto = AutoBackend(cfg, primary)
    layout = BatchLayout.build([4], [1], [[1]], 64, "cpu")
    assert auto.sparse_mla(None, None, None, layout, auto.plan(layout), 0.1, 512) == ("triton", "triton-plan")
    with_peer = AutoBackend(cfg, primary, (_Fake(cfg, "flashinfer"),))
    with pytest.raises(RuntimeError, match="auto chose 'flashinfer' for this step, which has no DSA kernels"):
        with_peer.sparse_mla(None, None, None, layout, with_peer.plan(layout), 0.1, 512)
    # what the registry builds for DSA layers has no peer
    assert registry.create("auto", _cfg(128), dsa=True).decode_peers == ()


@pytest.mark.parametrize("runnable,primary,peers", [
    ({"triton", "flashinfer", "cutedsl_mla"}, "cutedsl_mla", ("triton",)),   # FlashInfer has no rule against it
    ({"triton", "cutedsl_mla"}, "cutedsl_mla", ("triton",)),
    ({"flashinfer", "cutedsl_mla"}, "cutedsl_mla", ()),
    ({"triton", "flashinfer"}, "triton", ("flashinfer",)),
    ({"triton"}, "triton", ()),
])
def test_auto_primary_and_decode_peers_are_those_that_run_here(monkeypatch, runnable, primary, peers):
    """The registry gives auto the fastest primary that runs with the config and the peers with a rule against it."""
    cfg = BackendConfig(num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        kv_cache_dtype="auto", device=torch.device("cuda"))
    monkeypatch.setattr(registry, "unavailable_reason",
                        lambda name, config: None if name in runnable else f"{name} cannot run in this test")
    monkeypatch.setattr(registry, "_load", lambda name: (lambda config, **kw: _Fake(config, name)))
    auto = registry.create("auto", cfg)
    assert auto.primary.name == primary
    assert tuple(p.name for p in auto.decode_peers) == peers
    dsa = registry.create("auto", cfg, dsa=True)
    assert dsa.primary.name == primary and dsa.decode_peers == ()


def test_auto_with_cutedsl_primary_keeps_fp8_steps():
    """Over the FP8 cache the CuTe DSL's kernels keep the decode steps (its FP8-MMA kernel is ahead of Triton's at
    <= 16 rows, and both balance varied lengths alike: the next test); over 16-bit caches Triton takes the steps of
    <= 16 rows."""
    fp8 = BackendConfig(num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        kv_cache_dtype="fp8_e4m3", device=torch.device("cpu"))
    auto = AutoBackend(fp8, _Fake(fp8, "cutedsl_mla"), (_Fake(fp8, "triton"),))
    assert auto.decode_peers == ()
    layout = BatchLayout.build([4] * 8, [1] * 8, [[1]] * 8, 64, "cpu")
    assert auto.mla(None, None, layout, auto.plan(layout), 0.1, 512)[0] == "cutedsl_mla"
    bf16 = _cfg(16)
    assert [p.name for p in AutoBackend(bf16, _Fake(bf16, "cutedsl_mla"), (_Fake(bf16, "triton"),)).decode_peers] \
        == ["triton"]


@pytest.mark.parametrize("heads,s_q,batch,want", [
    (128, 1, 4, "cutedsl_mla"),     # 128 rows, small batch: level with FlashInfer since the combine got faster
    (128, 1, 64, "cutedsl_mla"),    # large batch: level or faster, the primary keeps it
    (64, 2, 4, "cutedsl_mla"),      # 128 rows from 64 heads x 2 tokens
    (64, 1, 4, "cutedsl_mla"),
    (32, 1, 128, "cutedsl_mla"),    # 17+ rows: the CuTe DSL kernel ahead of Triton's
    (16, 1, 1, "triton"),           # up to 16 rows: Triton's keys-on-M kernel level or ahead
    (16, 1, 128, "triton"),
    (8, 2, 4, "triton"),            # 16 rows from 8 heads x 2 tokens
])
def test_auto_with_cutedsl_primary_gives_peers_their_decode_steps(heads, s_q, batch, want):
    cfg = _cfg(heads)
    auto = AutoBackend(cfg, _Fake(cfg, "cutedsl_mla"), (_Fake(cfg, "flashinfer"), _Fake(cfg, "triton")))
    assert [p.name for p in auto.decode_peers] == ["triton"]     # FlashInfer has no DECODE_RULES entry here
    layout = BatchLayout.build([4] * batch, [1] * batch, [[1]] * batch, 64, "cpu")
    if s_q > 1:    # DECODE-mode steps carry one token each; s_q new tokens arrive as a uniform EXTEND
        layout = BatchLayout.build([4] * batch, [s_q] * batch, [[1]] * batch, 64, "cpu", mode=ForwardMode.DECODE)
    assert auto.mla(None, None, layout, auto.plan(layout), 0.1, 512)[0] == want


@pytest.mark.parametrize("heads,kv,lengths,want", [
    (32, "auto", "varied", "cutedsl_mla"),      # 17-64 rows, variable lengths: both split them, the CuTe DSL keeps
    (64, "auto", "varied", "cutedsl_mla"),
    (32, "fp8_e4m3", "varied", "cutedsl_mla"),
    (16, "fp8_e4m3", "varied", "cutedsl_mla"),
    (32, "auto", "fixed", "cutedsl_mla"),       # fixed lengths: the CuTe DSL kernel keeps them
    (16, "fp8_e4m3", "fixed", "cutedsl_mla"),
    (16, "auto", "fixed", "triton"),            # <= 16 rows over 16-bit caches: Triton's, whatever the lengths
    (16, "auto", "varied", "triton"),
    (128, "auto", "varied", "cutedsl_mla"),
])
def test_auto_keeps_the_varied_decode_steps_with_a_cutedsl_primary(monkeypatch, heads, kv, lengths, want):
    """With a CuTe DSL primary, the DECODE steps whose host lengths vary enough for the planners to split them
    (balanced_splits; planning as on an H200's 132 SMs) stay with the CuTe DSL, which splits and orders them as
    Triton does (bench/NOTES.md 105); Triton keeps only the steps of <= 16 rows over 16-bit caches."""
    from mlaserve.kernels.triton import mla_decode_plan
    monkeypatch.setattr(mla_decode_plan, "_is_hopper", lambda device: True)
    monkeypatch.setattr(mla_decode_plan, "_num_sms", lambda device: 132)
    mla_decode_plan.choose_num_splits.cache_clear()
    cfg = BackendConfig(num_heads=heads, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        kv_cache_dtype=kv, device=torch.device("cpu"))
    auto = AutoBackend(cfg, _Fake(cfg, "cutedsl_mla"), (_Fake(cfg, "triton"),))
    gen = torch.Generator().manual_seed(heads)
    lens = ((8192 * (0.5 + torch.rand(128, generator=gen))).long().tolist() if lengths == "varied"
            else [8192] * 128)
    tables = [list(range(1 + 192 * i, 1 + 192 * i + -(-n // 64))) for i, n in enumerate(lens)]
    layout = BatchLayout.build([n - 1 for n in lens], [1] * 128, tables, 64, "cpu")
    assert auto.mla(None, None, layout, auto.plan(layout), 0.1, 512)[0] == want
    mla_decode_plan.choose_num_splits.cache_clear()
