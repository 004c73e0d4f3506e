"""The attention registry: names for the flags, DSA capability, clear refusals."""

import pytest
import torch

from mlaserve.attention import registry
from mlaserve.attention.base import BackendConfig
from mlaserve.engine.config import EngineConfig


def test_dsa_backends_are_the_ones_with_dsa_kernels():
    assert "flashinfer" in registry.names() and "flashinfer" not in registry.names(dsa=True)
    assert registry.names(dsa=True) == ["torch", "triton", "auto"]
    config = BackendConfig(num_heads=4, kv_lora_rank=64, qk_rope_head_dim=16, dtype=torch.float32,
                           kv_cache_dtype="auto", device=torch.device("cpu"))
    with pytest.raises(ValueError, match="'flashinfer' has no DSA .* choose from \\['torch', 'triton', 'auto'\\]"):
        registry.create("flashinfer", config, dsa=True)
    cfg = EngineConfig(model_path="unused", attention_backend="flashinfer")
    assert (cfg.nsa_prefill_backend, cfg.nsa_decode_backend) == ("auto", "auto")
    cfg = EngineConfig(model_path="unused", attention_backend="torch")
    assert (cfg.nsa_prefill_backend, cfg.nsa_decode_backend) == ("torch", "torch")
