"""The DSA lightning indexer (DeepSeek-V3.2, GLM-5): which cached tokens each query attends to.

Per token, as transformers computes it (bf16/fp32, without DeepSeek's Hadamard rotation and FP8,
which leave the scores unchanged up to FP8 rounding):
    q_I = wq_b(q_lora)                [H_I, D_I]   (q_lora = q_a_layernorm(q_a_proj(x)), shared with MLA)
    k_I = LayerNorm(wk(x))            [D_I]        one key per token, shared by all indexer heads
    RoPE on the first qk_rope_head_dim dims of both (halves for V3.2, interleaved pairs for GLM-5)
    w   = weights_proj(x) · H_I^-0.5  [H_I]        float32
    I(t, s) = Σ_j w_j · ReLU(D_I^-0.5 · q_I[j] · k_I[s])   over the causally visible s
Each query keeps the `index_topk` best keys (all of them when fewer are visible); the keys live
in the KV pool's indexer-key cache, and the backend's `indexer_topk` does the scoring and top-k.
"""

import torch
from torch import nn

from mlaserve.attention.batch import ForwardBatch
from mlaserve.models.config import ModelConfig
from mlaserve.models.rope import apply_rope


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.rope_interleave = config.indexer_rope_interleave
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)   # kept in float32

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, ..., D_I]: rotates the first rope_dim dims, passes the rest."""
        rot, rest = x[..., :self.rope_dim], x[..., self.rope_dim:]
        return torch.cat([apply_rope(rot, cos, sin, self.rope_interleave), rest], dim=-1)

    def forward(self, x: torch.Tensor, q_lora: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """x [T, hidden]; q_lora [T, q_lora_rank]; cos/sin float32 [T, rope/2] -> int32 [T, index_topk] slot ids,
        -1 where fewer keys are visible.

        Writes this step's indexer keys into the cache first, so that each token sees itself.
        """
        T = x.shape[0]
        q = self._rope(self.wq_b(q_lora).view(T, self.n_heads, self.head_dim), cos, sin)    # [T, H_I, D_I]
        k = self._rope(self.k_norm(self.wk(x)), cos, sin)                                   # [T, D_I]
        fb.kv_cache.store_index_k(self.layer_id, fb.layout.slot_mapping, k)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        return fb.sparse.indexer_topk(q, weights, fb.kv_cache.index_k(self.layer_id), fb.layout, fb.sparse_meta,
                                      self.topk)
