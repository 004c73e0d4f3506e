"""DeepSeek-family MLA models (V2, V3 / Kimi K2, V3.2 and GLM-5 with DSA) over the paged latent KV cache.

    from mlaserve.models import load_model, load_tokenizer, ModelConfig
    model = load_model(path, device="cpu", dtype=torch.float32)   # eval mode, weights loaded
    pool = KVPool(**model.kv_pool_spec(), num_pages=..., page_size=..., dtype=model.dtype, device=...)
    hidden = model.forward(fb)              # fb: attention.batch.ForwardBatch -> [T, hidden_size]
    logits = model.compute_logits(hidden)   # -> float32 [N, vocab_size]
"""

from mlaserve.models.config import ModelConfig
from mlaserve.models.deepseek import DeepseekForCausalLM
from mlaserve.models.loader import load_model, load_tokenizer

__all__ = ["ModelConfig", "DeepseekForCausalLM", "load_model", "load_tokenizer"]
