"""The built-in model: a tiny DeepSeek-V3.2-architecture checkpoint made on first use.

`mlaserve serve` with no `--model-path` serves it, so a newcomer sees the whole stack work on a
CPU in one command. It is a real `DeepseekV32ForCausalLM` (MLA, MoE with grouped routing, the DSA
indexer with an `index_topk` smaller than most prompts, so sparse attention really selects), in
the Hugging Face layout that `transformers` and `mlaserve.models.load_model` both load:
config.json, model.safetensors, tokenizer.json, tokenizer_config.json (with a chat template).

The weights are random but deterministic: a seeded generator, drawn in a fixed order, written
with a fixed safetensors header, so two builds give identical bytes. They are drawn with torch
directly rather than by instantiating the transformers model, which keeps the first start fast.
One hidden channel carries a constant (nothing writes into it), and the LM head reads it as a
per-token bias that favours printable ASCII, so the random model's output is readable text.

The tokenizer is byte-level BPE with no merges: 4 DeepSeek special tokens, then the 256 bytes.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

BUILTIN_VERSION = "1"
BUILTIN_MODEL_NAME = "mlaserve-builtin"
SEED = 20250929

SPECIAL_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
BOS_ID, EOS_ID = 0, 1

# DeepSeek-V3's chat template, reduced to what the tiny model needs: system text first,
# then <｜User｜>… / <｜Assistant｜>…<｜end▁of▁sentence｜> turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)

CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "vocab_size": len(SPECIAL_TOKENS) + 256,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "index_n_heads": 16,
    "index_head_dim": 64,
    "index_topk": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": None,
    "initializer_range": 0.02,
    "dtype": "float32",
}

_CONST_CHANNEL = 0      # hidden channel that holds a constant: the LM head's per-token bias input
_CONST_VALUE = 4.0
_LOGIT_SCALE = 4.0      # std of the logits; peaked enough that greedy ties are rare


def default_dir() -> Path:
    """`$MLASERVE_CACHE/builtin-<version>`, else `~/.cache/mlaserve/builtin-<version>` (XDG respected)."""
    root = os.environ.get("MLASERVE_CACHE")
    if root:
        base = Path(root)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlaserve"
    return base / f"builtin-{BUILTIN_VERSION}"


def ensure_builtin_model(path: str | os.PathLike | None = None) -> str:
    """The built-in model's directory, built there first if absent. Safe against concurrent builders:
    each builds into its own temp dir and renames it into place; the loser discards its copy."""
    target = Path(path) if path is not None else default_dir()
    if (target / "config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build_builtin_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return str(target)


def build_builtin_model(out_dir: str | os.PathLike) -> None:
    """Write the checkpoint and tokenizer into `out_dir` (must exist). Deterministic, byte for byte."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2, sort_keys=True) + "\n")
    save_file(make_weights(), str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(out)


def make_weights() -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, float32, named as transformers' save_pretrained names them."""
    c = CONFIG
    gen = torch.Generator().manual_seed(SEED)
    weights: dict[str, torch.Tensor] = {}

    def linear(name: str, out_features: int, in_features: int, gain: float = 1.0) -> None:
        # 1/sqrt(fan_in) keeps every projection's output at unit scale.
        w = torch.randn(out_features, in_features, generator=gen) * (gain / in_features ** 0.5)
        weights[name + ".weight"] = w

    def writes_residual(name: str) -> None:
        # Nothing may write into the constant channel, so it stays constant to the last norm.
        weights[name + ".weight"][_CONST_CHANNEL] = 0.0

    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    qk_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    embed = torch.randn(c["vocab_size"], hidden, generator=gen)
    embed[:, _CONST_CHANNEL] = _CONST_VALUE
    weights["model.embed_tokens.weight"] = embed

    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        weights[f"{p}.input_layernorm.weight"] = torch.ones(hidden)
        weights[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden)
        a = f"{p}.self_attn"
        linear(f"{a}.q_a_proj", c["q_lora_rank"], hidden)
        weights[f"{a}.q_a_layernorm.weight"] = torch.ones(c["q_lora_rank"])
        linear(f"{a}.q_b_proj", heads * qk_head, c["q_lora_rank"])
        linear(f"{a}.kv_a_proj_with_mqa", c["kv_lora_rank"] + c["qk_rope_head_dim"], hidden)
        weights[f"{a}.kv_a_layernorm.weight"] = torch.ones(c["kv_lora_rank"])
        linear(f"{a}.kv_b_proj", heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
        linear(f"{a}.o_proj", hidden, heads * c["v_head_dim"], gain=0.5)
        writes_residual(f"{a}.o_proj")
        x = f"{a}.indexer"
        linear(f"{x}.wq_b", c["index_n_heads"] * c["index_head_dim"], c["q_lora_rank"])
        linear(f"{x}.wk", c["index_head_dim"], hidden)
        weights[f"{x}.k_norm.weight"] = torch.ones(c["index_head_dim"])
        weights[f"{x}.k_norm.bias"] = torch.zeros(c["index_head_dim"])
        linear(f"{x}.weights_proj", c["index_n_heads"], hidden)
        m = f"{p}.mlp"
        if i < c["first_k_dense_replace"]:
            _mlp(linear, writes_residual, m, hidden, c["intermediate_size"])
        else:
            linear(f"{m}.gate", c["n_routed_experts"], hidden)
            weights[f"{m}.gate.e_score_correction_bias"] = torch.zeros(c["n_routed_experts"])
            for e in range(c["n_routed_experts"]):
                _mlp(linear, writes_residual, f"{m}.experts.{e}", hidden, c["moe_intermediate_size"])
            _mlp(linear, writes_residual, f"{m}.shared_experts", hidden,
                 c["moe_intermediate_size"] * c["n_shared_experts"])

    weights["model.norm.weight"] = torch.ones(hidden)
    linear("lm_head", c["vocab_size"], hidden, gain=_LOGIT_SCALE)
    weights["lm_head.weight"][:, _CONST_CHANNEL] = _token_bias() / _CONST_VALUE
    return weights


def _mlp(linear, writes_residual, prefix: str, hidden: int, inter: int) -> None:
    linear(f"{prefix}.gate_proj", inter, hidden)
    linear(f"{prefix}.up_proj", inter, hidden)
    linear(f"{prefix}.down_proj", hidden, inter, gain=0.5)
    writes_residual(f"{prefix}.down_proj")


def _token_bias() -> torch.Tensor:
    """[vocab] logit bias read through the constant channel: lower-case letters and spaces first, capitals next,
    then other printable ASCII; other bytes and the special tokens unlikely; EOS just below the letters, so
    that answers end on their own after some tens of tokens."""
    bias = torch.full((CONFIG["vocab_size"],), -12.0)
    for b in range(32, 127):
        bias[len(SPECIAL_TOKENS) + b] = 10.0 if chr(b).islower() or b == 32 else 7.0 if chr(b).isupper() else 3.0
    bias[len(SPECIAL_TOKENS) + ord("\n")] = 3.0
    bias[EOS_ID] = 9.0
    return bias


def byte_alphabet() -> dict[int, str]:
    """The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, the other bytes
    for the code points from 256 up, in byte order (the mapping every byte-level BPE uses)."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), 256))
    mapping, shifted = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def _write_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b, ch in sorted(byte_alphabet().items()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    bos = SPECIAL_TOKENS[BOS_ID]
    # Plain encoding prepends BOS, as DeepSeek's tokenizer does (add_bos_token).
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, BOS_ID)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[EOS_ID],
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
