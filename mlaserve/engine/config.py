"""EngineConfig: everything fixed for the life of an Engine (SGLang's server flag names)."""

from dataclasses import dataclass

import torch

from mlaserve.attention import registry
from mlaserve.engine.kv_pool import KV_CACHE_DTYPES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    """model_path: HF-layout model directory (None when a model object is handed to the Engine).
    device: "cpu", "cuda" or "cuda:N"; None = cuda when available, else cpu.
    dtype: activation/weight dtype name, or "auto" (bfloat16 on CUDA, float32 on CPU).
    attention_backend: dense MLA backend; nsa_prefill_backend / nsa_decode_backend: the DSA
        backends for EXTEND / DECODE steps (None = the attention_backend).
    num_pages: KV pool size in pages (page 0 reserved). None: on CUDA, mem_fraction_static of
        the free GPU memory after the model is loaded; on CPU, up to 1 GiB of pages.
    chunked_prefill_size: most prompt tokens per EXTEND step; None or -1 = no chunking.
    context_length: longest sequence (prompt + output); None = the model's max_position_embeddings.
    seed: seeds the generator of requests that bring no seed of their own.
    tp_size: tensor-parallel ranks (engine/tp.py): this process is rank 0, the others are spawned
        worker processes; on CUDA rank r runs on cuda:r (so device must be "cuda" or "cuda:0").
    """
    model_path: str | None = None
    tokenizer_path: str | None = None
    device: str | None = None
    dtype: str = "auto"
    attention_backend: str = "auto"
    nsa_prefill_backend: str | None = None
    nsa_decode_backend: str | None = None
    kv_cache_dtype: str = "auto"
    page_size: int = 64
    mem_fraction_static: float = 0.85
    num_pages: int | None = None
    max_running_requests: int = 256
    chunked_prefill_size: int | None = 8192
    context_length: int | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    tp_size: int = 1

    def __post_init__(self):
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device {self.device!r} is not a torch device: {e}") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but torch sees no CUDA GPU")
        if self.dtype not in (*DTYPES, "auto"):
            raise ValueError(f"dtype must be one of {[*DTYPES, 'auto']}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        # the DSA backends default to the attention backend when it has DSA kernels, else to auto
        dsa_default = self.attention_backend if self.attention_backend in registry.names(dsa=True) else "auto"
        if self.nsa_prefill_backend is None:
            self.nsa_prefill_backend = dsa_default
        if self.nsa_decode_backend is None:
            self.nsa_decode_backend = dsa_default
        _positive_int("page_size", self.page_size)
        _positive_int("max_running_requests", self.max_running_requests)
        if not (isinstance(self.mem_fraction_static, (int, float)) and 0 < self.mem_fraction_static <= 1):
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static!r}")
        if self.num_pages is not None:
            _positive_int("num_pages", self.num_pages)
            if self.num_pages < 2:
                raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}")
        if self.chunked_prefill_size == -1:
            self.chunked_prefill_size = None
        if self.chunked_prefill_size is not None:
            _positive_int("chunked_prefill_size", self.chunked_prefill_size)
        if self.context_length is not None:
            _positive_int("context_length", self.context_length)
        _positive_int("tp_size", self.tp_size)
        if self.tp_size > 1 and device.type == "cuda":
            if device.index not in (None, 0):
                raise ValueError(f"with tp_size {self.tp_size} rank r runs on cuda:r; device must be 'cuda' or "
                                 f"'cuda:0', got {self.device!r}")
            if torch.cuda.device_count() < self.tp_size:
                raise ValueError(f"tp_size {self.tp_size} needs {self.tp_size} GPUs; torch sees "
                                 f"{torch.cuda.device_count()}")
            self.device = "cuda:0"
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
