"""The built-in model: deterministic bytes, loadable by transformers, sparse attention really selects."""

import json
import os
from pathlib import Path

import pytest
import torch

from mlaserve.models import builtin


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return builtin.ensure_builtin_model(tmp_path_factory.mktemp("builtin") / "model")


def test_two_builds_are_byte_identical(tmp_path, model_dir):
    other = tmp_path / "again"
    other.mkdir()
    builtin.build_builtin_model(other)
    names = sorted(p.name for p in Path(model_dir).iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in other.iterdir()) == names
    for name in names:
        assert (Path(model_dir) / name).read_bytes() == (other / name).read_bytes(), name


def test_weights_are_seeded_not_constant():
    a, b = builtin.make_weights(), builtin.make_weights()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    w = a["model.layers.1.self_attn.q_b_proj.weight"]
    assert w.std() > 0.01 and not torch.equal(w, a["model.layers.2.self_attn.q_b_proj.weight"])


def test_cache_dir_from_env_and_reuse(tmp_path, monkeypatch):
    monkeypatch.setenv("MLASERVE_CACHE", str(tmp_path))
    path = builtin.ensure_builtin_model()
    assert Path(path) == tmp_path / f"builtin-{builtin.BUILTIN_VERSION}"
    stamp = os.stat(Path(path) / "model.safetensors").st_mtime_ns
    assert builtin.ensure_builtin_model() == path          # second call: no rebuild
    assert os.stat(Path(path) / "model.safetensors").st_mtime_ns == stamp
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp dir left behind"


def test_transformers_loads_every_tensor(model_dir):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "DeepseekV32ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    cfg = model.config
    assert cfg.index_topk < 32 < cfg.max_position_embeddings
    assert cfg.first_k_dense_replace < cfg.num_hidden_layers    # both dense and MoE layers exist


def test_tokenizer_roundtrip_and_chat_template(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id) == (builtin.BOS_ID, builtin.EOS_ID)
    text = "héllo wörld, ünïcode 😀 and\nnew lines"
    ids = tok(text)["input_ids"]
    assert ids[0] == builtin.BOS_ID and len(ids) == 1 + len(text.encode())   # one token per byte
    assert tok.decode(ids, skip_special_tokens=True) == text
    prompt = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hi"}],
                                     add_generation_prompt=True, tokenize=False)
    assert prompt == "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>"
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[:1] == [builtin.BOS_ID] and ids[-1] == tok.convert_tokens_to_ids("<｜Assistant｜>")
    from transformers import PreTrainedTokenizerFast
    fast = PreTrainedTokenizerFast.from_pretrained(model_dir)
    assert fast(text)["input_ids"] == tok(text)["input_ids"] and fast.chat_template == tok.chat_template


def test_greedy_output_is_readable_and_tie_free(model_dir):
    """The constant-channel bias works: the random model writes printable text. The DSA top-k
    (smaller than this prompt) selects, and selects without exact ties (a tie would let top-k's
    tie-breaking, which depends on the row length, change the output with the batch): the cached
    greedy continuation equals the argmax of one uncached forward over the whole sequence."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = "The quick brown fox jumps over the lazy dog, twice over."
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    n = ids.shape[1]
    assert n > 2 * model.config.index_topk
    out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=builtin.EOS_ID)
    text = tok.decode(out[0, n:])
    assert len(text) == 24 and all(32 <= ord(ch) < 127 or ch == "\n" for ch in text), text
    with torch.no_grad():
        logits = model(out).logits[0]
    assert torch.equal(logits[n - 1:-1].argmax(-1), out[0, n:])
