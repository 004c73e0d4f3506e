"""`mlaserve eval agreement` on the GPU: backend swaps and FP8 KV on a tiny DeepSeek-V3.2 (DSA) model
with DeepSeek's latent dims (kv_lora_rank 512, rope 64), bf16. The bounds are loose (a random tiny
model amplifies rounding); the printed reports are the measurement."""

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from model_factory import build_checkpoint

    from mlaserve.models.builtin import ensure_builtin_model
    root = tmp_path_factory.mktemp("agreement")
    tokenizer = ensure_builtin_model(root / "builtin")
    ckpt = build_checkpoint(str(root / "v32"), "v32", seed=0, kv_lora_rank=512, qk_rope_head_dim=64,
                            index_head_dim=128, vocab_size=260, num_hidden_layers=2)
    return ckpt, tokenizer


@pytest.mark.parametrize("a,b,max_mean", [
    ("attention_backend=torch", "attention_backend=triton", 0.1),
    ("attention_backend=torch", "attention_backend=torch,kv_cache_dtype=fp8_e4m3", 0.3),
    ("attention_backend=triton", "attention_backend=triton,kv_cache_dtype=fp8_e4m3", 0.3),
])
def test_agreement_on_gpu(capsys, model, tmp_path, a, b, max_mean):
    from mlaserve.attention import registry
    from mlaserve.bench import agreement

    if "triton" in a + b and "triton" not in registry.names():
        pytest.skip("no triton backend registered")
    ckpt, tokenizer = model
    out = tmp_path / "agree.json"
    rc = agreement.main(["--model-path", ckpt, "--common", f"device=cuda,dtype=bfloat16,tokenizer_path={tokenizer}",
                         "--a", a, "--b", b, "--num-random-prompts", "8", "--random-prompt-len", "200",
                         "--max-tokens", "16", "--max-mean-diff", str(max_mean), "--output-file", str(out)])
    report = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + report)
    r = json.loads(out.read_text())
    assert rc == 0, report
    assert r["prompt"]["n"] == 8 * 199 and r["continuation"]["n"] == 8 * 16
