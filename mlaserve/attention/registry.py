"""Attention backends by name (`--attention-backend`, `--nsa-prefill-backend`, `--nsa-decode-backend`).

Backends are imported lazily: a missing optional library costs nothing until its
backend is asked for, and then stops start-up with a message that says why and what
would run here. Never a silent fallback.
"""

import importlib

import torch

from mlaserve.attention.base import AttentionBackend, BackendConfig

# name -> (module, class). Each class may define `unavailable_reason(config) -> str | None`.
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("mlaserve.attention.torch_backend", "TorchBackend"),
    "triton": ("mlaserve.attention.triton_backend", "TritonBackend"),
    "flashinfer": ("mlaserve.attention.flashinfer_backend", "FlashInferBackend"),
}


def register(name: str, module: str, cls: str) -> None:
    _BACKENDS[name] = (module, cls)


def names() -> list[str]:
    return sorted(_BACKENDS) + ["auto"]


def _load(name: str):
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def unavailable_reason(name: str, config: BackendConfig) -> str | None:
    """None when backend `name` can run with `config`, else the reason it cannot."""
    if name not in _BACKENDS:
        return f"unknown attention backend {name!r}; choose from {names()}"
    try:
        cls = _load(name)
    except ImportError as e:
        return f"cannot import backend {name!r}: {e}"
    check = getattr(cls, "unavailable_reason", None)
    return check(config) if check is not None else None


def available(config: BackendConfig) -> list[str]:
    return [n for n in sorted(_BACKENDS) if unavailable_reason(n, config) is None]


# "auto" prefers these, in order, when nothing measured says otherwise.
_AUTO_ORDER = ("triton", "torch")


def create(name: str, config: BackendConfig, **kwargs) -> AttentionBackend:
    """Build backend `name` for `config`; "auto" picks the first capable one of _AUTO_ORDER."""
    if name == "auto":
        for candidate in _AUTO_ORDER:
            # on the CPU triton runs through its interpreter, which is for tests: never the fastest
            if candidate == "triton" and torch.device(config.device).type == "cpu":
                continue
            if candidate in _BACKENDS and unavailable_reason(candidate, config) is None:
                return _load(candidate)(config, **kwargs)
        raise ValueError(f"no attention backend can run here; tried {list(_AUTO_ORDER)}")
    reason = unavailable_reason(name, config)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} cannot run here: {reason}. "
                         f"Available here: {available(config)}")
    return _load(name)(config, **kwargs)
