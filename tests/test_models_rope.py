"""RoPE and YaRN: tables, softmax scale and whole models against transformers."""

import math

import pytest
import torch

from model_factory import cached_checkpoint, hf_config, hf_greedy, hf_prompt_logprobs, load_hf, random_prompts, rel_err
from model_harness import PagedRunner
from mlaserve.models import ModelConfig, load_model
from mlaserve.models.config import RopeConfig
from mlaserve.models.rope import RotaryEmbedding, apply_rope, rope_inv_freq

# DeepSeek-V3's own setting; an mscale != mscale_all_dim one (cos/sin then carry a factor != 1);
# and one with transformers' optional knobs.
YARN_CASES = [
    dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=1.0,
         original_max_position_embeddings=4096, beta_fast=32, beta_slow=1),
    dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.9, mscale_all_dim=0.7,
         original_max_position_embeddings=32),
    dict(rope_type="yarn", rope_theta=50000.0, factor=8.0, mscale=1.0, mscale_all_dim=0.8, truncate=False,
         original_max_position_embeddings=64, beta_fast=16, beta_slow=2),
    dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, attention_factor=1.3, original_max_position_embeddings=32),
]


@pytest.mark.parametrize("case", range(len(YARN_CASES) + 1))
def test_rope_tables_and_softmax_scale_match_transformers(case):
    from transformers import DeepseekV3ForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = YARN_CASES[case] if case < len(YARN_CASES) else dict(rope_type="default", rope_theta=20000.0)
    cfg = hf_config("v3", rope_parameters=dict(params), max_position_embeddings=4096 * 40)
    ours = ModelConfig.from_dict(cfg.to_dict())
    inv_freq, attention_factor = rope_inv_freq(ours.rope, ours.qk_rope_head_dim)
    if params["rope_type"] == "yarn":
        ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    else:
        ref_freq, ref_factor = DeepseekV3ForCausalLM(cfg).model.rotary_emb.compute_default_rope_parameters(cfg)
    torch.testing.assert_close(inv_freq, ref_freq, rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(ref_factor, rel=1e-12)
    cfg.num_hidden_layers = 1
    ref_scale = DeepseekV3ForCausalLM(cfg).model.layers[0].self_attn.scaling
    assert ours.softmax_scale == pytest.approx(ref_scale, rel=1e-12)
    if params.get("mscale_all_dim"):
        assert ours.softmax_scale != pytest.approx(ours.qk_head_dim ** -0.5)   # mscale² really applied


def test_legacy_rope_scaling_reads_like_rope_parameters():
    """Released checkpoints write `rope_scaling` + top-level `rope_theta`; transformers 5 writes `rope_parameters`."""
    base = hf_config("v3").to_dict()
    legacy = dict(base, rope_theta=10000.0,
                  rope_scaling=dict(type="yarn", factor=40, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
                                    original_max_position_embeddings=4096))
    legacy.pop("rope_parameters")
    modern = dict(base, rope_parameters=dict(YARN_CASES[0]))
    assert ModelConfig.from_dict(legacy).rope == ModelConfig.from_dict(modern).rope
    assert ModelConfig.from_dict(legacy).rope.rope_type == "yarn"


def test_apply_rope_is_a_rotation_of_pairs():
    """Interleaved pairs (x0, x1) and half pairs (x_i, x_{i+d/2}) each rotate by the angle of their frequency."""
    rot = RotaryEmbedding(RopeConfig(theta=100.0), 8)
    pos = torch.tensor([0, 3, 17])
    cos, sin = rot.cos_sin(pos)
    x = torch.randn(3, 2, 8, dtype=torch.float64).float()
    for interleaved in (True, False):
        y = apply_rope(x, cos, sin, interleaved)
        pairs = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :4], x[..., 4:])
        z = torch.complex(pairs[0].double(), pairs[1].double())
        angle = pos[:, None, None].double() * rot.inv_freq.double()
        z = z * torch.polar(torch.ones_like(angle), angle)
        torch.testing.assert_close(y.double(), torch.cat([z.real, z.imag], dim=-1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch,overrides", [
    ("v3", dict(rope_parameters=YARN_CASES[1])),
    ("v2_lite", dict(rope_parameters=YARN_CASES[2])),
    ("v32", dict(rope_parameters=YARN_CASES[1])),
    ("v3", dict(rope_interleave=False)),
])
def test_rope_variants_match_transformers(arch, overrides):
    """Prompts longer than original_max_position_embeddings, so that YaRN's interpolated dims matter."""
    path = cached_checkpoint(arch, seed=4, **overrides)
    model, hf = load_model(path), load_hf(path)
    prompts = random_prompts([70, 41], model.config.vocab_size, seed=31)
    runner = PagedRunner(model, page_size=16)
    rids = [runner.add(p) for p in prompts]
    tokens, logits = runner.greedy(rids, 16)
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logits = hf_greedy(hf, prompt, 16)
        assert tokens[i] == ref_tokens
        assert rel_err(logits[i], ref_logits) < 1e-4
    runner = PagedRunner(model, page_size=16)
    for prompt, lg in zip(prompts, runner.prefill([runner.add(p) for p in prompts])):
        assert rel_err(torch.log_softmax(lg, -1), hf_prompt_logprobs(hf, prompt)) < 1e-4
    assert not math.isclose(model.config.rope.factor, 1.0) or "rope_interleave" in overrides


# config.json of released checkpoints (as published; fields unrelated to the model's math dropped)
_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "v_head_dim": 128, "vocab_size": 129280,
}
_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "bos_token_id": 100000,
    "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 1408,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 102400,
}
_KIMI_K2 = dict(_V3, model_type="kimi_k2", num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
                n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.827, rope_theta=50000.0,
                max_position_embeddings=131072, eos_token_id=163585, vocab_size=163840,
                rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                              "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"})


@pytest.mark.parametrize("hf", [_V3, _V2_LITE, _KIMI_K2], ids=["v3", "v2_lite", "kimi_k2"])
def test_released_configs_read_as_transformers_reads_them(hf):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale
    ours = ModelConfig.from_dict(hf)
    kwargs = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "torch_dtype",
                                                        "quantization_config", "scoring_func", "moe_layer_freq")}
    cls = transformers.DeepseekV2Config if "V2" in hf["architectures"][0] else transformers.DeepseekV3Config
    ref = cls(**kwargs)
    inv_freq, attention_factor = rope_inv_freq(ours.rope, ours.qk_rope_head_dim)
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](ref)
    torch.testing.assert_close(inv_freq, ref_freq, rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(ref_factor, rel=1e-12)
    assert ours.softmax_scale == pytest.approx(yarn_apply_mscale(ref.rope_parameters, ref.qk_head_dim ** -0.5))
    first_dense = hf["first_k_dense_replace"]
    assert ours.mlp_layer_types == ["dense"] * first_dense + ["sparse"] * (hf["num_hidden_layers"] - first_dense)
    assert ours.eos_token_ids == [hf["eos_token_id"]]
    assert ours.q_lora_rank == hf["q_lora_rank"] and ours.num_heads == hf["num_attention_heads"]
    assert ours.fp8_block_size == ((128, 128) if "quantization_config" in hf else None)
    assert (ours.scoring_func, ours.topk_method) == (hf["scoring_func"], hf["topk_method"])
