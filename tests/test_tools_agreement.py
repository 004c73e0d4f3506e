"""`mlaserve eval agreement`: torch vs torch is exactly zero; bf16 vs FP8 KV is small, nonzero, reported."""

import json
import math

import pytest

from mlaserve.bench import agreement
from mlaserve.bench.agreement import ConfigRun


@pytest.fixture(scope="module")
def builtin_path(tmp_path_factory):
    from mlaserve.models.builtin import ensure_builtin_model
    return ensure_builtin_model(tmp_path_factory.mktemp("cache") / "builtin")


def test_torch_vs_torch_is_exactly_zero(capsys, builtin_path, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox jumps over the lazy dog.\nOnce upon a time, in a land far away,\n"
                       "def add(a, b):\\n    return\n")
    out = tmp_path / "agree.json"
    rc = agreement.main(["--model-path", builtin_path, "--common", "device=cpu,dtype=float32,page_size=16",
                         "--a", "attention_backend=torch", "--b", "attention_backend=torch,nsa_decode_backend=torch",
                         "--prompts-file", str(prompts), "--max-tokens", "6",
                         "--max-mean-diff", "0", "--max-abs-diff", "0", "--output-file", str(out)])
    report = capsys.readouterr().out
    assert rc == 0, report
    r = json.loads(out.read_text())
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(builtin_path)
    assert len(r["prompts"]) == 3 and tok.decode(r["prompts"][2]).endswith("def add(a, b):\n    return")
    n_prompt = sum(len(p) - 1 for p in r["prompts"])
    assert r["prompt"] == {"n": n_prompt, "mean": 0.0, "max": 0.0}
    assert r["continuation"] == {"n": 3 * 6, "mean": 0.0, "max": 0.0}
    assert r["greedy_agreement"] == 1.0 and r["first_divergence"] == [6, 6, 6]
    assert r["b"]["nsa_decode_backend"] == "torch" and r["a"]["enable_prefix_caching"] is False
    # Decode-time logprobs come from other matmul shapes than the teacher-forced ones: close, not equal.
    assert r["b_decode_vs_a"]["max"] < 1e-4
    assert "Result:                                          PASS" in report
    for label in ("Positions compared:", "Mean |Δ logprob|:", "Max |Δ logprob|:", "First divergence index per prompt:"):
        assert label in report


def test_bf16_vs_fp8_kv_is_small_and_reported(capsys, builtin_path, tmp_path):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from model_factory import build_checkpoint

    # FP8 KV needs DeepSeek's latent dims: kv_lora_rank 512, rope 64. The built-in model's tokenizer has 260 ids.
    ckpt = build_checkpoint(str(tmp_path / "v3"), "v3", seed=0, kv_lora_rank=512, qk_rope_head_dim=64,
                            vocab_size=260, num_hidden_layers=2)
    common = f"device=cpu,dtype=bfloat16,page_size=16,tokenizer_path={builtin_path}"
    out = tmp_path / "fp8.json"
    rc = agreement.main(["--model-path", ckpt, "--common", common, "--a", "kv_cache_dtype=auto",
                         "--b", "kv_cache_dtype=fp8_e4m3", "--num-random-prompts", "3", "--random-prompt-len", "40",
                         "--max-tokens", "6", "--max-abs-diff", "1e-6", "--output-file", str(out)])
    report = capsys.readouterr().out
    print(report)
    r = json.loads(out.read_text())
    assert rc == 1 and "FAIL: max" in report            # FP8 really ran: the tiny threshold trips
    assert r["prompt"]["n"] == 3 * 39 and r["continuation"]["n"] == 3 * 6
    assert 1e-4 < r["all"]["mean"] < 0.3, r["all"]
    # no bound on the max: on a random tiny model one position's |Δ logprob| is a lottery (seeds 0-3 gave
    # 0.25-6.1 nats with the same quantizer, and a 2^-8 change of the scales moved seed 0 from 0.56 to 3.9)
    assert r["all"]["max"] >= r["all"]["mean"] and math.isfinite(r["all"]["max"])
    assert 0.0 <= r["greedy_agreement"] <= 1.0


def test_compare_on_known_runs():
    a = ConfigRun(prompt_logprobs=[[-1.0, -2.0], [-0.5]], continuation=[[5, 6, 7], [1, 2, 3]],
                  decode_logprobs=[[-0.1, -0.2, -0.3], [-1.0, -1.0, -1.0]], scored=[[-0.1, -0.2, -0.3], [-1.0, -1.0, -1.0]])
    b = ConfigRun(prompt_logprobs=[[-1.5, -2.0], [-0.25]], continuation=[[5, 9, 7], [1, 2, 3]],
                  decode_logprobs=[[-0.1, -0.2, -0.4], [-1.0, -1.5, -1.0]], scored=[[-0.1, -0.3, -0.3], [-1.0, -1.0, -1.0]])
    r = agreement.compare(a, b, max_tokens=3)
    assert r["prompt"] == {"n": 3, "mean": pytest.approx(0.25), "max": 0.5}
    assert r["continuation"]["n"] == 6 and r["continuation"]["max"] == pytest.approx(0.1)
    assert r["b_decode_vs_a"]["max"] == pytest.approx(0.5)
    assert r["all"]["mean"] == pytest.approx((0.5 + 0.25 + 0.1) / 9)
    assert r["first_divergence"] == [1, 3] and r["greedy_agreement"] == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match="prompt 0: 2 logprobs vs 1"):
        agreement.abs_diffs([[1.0, 2.0]], [[1.0]])


def test_config_strings():
    assert agreement.parse_config("attention_backend=torch, kv_cache_dtype=fp8_e4m3,page_size=32,"
                                  "enable_prefix_caching=false,num_pages=none,mem_fraction_static=0.5") == {
        "attention_backend": "torch", "kv_cache_dtype": "fp8_e4m3", "page_size": 32,
        "enable_prefix_caching": False, "num_pages": None, "mem_fraction_static": 0.5}
    assert agreement.parse_config("") == {}
    with pytest.raises(ValueError, match="unknown configuration key 'backend'"):
        agreement.parse_config("backend=torch")
    with pytest.raises(ValueError, match="'torch' is not key=value"):
        agreement.parse_config("torch")
    assert agreement.first_divergence([1, 2, 3], [1, 2, 4]) == 2 and agreement.first_divergence([1], [1]) == 1


def test_bad_configuration_is_a_clear_error(capsys, builtin_path):
    rc = agreement.main(["--model-path", builtin_path, "--b", "attention_backend=nonexistent", "--max-tokens", "2"])
    assert rc == 2 and "nonexistent" in capsys.readouterr().err
