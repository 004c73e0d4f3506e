"""The `cutedsl_mla` attention backend: DECODE (and short uniform extends) through mlaserve's CuTe DSL
MLA decode kernel for Hopper; everything else as the `triton` backend does it.

The CuTe DSL module exposes the Triton decode module's planning names (plan_mla_decode,
default_config, choose_num_splits, workspace_numel), so planning, CUDA-graph buffers and the
extend/MHA paths are TritonBackend's own, only pointed at the other kernel module and backend
name. No DSA kernels (dsa False in attention/registry.py).
"""

import importlib

import torch

from mlaserve.attention.base import BackendConfig
from mlaserve.attention.triton_backend import TritonBackend


class CuteDSLBackend(TritonBackend):
    """Dense MLA decode through kernels/cutedsl/mla_decode.py; extend/MHA/graphs as TritonBackend."""
    name = "cutedsl_mla"
    kernel_backend = "cutedsl"
    supports_cuda_graph = True

    @staticmethod
    def unavailable_reason(config: BackendConfig) -> str | None:
        from mlaserve.ops.registry import BACKENDS
        for kernels in ("cutedsl", "triton"):   # triton: the MHA extends, the split combine
            reason = BACKENDS[kernels].unavailable_reason(torch.device(config.device))
            if reason is not None:
                return reason
        if config.dtype not in (torch.bfloat16, torch.float16):
            return f"the CuTe DSL MLA decode takes bf16/fp16 activations, got {config.dtype}"
        if config.kv_cache_dtype != "auto":
            return (f"the CuTe DSL MLA decode has no {config.kv_cache_dtype} KV cache yet; "
                    f"use --attention-backend triton for it")
        if (config.kv_lora_rank, config.qk_rope_head_dim) != (512, 64):
            return (f"the CuTe DSL MLA decode needs kv_lora_rank 512 and qk_rope_head_dim 64 (d_qk 576), got "
                    f"{config.kv_lora_rank} and {config.qk_rope_head_dim}")
        return None

    def __init__(self, config: BackendConfig, mha_min_extend: int = 128):
        reason = self.unavailable_reason(config)
        if reason is not None:
            raise ValueError(f"attention backend 'cutedsl_mla' cannot run here: {reason}")
        super().__init__(config, mha_min_extend=mha_min_extend)
        self._decode = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
