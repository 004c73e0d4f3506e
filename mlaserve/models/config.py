"""`ModelConfig`: one typed, validated view of a HF `config.json` for the four MLA architectures.

transformers' configuration classes differ in defaults and in how they spell things
(`rope_scaling` vs `rope_parameters`, `mlp_layer_types` vs `first_k_dense_replace`, GLM-5's
`index_topk_freq`); everything is normalized here once, so that the modules read plain fields.
Where transformers and DeepSeek's own code disagree on a setting no released checkpoint uses,
the config is refused with a `ValueError` rather than run one way silently.
"""

import json
import math
import os
from dataclasses import dataclass, field

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
DSA_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters as transformers' `rope_parameters` holds them (YaRN fields unused for "default")."""
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None   # explicit cos/sin scale; None: derived from mscale/mscale_all_dim
    truncate: bool = True


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor for a context extension of `scale`."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    rope_interleave: bool                 # MLA rope on interleaved pairs (DeepSeek's layout) or on halves
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False          # q_a_proj, kv_a_proj_with_mqa and o_proj carry biases
    mlp_bias: bool = False                # DeepSeek-V2's dense MLPs only
    # -- MoE --
    mlp_layer_types: list[str] = field(default_factory=list)   # per layer: "dense" or "sparse" (MoE)
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    scoring_func: str = "sigmoid"         # "sigmoid" (V3 family, with e_score_correction_bias) or "softmax" (V2)
    topk_method: str = "noaux_tc"         # "noaux_tc" (V3 family), "greedy" or "group_limited_greedy" (V2)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    # -- DSA --
    is_dsa: bool = False
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    indexer_rope_interleave: bool = False  # GLM-5: interleaved; DeepSeek-V3.2: halves
    # per layer: "full" (runs its indexer) or "shared" (reuses the previous layer's top-k)
    indexer_types: list[str] = field(default_factory=list)
    # -- checkpoint --
    num_nextn_predict_layers: int = 0     # MTP layers stored after the last decoder layer (unused here)
    fp8_block_size: tuple[int, int] | None = None   # DeepSeek FP8 block-quantized weights
    torch_dtype: str | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """(nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (as transformers and DeepSeek)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    @staticmethod
    def from_pretrained(path: str) -> "ModelConfig":
        """Reads `<path>/config.json` (and eos ids from `generation_config.json` when present)."""
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"no config.json in {path!r}: expected a HF model directory")
        with open(cfg_path) as f:
            hf = json.load(f)
        gen_path = os.path.join(path, "generation_config.json")
        gen = {}
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
        return ModelConfig.from_dict(hf, gen)

    @staticmethod
    def from_dict(hf: dict, generation_config: dict | None = None) -> "ModelConfig":
        archs = hf.get("architectures") or []
        known = [a for a in archs if a in ARCHITECTURES]
        if not known:
            raise ValueError(f"unknown architecture {archs!r} (config.json \"architectures\"); "
                             f"mlaserve runs {list(ARCHITECTURES)}")
        arch = known[0]
        hf = _with_transformers_defaults(hf, arch)
        is_v2 = arch == "DeepseekV2ForCausalLM"
        is_dsa = arch in DSA_ARCHITECTURES
        num_layers = _req(hf, "num_hidden_layers")
        heads = _req(hf, "num_attention_heads")
        kv_heads = hf.get("num_key_value_heads") or heads
        if kv_heads != heads:
            raise ValueError(f"MLA needs num_key_value_heads == num_attention_heads, got {kv_heads} and {heads}")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (DeepSeek models use 'silu')")
        if hf.get("moe_layer_freq", 1) != 1:
            # DeepSeek's code alternates MoE layers by this frequency; transformers ignores it.
            raise ValueError(f"moe_layer_freq={hf['moe_layer_freq']} is not supported (only 1)")

        # -- MoE --
        n_experts = hf.get("n_routed_experts") or 0
        if is_dsa and hf.get("mlp_layer_types"):
            mlp_types = list(hf["mlp_layer_types"])
        else:
            first_dense = hf.get("first_k_dense_replace", 0 if is_v2 else 3) or 0
            mlp_types = ["dense" if i < first_dense else "sparse" for i in range(num_layers)]
        if len(mlp_types) != num_layers or set(mlp_types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must be {num_layers} entries of 'dense'/'sparse', got {mlp_types}")
        if not n_experts:
            mlp_types = ["dense"] * num_layers
        if is_v2:
            scoring, topk_method = "softmax", hf.get("topk_method") or "greedy"
            if topk_method not in ("greedy", "group_limited_greedy"):
                raise ValueError(f"DeepseekV2 topk_method {topk_method!r} is not supported "
                                 f"(greedy, group_limited_greedy)")
            if hf.get("norm_topk_prob"):
                # transformers ignores it for V2 while DeepSeek's code normalizes instead of scaling;
                # no released V2 checkpoint sets it, so refuse rather than guess.
                raise ValueError("DeepseekV2 with norm_topk_prob=true is not supported")
        else:
            scoring, topk_method = "sigmoid", "noaux_tc"
        if hf.get("scoring_func", scoring) != scoring:
            raise ValueError(f"{arch} scores experts with {scoring}; config.json asks scoring_func="
                             f"{hf['scoring_func']!r}")
        if "topk_method" in hf and not is_v2 and hf["topk_method"] != "noaux_tc":
            raise ValueError(f"{arch} routes with noaux_tc; config.json asks topk_method={hf['topk_method']!r}")
        n_group = hf.get("n_group") or 1
        topk_group = hf.get("topk_group") or 1
        top_k = hf.get("num_experts_per_tok") or 0
        if n_experts:
            if n_experts % n_group:
                raise ValueError(f"n_routed_experts={n_experts} must divide into n_group={n_group} groups")
            if not 1 <= top_k <= n_experts or not 1 <= topk_group <= n_group:
                raise ValueError(f"need 1 <= num_experts_per_tok ({top_k}) <= n_routed_experts ({n_experts}) and "
                                 f"1 <= topk_group ({topk_group}) <= n_group ({n_group})")
            if topk_method == "noaux_tc" and n_experts // n_group < 2:
                raise ValueError(f"noaux_tc routing scores groups by their top 2 experts; "
                                 f"{n_experts} experts in {n_group} groups leaves fewer than 2 per group")

        # -- attention --
        q_lora_rank = hf.get("q_lora_rank")
        if is_dsa and not q_lora_rank:
            raise ValueError(f"{arch} needs q_lora_rank (the DSA indexer reads the q latent), got {q_lora_rank!r}")
        rope_dim = _req(hf, "qk_rope_head_dim")
        if rope_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {rope_dim}")
        index_types: list[str] = []
        if is_dsa:
            index_head_dim = _req(hf, "index_head_dim")
            if index_head_dim < rope_dim:
                raise ValueError(f"index_head_dim {index_head_dim} must be >= qk_rope_head_dim {rope_dim}")
            index_types = _indexer_types(hf, num_layers) if arch == "GlmMoeDsaForCausalLM" else ["full"] * num_layers
        max_pos = hf.get("max_position_embeddings", 4096)
        rope = _rope_config(hf, max_pos)
        fp8_block = None
        quant = hf.get("quantization_config")
        if quant:
            if quant.get("quant_method") != "fp8":
                raise ValueError(f"quantization_config.quant_method {quant.get('quant_method')!r} is not supported "
                                 f"(only DeepSeek's block 'fp8')")
            block = quant.get("weight_block_size")
            if not block or len(block) != 2:
                raise ValueError(f"fp8 quantization_config needs weight_block_size [rows, cols], got {block!r}")
            fp8_block = (int(block[0]), int(block[1]))

        return ModelConfig(
            architecture=arch,
            vocab_size=_req(hf, "vocab_size"),
            hidden_size=_req(hf, "hidden_size"),
            intermediate_size=_req(hf, "intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            q_lora_rank=q_lora_rank or None,
            kv_lora_rank=_req(hf, "kv_lora_rank"),
            qk_nope_head_dim=_req(hf, "qk_nope_head_dim"),
            qk_rope_head_dim=rope_dim,
            v_head_dim=_req(hf, "v_head_dim"),
            max_position_embeddings=max_pos,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=rope,
            # V2 rotates interleaved pairs always; V3.2 and GLM-5 do in MLA; V3 as configured.
            rope_interleave=bool(hf.get("rope_interleave", True)) if arch == "DeepseekV3ForCausalLM" else True,
            eos_token_ids=_eos_ids(hf, generation_config or {}),
            bos_token_id=hf.get("bos_token_id"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)) if is_v2 else False,
            mlp_layer_types=mlp_types,
            moe_intermediate_size=hf.get("moe_intermediate_size") or 0,
            n_routed_experts=n_experts,
            n_shared_experts=hf.get("n_shared_experts") or 0,
            num_experts_per_tok=top_k,
            scoring_func=scoring,
            topk_method=topk_method,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)) and not is_v2,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            is_dsa=is_dsa,
            index_n_heads=hf.get("index_n_heads", 0) if is_dsa else 0,
            index_head_dim=hf.get("index_head_dim", 0) if is_dsa else 0,
            index_topk=hf.get("index_topk", 0) if is_dsa else 0,
            indexer_rope_interleave=arch == "GlmMoeDsaForCausalLM",
            indexer_types=index_types,
            num_nextn_predict_layers=hf.get("num_nextn_predict_layers", 0) or 0,
            fp8_block_size=fp8_block,
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
        )


# Keys whose absence from config.json transformers fills with its config class's defaults; mlaserve
# takes the same values so that a sparse config.json means the same model in both.
_DEFAULTED_KEYS = ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "n_shared_experts",
                   "max_position_embeddings", "rms_norm_eps", "index_n_heads", "index_topk", "index_head_dim",
                   "first_k_dense_replace", "num_experts_per_tok", "n_routed_experts", "moe_intermediate_size",
                   "topk_method")
_MODEL_TYPES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                "DeepseekV32ForCausalLM": "deepseek_v32", "GlmMoeDsaForCausalLM": "glm_moe_dsa"}


def _with_transformers_defaults(hf: dict, arch: str) -> dict:
    """config.json with transformers' defaults for the _DEFAULTED_KEYS it leaves out."""
    from transformers import CONFIG_MAPPING
    defaults = CONFIG_MAPPING[_MODEL_TYPES[arch]]().to_dict()
    filled = {k: defaults[k] for k in _DEFAULTED_KEYS if k not in hf and defaults.get(k) is not None}
    return {**hf, **filled}


def _req(hf: dict, key: str):
    if hf.get(key) is None:
        raise ValueError(f"config.json lacks {key!r}")
    return hf[key]


def _rope_config(hf: dict, max_pos: int) -> RopeConfig:
    """transformers >= 5 writes `rope_parameters`; released checkpoints write `rope_scaling` + `rope_theta`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; mlaserve runs {list(ROPE_TYPES)}")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    orig = params.get("original_max_position_embeddings") or max_pos
    factor = params.get("factor")
    if factor is None:
        factor = max_pos / orig
    return RopeConfig(
        theta=float(theta), rope_type=rope_type, factor=float(factor), original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))


def _indexer_types(hf: dict, num_layers: int) -> list[str]:
    """GLM-5's per-layer indexer mode, derived as transformers' GlmMoeDsaConfig does."""
    types = hf.get("indexer_types")
    if types is None:
        pattern = hf.get("index_topk_pattern")
        if pattern is not None:
            types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq = max(hf.get("index_topk_freq", 1), 1)
            offset = hf.get("index_skip_topk_offset", 2)
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    types = list(types)
    if len(types) != num_layers or set(types) - {"full", "shared"} or (types and types[0] != "full"):
        raise ValueError(f"indexer_types must be {num_layers} entries of 'full'/'shared' starting with 'full', "
                         f"got {types}")
    return types


def _eos_ids(hf: dict, gen: dict) -> list[int]:
    ids: list[int] = []
    for source in (hf.get("eos_token_id"), gen.get("eos_token_id")):
        for i in (source if isinstance(source, list) else [source]):
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids
