"""The DeepSeek-family causal LM over mlaserve's paged latent cache: V2, V3 (and Kimi K2), V3.2, GLM-5.

One class serves the four architectures; `ModelConfig` carries their differences (routing, rope
layout, DSA, GLM-5's shared indexer layers). Parameter names mirror the HF checkpoints
(`model.layers.{i}.self_attn.kv_b_proj.weight`, `model.layers.{i}.mlp.experts.{e}.up_proj.weight`,
`lm_head.weight`), so loading is a direct map.

The engine drives it with one `ForwardBatch` per step:
    hidden = model.forward(fb)              # [T, hidden_size], final norm applied
    logits = model.compute_logits(hidden)   # [N, hidden_size] -> float32 [N, vocab_size]
"""

import torch
from torch import nn

from mlaserve.attention.base import BackendConfig
from mlaserve.attention.batch import ForwardBatch
from mlaserve.models.config import ModelConfig
from mlaserve.models.layers import MLP, RMSNorm
from mlaserve.models.mla import MLAttention
from mlaserve.models.moe import MoE
from mlaserve.models.parallel import SINGLE, ParallelConfig, check_divisible
from mlaserve.models.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, parallel: ParallelConfig):
        super().__init__()
        self.self_attn = MLAttention(config, layer_id, parallel)
        if config.mlp_layer_types[layer_id] == "sparse":
            self.mlp = MoE(config, parallel)
        else:
            self.mlp = MLP(config.hidden_size, parallel.shard(config.intermediate_size, "intermediate_size"),
                           bias=config.mlp_bias, reduce=parallel if parallel.tp_size > 1 else None)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                topk_indices: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, hidden] -> ([T, hidden], this layer's DSA top-k slots or None)."""
        attn, topk_indices = self.self_attn(self.input_layernorm(x), cos, sin, fb, topk_indices)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, topk_indices


class DeepseekModel(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, parallel) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """`parallel`: this rank's tensor-parallel shard (models/parallel.py); the default is the whole model."""

    def __init__(self, config: ModelConfig, parallel: ParallelConfig = SINGLE):
        super().__init__()
        check_divisible(config, parallel.tp_size)
        self.config = config
        self.parallel = parallel
        self.model = DeepseekModel(config, parallel)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        with torch.device("cpu"):   # real tables even when the modules are built on the meta device
            self.rotary = RotaryEmbedding(config.rope, config.qk_rope_head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def prepare_weights(self) -> None:
        """After the weights are in place: absorbed-MLA views, stacked experts, rope tables on the model's device."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for layer in self.model.layers:
            layer.self_attn.prepare_weights()
            if isinstance(layer.mlp, MoE):
                layer.mlp.prepare_weights()
        self.rotary.to(self.device)

    @torch.no_grad()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """fb: one step's batch (input_ids int64 [T]) -> final hidden states [T, hidden_size]."""
        x = self.model.embed_tokens(fb.input_ids)
        cos, sin = self.rotary.cos_sin(fb.positions)
        topk_indices = None
        for layer in self.model.layers:
            x, topk_indices = layer(x, cos, sin, fb, topk_indices)
        return self.model.norm(x)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]."""
        return self.lm_head(hidden).float()

    def kv_pool_spec(self) -> dict:
        """The model-given arguments of `engine.kv_pool.KVPool` (the engine adds pages, dtype, device)."""
        cfg = self.config
        return dict(num_layers=cfg.num_layers, kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim,
                    index_head_dim=cfg.index_head_dim if cfg.is_dsa else None)

    def backend_config(self, kv_cache_dtype: str, device: torch.device | str, page_size: int = 64) -> BackendConfig:
        cfg = self.config
        return BackendConfig(num_heads=cfg.num_heads // self.parallel.tp_size, kv_lora_rank=cfg.kv_lora_rank,
                             qk_rope_head_dim=cfg.qk_rope_head_dim, dtype=self.dtype, kv_cache_dtype=kv_cache_dtype,
                             device=torch.device(device), index_topk=cfg.index_topk if cfg.is_dsa else None,
                             page_size=page_size)
