"""Loading a HF model directory: config, safetensors weights (single or sharded, FP8 block-quantized), tokenizer.

The model is built on the meta device and materialized once on the target device, so that peak
memory is the model plus one checkpoint tensor. Every tensor the model needs must be in the
checkpoint with its exact shape; a checkpoint tensor the model does not use is an error unless it
is a known extra (MTP layers after the last decoder layer, rotary tables, the indexer weights of
GLM-5's shared-top-k layers, a tied lm_head).
"""

import json
import os
import re

import torch
from safetensors import safe_open

from mlaserve.models.config import ModelConfig
from mlaserve.models.deepseek import DeepseekForCausalLM
from mlaserve.models.parallel import SINGLE, ParallelConfig, shard_tensor

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
# Kept in float32 whatever the model dtype, as transformers keeps them: routing and indexer weights.
_FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")
_SCALE_SUFFIX = "_scale_inv"


def resolve_dtype(dtype: torch.dtype | str, config: ModelConfig) -> torch.dtype:
    """A torch dtype, or "float32"/"bfloat16"/"float16"/"auto" (auto: the checkpoint's torch_dtype, else bfloat16)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"model dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    if dtype == "auto":
        return _DTYPES.get(config.torch_dtype or "bfloat16", torch.bfloat16)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(_DTYPES) + ['auto']}")
    return _DTYPES[dtype]


def load_model(path: str, device: torch.device | str = "cpu", dtype: torch.dtype | str = torch.float32,
               parallel: ParallelConfig = SINGLE) -> DeepseekForCausalLM:
    """The model of HF directory `path`, weights loaded, in eval mode, on `device` in `dtype`.

    `parallel`: load only this tensor-parallel rank's shard (models/parallel.py)."""
    config = ModelConfig.from_pretrained(path)
    dtype = resolve_dtype(dtype, config)
    device = torch.device(device)
    with torch.device("meta"):
        model = DeepseekForCausalLM(config, parallel)
    model.to(dtype)
    for name, module in model.named_modules():
        if name.endswith("mlp.gate") or name.endswith("indexer.weights_proj"):
            module.float()
    model.to_empty(device=device)
    _load_weights(model, path, device)
    model.prepare_weights()
    return model.eval()


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """transformers' AutoTokenizer from the model directory (chat template included)."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e


def checkpoint_index(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from `model.safetensors.index.json` or from every *.safetensors in `path`."""
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path} has no \"weight_map\" object")
        files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not os.path.isfile(file):
                raise ValueError(f"{index_path} names shard {os.path.basename(file)!r}, which is not in {path!r}")
        return files
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not shards:
        raise ValueError(f"no *.safetensors weights in {path!r}")
    files: dict[str, str] = {}
    for shard in shards:
        with safe_open(os.path.join(path, shard), framework="pt") as f:
            for name in f.keys():
                if name in files:
                    raise ValueError(f"tensor {name!r} is in both {os.path.basename(files[name])!r} and {shard!r}")
                files[name] = os.path.join(path, shard)
    return files


def _known_extra(name: str, config: ModelConfig) -> bool:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        layer = int(m.group(1))
        if config.num_layers <= layer < config.num_layers + max(1, config.num_nextn_predict_layers):
            return True   # multi-token-prediction layers: speculative decoding, not run here
        if (config.is_dsa and layer < config.num_layers and config.indexer_types[layer] == "shared"
                and ".self_attn.indexer." in name):
            return True
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return name == "lm_head.weight" and config.tie_word_embeddings


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         name: str = "weight") -> torch.Tensor:
    """DeepSeek block FP8: weight float8_e4m3fn [N, K], scale_inv float32 [ceil(N/b0), ceil(K/b1)] -> float32 [N, K].

    Block (i, j) of the weight is multiplied by scale_inv[i, j]; edge blocks are partial.
    """
    if weight.dim() != 2:
        raise ValueError(f"FP8 tensor {name!r} must be 2-D, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    expected = (-(-n // block[0]), -(-k // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"{name}{_SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}; a {n}x{k} weight in "
                         f"{block[0]}x{block[1]} blocks needs {expected}")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return weight.float() * scale


def _load_weights(model: DeepseekForCausalLM, path: str, device: torch.device) -> None:
    config = model.config
    files = checkpoint_index(path)
    targets = dict(model.named_parameters())
    targets.update(model.named_buffers())
    if config.tie_word_embeddings:
        targets.pop("lm_head.weight", None)
    missing = [name for name in targets if name not in files]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:5]}")
    scales = {name[:-len(_SCALE_SUFFIX)] for name in files if name.endswith(_SCALE_SUFFIX)}
    unexpected = [name for name in files if name not in targets and not _known_extra(name, config)
                  and not (name.endswith(_SCALE_SUFFIX) and name[:-len(_SCALE_SUFFIX)] in targets)]
    if unexpected:
        raise ValueError(f"checkpoint {path!r} holds {len(unexpected)} tensor(s) this {config.architecture} does "
                         f"not use, e.g. {unexpected[:5]}")
    by_file: dict[str, list[str]] = {}
    for name in targets:
        by_file.setdefault(files[name], []).append(name)
    for file, names in sorted(by_file.items()):
        with safe_open(file, framework="pt") as f:
            for name in names:
                tensor = f.get_tensor(name)
                if tensor.dtype == torch.float8_e4m3fn:
                    tensor = _dequantize(f, files, name, tensor, config, device)
                elif name in scales:
                    raise ValueError(f"tensor {name!r} has a {_SCALE_SUFFIX} but is {tensor.dtype}, not float8_e4m3fn")
                tensor = shard_tensor(name, tensor, model.parallel)
                target = targets[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)} in the checkpoint; "
                                     f"the model expects {tuple(target.shape)}")
                with torch.no_grad():
                    target.copy_(tensor.to(device))


def _dequantize(f, files: dict[str, str], name: str, weight: torch.Tensor, config: ModelConfig,
                device: torch.device) -> torch.Tensor:
    if config.fp8_block_size is None:
        raise ValueError(f"tensor {name!r} is float8_e4m3fn but config.json has no fp8 quantization_config")
    scale_name = name + _SCALE_SUFFIX
    if scale_name not in files:
        raise ValueError(f"FP8 tensor {name!r} has no {scale_name!r} in the checkpoint")
    if files[scale_name] == files[name]:
        scale = f.get_tensor(scale_name)
    else:
        with safe_open(files[scale_name], framework="pt") as g:
            scale = g.get_tensor(scale_name)
    return dequantize_fp8_block(weight.to(device), scale.to(device), config.fp8_block_size, name)
