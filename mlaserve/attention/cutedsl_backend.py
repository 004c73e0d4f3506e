"""The `cutedsl_mla` attention backend: mlaserve's CuTe DSL kernels for Hopper where they exist, the
`triton` backend's paths for the rest.

- DECODE (and short uniform extends): kernels/cutedsl/mla_decode.py, bf16/fp16 KV or the FP8 cache
  (bf16 activations), page size 64.
- DSA sparse MLA: kernels/cutedsl/sparse_mla.py, bf16/fp16 caches or the FP8 cache (bf16 activations).
- The DSA indexer, long extends (MHA form), the split combine: Triton's.

The CuTe DSL decode module exposes the Triton decode module's planning names (plan_mla_decode,
default_config, decode_config, choose_num_splits, workspace_numel), so planning and CUDA-graph buffers are
TritonBackend's own, pointed at the other kernel module and ops backend names.
"""

import importlib

import torch

from mlaserve.attention.base import BackendConfig
from mlaserve.attention.triton_backend import TritonBackend

_PAGE_SIZE = 64   # the CuTe DSL decode kernel loads one 64-token page per pipeline stage


class CuteDSLBackend(TritonBackend):
    """MLA decode and DSA sparse MLA through the CuTe DSL kernels; the rest as TritonBackend."""
    name = "cutedsl_mla"
    kernel_backend = "cutedsl"
    sparse_kernel_backend = "cutedsl"
    supports_cuda_graph = True

    @staticmethod
    def unavailable_reason(config: BackendConfig) -> str | None:
        from mlaserve.ops.registry import BACKENDS
        for kernels in ("cutedsl", "triton"):   # triton: the indexer, the MHA extends, the split combine
            reason = BACKENDS[kernels].unavailable_reason(torch.device(config.device))
            if reason is not None:
                return reason
        if config.dtype not in (torch.bfloat16, torch.float16):
            return f"the CuTe DSL MLA kernels take bf16/fp16 activations, got {config.dtype}"
        if config.kv_cache_dtype == "fp8_e4m3" and config.dtype != torch.bfloat16:
            return f"the CuTe DSL MLA decode reads the FP8 KV cache with bf16 activations, got {config.dtype}"
        if config.kv_cache_dtype not in ("auto", "fp8_e4m3"):
            return f"the CuTe DSL MLA decode has no {config.kv_cache_dtype!r} KV cache"
        if (config.kv_lora_rank, config.qk_rope_head_dim) != (512, 64):
            return (f"the CuTe DSL MLA kernels need kv_lora_rank 512 and qk_rope_head_dim 64 (d_qk 576), got "
                    f"{config.kv_lora_rank} and {config.qk_rope_head_dim}")
        if config.page_size != _PAGE_SIZE:
            return f"the CuTe DSL MLA decode needs --page-size {_PAGE_SIZE}, got {config.page_size}"
        return None

    def __init__(self, config: BackendConfig, mha_min_extend: int = 128):
        reason = self.unavailable_reason(config)
        if reason is not None:
            raise ValueError(f"attention backend 'cutedsl_mla' cannot run here: {reason}")
        super().__init__(config, mha_min_extend=mha_min_extend)
        self._decode = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
