"""Checkpoint loading: FP8 block-quantized and sharded checkpoints, dtypes, the tokenizer, every ValueError."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_factory import cached_checkpoint, random_prompts, rel_err
from model_harness import PagedRunner
from mlaserve.models import ModelConfig, load_model, load_tokenizer
from mlaserve.models.loader import dequantize_fp8_block

# Non-square blocks that do not divide the tiny dims, so that edge blocks are partial.
BLOCK = (16, 24)
E4M3_MAX = 448.0


def _copy(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: str, **changes) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def _quantizable(name: str, t: torch.Tensor) -> bool:
    """The Linear weights DeepSeek ships in FP8 (not embeddings, norms, the router or the indexer's weights_proj)."""
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "weights_proj")
    return t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in skip)


def _quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w float32 [N, K] -> (float8 [N, K], scale_inv float32 [nb, kb], dequantized float32 [N, K]), block by block."""
    n, k = w.shape
    nb, kb = -(-n // BLOCK[0]), -(-k // BLOCK[1])
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(nb, kb)
    deq = torch.empty(n, k)
    for i in range(nb):
        for j in range(kb):
            rows, cols = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
            s = w[rows, cols].abs().max() / E4M3_MAX
            scale_inv[i, j] = s
            q[rows, cols] = (w[rows, cols] / s).to(torch.float8_e4m3fn)
            deq[rows, cols] = q[rows, cols].float() * s
    return q, scale_inv, deq


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    """(FP8 checkpoint sharded in two files with an MTP layer, the same weights dequantized in a float32 checkpoint)."""
    src = cached_checkpoint("v32", seed=7)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    fp8, deq = {}, {}
    for name, t in tensors.items():
        if _quantizable(name, t):
            fp8[name], fp8[name + "_scale_inv"], deq[name] = _quantize_blocks(t)
        else:
            fp8[name] = deq[name] = t
    num_layers = json.load(open(os.path.join(src, "config.json")))["num_hidden_layers"]
    mtp = f"model.layers.{num_layers}.self_attn.q_a_proj.weight"   # DeepSeek's MTP layer: a known extra
    fp8[mtp], fp8[mtp + "_scale_inv"], _ = _quantize_blocks(torch.randn(48, 64))

    fp8_dir = _copy(src, tmp_path_factory.mktemp("fp8") / "ckpt")
    os.remove(os.path.join(fp8_dir, "model.safetensors"))
    names = sorted(fp8)
    # weights in one shard and their scales in the other: the loader must look across shards
    shards = {"model-00001-of-00002.safetensors": [n for n in names if not n.endswith("_scale_inv")],
              "model-00002-of-00002.safetensors": [n for n in names if n.endswith("_scale_inv")]}
    for file, members in shards.items():
        save_file({n: fp8[n].contiguous() for n in members}, os.path.join(fp8_dir, file))
    with open(os.path.join(fp8_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: file for file, ms in shards.items() for n in ms}}, f)
    _edit_config(fp8_dir, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                               "weight_block_size": list(BLOCK)})
    deq_dir = _copy(src, tmp_path_factory.mktemp("deq") / "ckpt")
    save_file(deq, os.path.join(deq_dir, "model.safetensors"))
    assert any(t.dtype == torch.float8_e4m3fn for t in fp8.values())
    return fp8_dir, deq_dir


def test_fp8_block_checkpoint_loads_as_its_dequantized_weights(fp8_pair):
    fp8_dir, deq_dir = fp8_pair
    fp8_model, deq_model = load_model(fp8_dir), load_model(deq_dir)
    deq_state = deq_model.state_dict()
    for name, t in fp8_model.state_dict().items():
        torch.testing.assert_close(t, deq_state[name], rtol=0, atol=0, msg=name)
    prompts = random_prompts([19, 30], fp8_model.config.vocab_size, seed=51)
    logits = {}
    for key, model in (("fp8", fp8_model), ("deq", deq_model)):
        runner = PagedRunner(model, page_size=8)
        logits[key] = torch.cat(runner.prefill([runner.add(p) for p in prompts]))
    assert rel_err(logits["fp8"], logits["deq"]) < 1e-6


@pytest.mark.parametrize("block", [(128, 128), BLOCK])
def test_dequantize_fp8_block_scales_each_block(block):
    n, k = 300, 200
    w = torch.randn(n, k).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1])) + 0.5
    out = dequantize_fp8_block(w, scale, block)
    for i, j in [(0, 0), (n - 1, k - 1), (block[0], block[1] - 1), (n - 1, 0)]:
        assert out[i, j] == w[i, j].float() * scale[i // block[0], j // block[1]]
    with pytest.raises(ValueError, match=r"needs \(\d+, \d+\)"):
        dequantize_fp8_block(w, scale[:, :-1], block)


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single = cached_checkpoint("glm5", seed=8)
    sharded = cached_checkpoint("glm5", seed=8, max_shard_size="40KB")
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 2
    a, b = load_model(single).state_dict(), load_model(sharded).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_bfloat16_keeps_routing_and_indexer_weights_in_float32():
    path = cached_checkpoint("v32")
    model = load_model(path, dtype="bfloat16")
    state = model.state_dict()
    assert state["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert state["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert state["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.float32
    assert state["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16
    assert load_model(path, dtype="auto").dtype == torch.float32   # the checkpoint's own dtype
    prompts = random_prompts([20, 9], model.config.vocab_size, seed=52)
    runner = PagedRunner(model, page_size=8)
    bf16 = torch.cat(runner.prefill([runner.add(p) for p in prompts]))
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16).all()


def test_interface_values():
    model = load_model(cached_checkpoint("glm5"))
    cfg = model.config
    assert model.kv_pool_spec() == dict(num_layers=3, kv_lora_rank=32, rope_dim=16, index_head_dim=32)
    bc = model.backend_config("auto", "cpu")
    assert (bc.num_heads, bc.kv_lora_rank, bc.qk_rope_head_dim, bc.index_topk) == (4, 32, 16, 8)
    assert bc.dtype == torch.float32 and bc.device == torch.device("cpu")
    assert cfg.is_dsa and cfg.indexer_types == ["full", "shared", "full"]
    assert model.model.layers[1].self_attn.indexer is None
    assert cfg.eos_token_ids == [1] and cfg.architecture == "GlmMoeDsaForCausalLM"
    dense = load_model(cached_checkpoint("v2_lite"))
    assert dense.kv_pool_spec()["index_head_dim"] is None and dense.backend_config("auto", "cpu").index_topk is None
    assert not model.training
    moe = model.model.layers[2].mlp   # the experts' parameters are views of the stacked weights
    assert moe.experts[3].up_proj.weight.untyped_storage().data_ptr() == moe.gate_up.untyped_storage().data_ptr()
    assert torch.equal(moe.down[5], moe.experts[5].down_proj.weight)


def test_load_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>",
                            chat_template=template).save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded("hello world")["input_ids"] == [2, 3]
    assert loaded.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False) == "hello "
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path / "nowhere"))


# -- every ValueError --

@pytest.fixture
def ckpt(tmp_path):
    return _copy(cached_checkpoint("v3"), tmp_path / "ckpt")


def _rewrite_tensors(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_missing_config_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(tmp_path))


def test_unknown_architecture_is_an_error(ckpt):
    _edit_config(ckpt, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="unknown architecture.*LlamaForCausalLM"):
        load_model(ckpt)


def test_missing_tensor_is_an_error(ckpt):
    _rewrite_tensors(ckpt, lambda t: t.pop("model.layers.2.self_attn.kv_b_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.2\.self_attn\.kv_b_proj\.weight"):
        load_model(ckpt)


def test_wrong_shape_is_an_error(ckpt):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _rewrite_tensors(ckpt, lambda t: t.__setitem__(name, torch.zeros(31, 64)))
    with pytest.raises(ValueError, match=rf"{name}.*\(31, 64\).*expects \(32, 64\)"):
        load_model(ckpt)


def test_unknown_extra_tensor_is_an_error(ckpt):
    _rewrite_tensors(ckpt, lambda t: t.__setitem__("model.layers.0.self_attn.extra.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match=r"does not use.*self_attn\.extra\.weight"):
        load_model(ckpt)


def test_missing_weights_and_missing_shard_are_errors(ckpt):
    os.remove(os.path.join(ckpt, "model.safetensors"))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(ckpt)
    with open(os.path.join(ckpt, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}}, f)
    with pytest.raises(ValueError, match="model-00001-of-00001.safetensors"):
        load_model(ckpt)


def test_fp8_errors(ckpt):
    name = "model.layers.0.self_attn.q_a_proj.weight"
    _rewrite_tensors(ckpt, lambda t: t.__setitem__(name, t[name].to(torch.float8_e4m3fn)))
    with pytest.raises(ValueError, match=f"{name}.*no fp8 quantization_config"):
        load_model(ckpt)
    _edit_config(ckpt, quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})
    with pytest.raises(ValueError, match=f"{name}.*has no.*_scale_inv"):
        load_model(ckpt)
    _rewrite_tensors(ckpt, lambda t: t.__setitem__(name + "_scale_inv", torch.ones(5, 4)))
    with pytest.raises(ValueError, match=r"_scale_inv has shape \(5, 4\).*needs \(3, 4\)"):
        load_model(ckpt)
    _edit_config(ckpt, quantization_config={"quant_method": "awq"})
    with pytest.raises(ValueError, match="quant_method 'awq'"):
        load_model(ckpt)


def test_bad_dtype_is_an_error(ckpt):
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        load_model(ckpt, dtype="int8")
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        load_model(ckpt, dtype=torch.float64)


@pytest.mark.parametrize("changes,message", [
    (dict(architectures=["DeepseekV2ForCausalLM"], norm_topk_prob=True), "norm_topk_prob"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(topk_method="greedy"), "topk_method='greedy'"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope type 'longrope'"),
    (dict(kv_lora_rank=None), "lacks 'kv_lora_rank'"),
    (dict(num_key_value_heads=2), "num_key_value_heads == num_attention_heads"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(n_group=3), "n_group=3"),
    (dict(architectures=["DeepseekV32ForCausalLM"], q_lora_rank=None, index_head_dim=32), "needs q_lora_rank"),
    (dict(architectures=["GlmMoeDsaForCausalLM"], index_head_dim=32, index_topk=8, index_n_heads=4,
          indexer_types=["shared", "full", "full"]), "indexer_types"),
])
def test_config_errors(changes, message):
    with open(os.path.join(cached_checkpoint("v3"), "config.json")) as f:
        hf = json.load(f)
    hf.update(changes)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(hf)


def test_config_readings():
    with open(os.path.join(cached_checkpoint("v3"), "config.json")) as f:
        hf = json.load(f)
    cfg = ModelConfig.from_dict(dict(hf, eos_token_id=[1, 7]), {"eos_token_id": [7, 9]})
    assert cfg.eos_token_ids == [1, 7, 9]
    glm = dict(hf, architectures=["GlmMoeDsaForCausalLM"], index_head_dim=32, index_topk=8, index_n_heads=4,
               num_hidden_layers=6)
    from transformers import GlmMoeDsaConfig
    for extra in (dict(index_topk_freq=2, index_skip_topk_offset=2), dict(index_topk_freq=3, index_skip_topk_offset=1),
                  dict(index_topk_pattern="FFSFSS")):
        ours = ModelConfig.from_dict(dict(glm, **extra)).indexer_types
        assert ours == GlmMoeDsaConfig(num_hidden_layers=6, **extra).indexer_types
        assert "shared" in ours
    assert ModelConfig.from_dict(dict(hf, first_k_dense_replace=2)).mlp_layer_types == ["dense", "dense", "sparse"]


def test_tied_word_embeddings_match_transformers():
    from model_factory import hf_prompt_logprobs, load_hf
    path = cached_checkpoint("v3", seed=9, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(os.path.join(path, "model.safetensors"))
    model, hf = load_model(path), load_hf(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    prompts = random_prompts([15, 26], model.config.vocab_size, seed=53)
    runner = PagedRunner(model, page_size=8)
    for prompt, logits in zip(prompts, runner.prefill([runner.add(p) for p in prompts])):
        assert rel_err(torch.log_softmax(logits, -1), hf_prompt_logprobs(hf, prompt)) < 1e-4


@pytest.mark.parametrize("arch,model_type", [("DeepseekV3ForCausalLM", "deepseek_v3"),
                                             ("DeepseekV32ForCausalLM", "deepseek_v32"),
                                             ("GlmMoeDsaForCausalLM", "glm_moe_dsa")])
def test_missing_keys_take_transformers_defaults(arch, model_type):
    """A config.json that leaves keys out means the same model to mlaserve as to transformers."""
    from transformers import CONFIG_MAPPING
    dims = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                kv_lora_rank=32, q_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    ours = ModelConfig.from_dict({"architectures": [arch], **dims})
    theirs = CONFIG_MAPPING[model_type](**dims)
    for name in ("max_position_embeddings", "rms_norm_eps", "routed_scaling_factor", "norm_topk_prob",
                 "n_shared_experts", "n_group", "topk_group", "n_routed_experts",
                 "num_experts_per_tok", "index_topk", "index_n_heads"):
        want = getattr(theirs, name, None)
        if want is not None:
            assert getattr(ours, name) == want, (name, getattr(ours, name), want)
    # first_k_dense_replace (3 by default) decides which layers are dense
    dense = [t == "dense" for t in ours.mlp_layer_types]
    assert dense == [i < theirs.first_k_dense_replace for i in range(2)], ours.mlp_layer_types
