"""Tiny random HF checkpoints of the four MLA architectures, built with transformers itself.

    path = build_checkpoint(tmp_dir, "v3", seed=0, **config_overrides)
    hf = load_hf(path)          # transformers' model, eager attention, float32

transformers initializes with std 0.02, which leaves a tiny model's next-token distribution
nearly uniform and its greedy choices decided by rounding. `build_checkpoint` re-draws every weight
at a fan-in scale (norm weights around 1, biases and e_score_correction_bias nonzero, a sharper
lm_head), so that logits spread over several units, routing and indexer choices have margins, and
parity tests compare real decisions.
"""

import os

import torch

# Two or three layers with first_k_dense_replace=1 (dense and MoE layers both exist), grouped routing,
# heads >= 4, dims unequal so that a swapped axis cannot pass unnoticed.
_COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
    qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    first_k_dense_replace=1, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=None,
)
# The DSA indexer: index_topk well below the test prompts' lengths so that sparsity really selects;
# 16 indexer heads make an exact-zero score (every ReLU term zero) too rare to tie the top-k.
_DSA = dict(index_topk=8, index_head_dim=32, index_n_heads=16)

ARCHS = {
    # name: (transformers config class, model class, overrides)
    "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
           dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
    "v2_lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                dict(q_lora_rank=None, topk_method="greedy", n_group=None, topk_group=None,
                     routed_scaling_factor=1.0, n_shared_experts=2)),
    # (no released V2 has biases; they are switched on here to cover their code paths)
    "v2_group": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                 dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=4.0,
                      attention_bias=True, mlp_bias=True)),
    "v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM",
            dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, **_DSA)),
    # GLM-5: qk_nope != v_head_dim as in the real model (192 / 256), interleaved indexer rope,
    # and a "shared" layer that reuses the previous layer's top-k.
    "glm5": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
             dict(n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, qk_nope_head_dim=24,
                  v_head_dim=32, rms_norm_eps=1e-5, indexer_types=["full", "shared", "full"], **_DSA)),
}


def hf_config(arch: str, **overrides):
    """transformers' config object for the tiny `arch` (see ARCHS), with `overrides` applied last."""
    import transformers
    cfg_cls, model_cls, arch_overrides = ARCHS[arch]
    kwargs = {**_COMMON, "architectures": [model_cls], **arch_overrides, **overrides}
    return getattr(transformers, cfg_cls)(**kwargs)


def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Fan-in-scaled random weights (module docstring)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or name.endswith("inv_freq"):
                continue
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * randn(p.shape))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * randn(p.shape))
            elif name.endswith("bias"):
                p.copy_(0.1 * randn(p.shape))
            elif "embed_tokens" in name:
                p.copy_(randn(p.shape))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(2.0 * randn(p.shape) / p.shape[-1] ** 0.5)
            elif name == "lm_head.weight":
                p.copy_(3.0 * randn(p.shape) / p.shape[-1] ** 0.5)
            else:   # Linear [out, in] and fused experts [E, out, in]: fan-in is the last dim
                p.copy_(randn(p.shape) / p.shape[-1] ** 0.5)


def build_checkpoint(directory: str, arch: str, seed: int = 0, max_shard_size: str | None = None,
                     **overrides) -> str:
    """Saves a tiny random `arch` model (float32 safetensors, HF layout) under `directory`; returns the path."""
    import transformers
    config = hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHS[arch][1])(config)
    _reinit(model, seed)
    os.makedirs(directory, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def load_hf(path: str):
    """transformers' own model of the checkpoint: float32, eager attention, eval mode."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every prompt position: float32 [len(prompt), vocab]."""
    logits = hf_model(torch.tensor([prompt], device=hf_model.device)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generate with EOS disabled -> (new tokens, raw logits float32 [max_new_tokens, vocab])."""
    out = hf_model.generate(torch.tensor([prompt], device=hf_model.device), do_sample=False,
                            max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0, output_logits=True,
                            return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.cat([l.float() for l in out.logits], dim=0).cpu()


_CACHE: dict[tuple, str] = {}
_CACHE_ROOT: list[str] = []


def cached_checkpoint(arch: str, seed: int = 0, **overrides) -> str:
    """`build_checkpoint` once per (arch, seed, overrides) per test process, in a temp dir removed at exit."""
    import atexit
    import shutil
    import tempfile
    key = (arch, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
    if key not in _CACHE:
        if not _CACHE_ROOT:
            _CACHE_ROOT.append(tempfile.mkdtemp(prefix="mlaserve-ckpt-"))
            atexit.register(shutil.rmtree, _CACHE_ROOT[0], True)
        _CACHE[key] = build_checkpoint(os.path.join(_CACHE_ROOT[0], str(len(_CACHE))), arch, seed, **overrides)
    return _CACHE[key]


def random_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    """Token ids in [2, vocab_size): 0 and 1 are BOS/EOS in the tiny configs."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| relative to the scale of `expected` (its max magnitude, at least 1), on the CPU."""
    actual, expected = actual.float().cpu(), expected.float().cpu()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1.0))
