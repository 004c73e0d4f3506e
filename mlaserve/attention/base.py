"""The attention backend interface: engine-facing, one object per backend.

Life cycle, per model step:
    meta = backend.plan(layout)          # host side, outside CUDA graphs: everything data-dependent
    backend.mla(...) / backend.mha(...)  # dense MLA, per layer: launches only
    backend.indexer_topk(...) / backend.sparse_mla(...)   # DSA, per layer
CUDA-graph hooks (backends that support graphs override them):
    backend.init_cuda_graph(max_batch_size, max_pages)   # static buffers, once
    backend.plan_for_capture(layout) / plan_for_replay(layout)   # write into those buffers

All tensors are token-major: T new tokens of the step, request by request (BatchLayout).
"""

from abc import ABC
from dataclasses import dataclass

import torch

from mlaserve.attention.batch import BatchLayout


@dataclass(frozen=True)
class BackendConfig:
    """What a backend may specialize on, fixed for the life of the engine."""
    num_heads: int                 # query heads on this rank
    kv_lora_rank: int              # 512 for DeepSeek (head_dim_v of the absorbed form)
    qk_rope_head_dim: int          # 64 for DeepSeek
    dtype: torch.dtype             # activations
    kv_cache_dtype: str            # "auto" (= dtype) or "fp8_e4m3"
    device: torch.device
    index_topk: int | None = None  # DSA models only
    page_size: int = 64            # tokens per KV page (the engine's --page-size)


class AttentionBackend(ABC):
    name: str = "?"
    supports_cuda_graph: bool = False

    def __init__(self, config: BackendConfig):
        self.config = config

    def plan(self, layout: BatchLayout):
        """Backend-specific metadata for this step (host work only). Default: nothing beyond the layout."""
        return None

    def extend_uses_mha(self, layout: BatchLayout) -> bool:
        """Whether EXTEND steps use the MHA form (expanded K/V) rather than the absorbed one."""
        return True

    # -- dense MLA --
    def mla(self, q: torch.Tensor, kv_cache: torch.Tensor, layout: BatchLayout, meta, softmax_scale: float,
            head_dim_v: int) -> torch.Tensor:
        """Absorbed MLA over each request's cache, causal.

        q [T, h, d_qk]; kv_cache [pages, page_size, d_qk] or uint8 [pages, page_size, 656]
        -> o_lat [T, h, head_dim_v] in q's dtype.
        """
        raise NotImplementedError(f"backend {self.name!r} has no dense MLA")

    def mha(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout, meta,
            softmax_scale: float) -> torch.Tensor:
        """MHA-form attention of each request's new tokens over its whole context, causal.

        q [T, h, d_qk]; k [Tk, h, d_qk]; v [Tk, h, d_v], Tk = sum(seq_lens) laid out by
        layout.cu_seqlens_k -> [T, h, d_v] in q's dtype.
        """
        raise NotImplementedError(f"backend {self.name!r} has no MHA prefill")

    # -- DSA --
    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, layout: BatchLayout,
                     meta, topk: int) -> torch.Tensor:
        """q [T, H_I, D_I]; weights float32 [T, H_I]; k_cache [pages, page_size, D_I] -> int32 [T, topk] slots."""
        raise NotImplementedError(f"backend {self.name!r} has no DSA indexer")

    def sparse_mla(self, q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, layout: BatchLayout,
                   meta, softmax_scale: float, head_dim_v: int) -> torch.Tensor:
        """q [T, h, d_qk]; indices int32 [T, topk] slots (-1 unused) -> o_lat [T, h, head_dim_v]."""
        raise NotImplementedError(f"backend {self.name!r} has no sparse MLA")

    # -- CUDA graphs --
    def init_cuda_graph(self, max_batch_size: int, max_pages: int) -> None:
        raise NotImplementedError(f"backend {self.name!r} does not support CUDA graphs")

    def plan_for_capture(self, layout: BatchLayout):
        raise NotImplementedError(f"backend {self.name!r} does not support CUDA graphs")

    def plan_for_replay(self, layout: BatchLayout):
        raise NotImplementedError(f"backend {self.name!r} does not support CUDA graphs")
