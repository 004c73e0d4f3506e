"""Multi-head Latent Attention over the paged latent KV cache (DESIGN.md, "MLA, as computed here").

Per step, for the T new tokens of the batch:
    q        = q_b_proj(q_a_layernorm(q_a_proj(x)))   (or q_proj(x) when q_lora_rank is null)  [T, h, nope + rope]
    ckv, kpe = kv_a_proj_with_mqa(x); ckv = kv_a_layernorm(ckv)                                [T, r], [T, rope]
    RoPE on q_pe and kpe; [ckv, kpe] is written to the cache before attending.
Then one of three forms, all equal in exact arithmetic:
- absorbed (decode, and EXTEND when the backend prefers it): q_lat = q_nope · W_UK, MQA of
  [q_lat, q_pe] over the cached [ckv, kpe] rows, o = o_lat · W_UVᵀ;
- MHA (EXTEND when `dense.extend_uses_mha`): the context latents are gathered and expanded through
  kv_b_proj into per-head k_nope and v, then causal attention with d_qk = nope + rope;
- sparse (DSA layers, prefill and decode alike): the absorbed form over the indexer's top-k slots.
W_UK [h, nope, r] and W_UV [h, v, r] are views of kv_b_proj.weight, taken once after loading.
Under tensor parallelism h is this rank's share of the heads (models/parallel.py): q and kv_b_proj
hold those heads' rows, o_proj their columns, and o_proj's partial outputs are all-reduced.
"""

import torch
from torch import nn

from mlaserve.attention.batch import ForwardBatch, ForwardMode
from mlaserve.models.config import ModelConfig
from mlaserve.models.indexer import Indexer
from mlaserve.models.layers import RMSNorm
from mlaserve.models.parallel import SINGLE, ParallelConfig
from mlaserve.models.rope import apply_rope


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, parallel: ParallelConfig = SINGLE):
        super().__init__()
        self.layer_id = layer_id
        self.parallel = parallel
        self.num_heads = h = parallel.shard(config.num_heads, "num_attention_heads")
        self.nope = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.rope_interleave = config.rope_interleave
        self.softmax_scale = config.softmax_scale
        bias = config.attention_bias
        qk = config.qk_head_dim
        self.has_q_lora = config.q_lora_rank is not None
        if not self.has_q_lora:
            self.q_proj = nn.Linear(config.hidden_size, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank)
            self.q_b_proj = nn.Linear(config.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, config.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, h * (config.qk_nope_head_dim + config.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * config.v_head_dim, config.hidden_size, bias=bias)
        # DSA: a layer runs its own indexer ("full") or reuses the previous layer's top-k ("shared", GLM-5).
        self.is_dsa = config.is_dsa
        self.indexer = Indexer(config, layer_id) if config.is_dsa and config.indexer_types[layer_id] == "full" else None
        self.w_uk: torch.Tensor | None = None
        self.w_uv: torch.Tensor | None = None

    def prepare_weights(self) -> None:
        """Takes W_UK [h, nope, r] and W_UV [h, v, r] as views of kv_b_proj.weight; call after loading."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_head_dim, self.kv_lora_rank)
        self.w_uk, self.w_uv = w[:, :self.nope], w[:, self.nope:]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                topk_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, hidden]; cos/sin float32 [T, rope/2]; topk_indices: the previous DSA layer's selection.

        Returns (out [T, hidden], this layer's top-k slots int32 [T, index_topk] or None for dense layers).
        """
        T = x.shape[0]
        q_lora = None
        if not self.has_q_lora:
            q = self.q_proj(x)
        else:
            q_lora = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_lora)
        q = q.view(T, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_pe = q[..., :self.nope], apply_rope(q[..., self.nope:], cos, sin, self.rope_interleave)
        latent = self.kv_a_proj_with_mqa(x)
        ckv = self.kv_a_layernorm(latent[:, :self.kv_lora_rank])                               # [T, r]
        kpe = apply_rope(latent[:, self.kv_lora_rank:], cos, sin, self.rope_interleave)       # [T, rope]
        fb.kv_cache.store_kv(self.layer_id, fb.layout.slot_mapping, ckv, kpe)

        if self.is_dsa:
            if self.indexer is not None:
                topk_indices = self.indexer(x, q_lora, cos, sin, fb)
            if topk_indices is None:
                raise ValueError(f"layer {self.layer_id} shares the DSA top-k of a previous layer, but none ran")
            o_lat = fb.sparse.sparse_mla(self._absorb(q_nope, q_pe), fb.kv_cache.kv(self.layer_id), topk_indices,
                                         fb.layout, fb.sparse_meta, self.softmax_scale, self.kv_lora_rank)
            o = self._unabsorb(o_lat)
        elif fb.layout.mode is ForwardMode.EXTEND and fb.dense.extend_uses_mha(fb.layout):
            o = self._mha(q_nope, q_pe, fb)
        else:
            o_lat = fb.dense.mla(self._absorb(q_nope, q_pe), fb.kv_cache.kv(self.layer_id), fb.layout,
                                 fb.dense_meta, self.softmax_scale, self.kv_lora_rank)
            o = self._unabsorb(o_lat)
        out = self.o_proj(o.reshape(T, self.num_heads * self.v_head_dim))
        return self.parallel.all_reduce(out), topk_indices

    def _absorb(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """q_nope [T, h, nope], q_pe [T, h, rope] -> [T, h, r + rope]: q_lat = q_nope · W_UK, then q_pe."""
        q_lat = torch.einsum("thn,hnr->thr", q_nope, self.w_uk)
        return torch.cat([q_lat, q_pe], dim=-1)

    def _unabsorb(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [T, h, r] -> o [T, h, v] = o_lat · W_UVᵀ."""
        return torch.einsum("thr,hvr->thv", o_lat, self.w_uv)

    def _mha(self, q_nope: torch.Tensor, q_pe: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """MHA form over each request's whole context (prefix + new tokens), read back from the cache.

        -> o [T, h, v]. The context is gathered from the cache (not taken from this step's ckv), so that
        prefix-cache hits, chunked prefill and an FP8 cache all see exactly what decode will see.
        """
        ctx = fb.kv_cache.gather_kv(self.layer_id, fb.layout.context_slots)           # [Tk, r + rope]
        kv = self.kv_b_proj(ctx[:, :self.kv_lora_rank]).view(-1, self.num_heads, self.nope + self.v_head_dim)
        k_pe = ctx[:, None, self.kv_lora_rank:].expand(-1, self.num_heads, -1)
        k = torch.cat([kv[..., :self.nope], k_pe], dim=-1)                               # [Tk, h, nope + rope]
        v = kv[..., self.nope:]                                                          # [Tk, h, v]
        q = torch.cat([q_nope, q_pe], dim=-1)                                            # [T, h, nope + rope]
        return fb.dense.mha(q, k, v.contiguous(), fb.layout, fb.dense_meta, self.softmax_scale)
