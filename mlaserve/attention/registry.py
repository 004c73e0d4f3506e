"""Attention backends by name (`--attention-backend`, `--nsa-prefill-backend`, `--nsa-decode-backend`).

Backends are imported lazily: a missing optional library costs nothing until its
backend is asked for, and then stops start-up with a message that says why and what
would run here. Never a silent fallback.
"""

import importlib

import torch

from mlaserve.attention.base import AttentionBackend, BackendConfig

# name -> (module, class, has DSA kernels). Each class may define `unavailable_reason(config) -> str | None`.
# Only backends with DSA kernels (indexer + sparse MLA) are choices for --nsa-*-backend.
_BACKENDS: dict[str, tuple[str, str, bool]] = {
    "torch": ("mlaserve.attention.torch_backend", "TorchBackend", True),
    "triton": ("mlaserve.attention.triton_backend", "TritonBackend", True),
    "flashinfer": ("mlaserve.attention.flashinfer_backend", "FlashInferBackend", False),
    "cutedsl_mla": ("mlaserve.attention.cutedsl_backend", "CuteDSLBackend", True),
}


def register(name: str, module: str, cls: str, dsa: bool = False) -> None:
    _BACKENDS[name] = (module, cls, dsa)


def names(dsa: bool = False) -> list[str]:
    """Backend names for the flags ("auto" last); with dsa=True only those with DSA kernels."""
    return sorted(n for n, (_, _, has_dsa) in _BACKENDS.items() if has_dsa or not dsa) + ["auto"]


def _load(name: str):
    module, cls, _ = _BACKENDS[name]
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


# "auto"'s primary backend: the first of these that runs here (auto_backend.py says why, from measurements).
_AUTO_ORDER = ("cutedsl_mla", "triton", "torch")
# Its DECODE peers in order of preference; those that run here with the config and have a rule against the
# primary (auto_backend.DECODE_RULES) are used.
_AUTO_DECODE_PEERS = ("flashinfer", "cutedsl_mla", "triton")


def _create_auto(config: BackendConfig, dsa: bool, **kwargs) -> AttentionBackend:
    from mlaserve.attention.auto_backend import DECODE_RULES, AutoBackend
    primary = None
    for candidate in _AUTO_ORDER:
        # on the CPU triton runs through its interpreter, which is for tests: never the fastest
        if candidate in ("triton", "cutedsl_mla") and torch.device(config.device).type == "cpu":
            continue
        if unavailable_reason(candidate, config) is None:
            primary = _load(candidate)(config, **kwargs)
            break
    if primary is None:
        raise ValueError(f"no attention backend can run here; tried {list(_AUTO_ORDER)}")
    peers = ()
    if not dsa:
        rules = DECODE_RULES.get(primary.name, {})
        peers = tuple(_load(name)(config) for name in _AUTO_DECODE_PEERS
                      if name in rules and unavailable_reason(name, config) is None)
    return AutoBackend(config, primary, peers)


def create(name: str, config: BackendConfig, dsa: bool = False, **kwargs) -> AttentionBackend:
    """Build backend `name` for `config` (dsa=True: for DSA layers); "auto" picks the first capable one
    of _AUTO_ORDER."""
    if dsa and name not in names(dsa=True):
        raise ValueError(f"attention backend {name!r} has no DSA (indexer + sparse MLA) kernels; "
                         f"for --nsa-*-backend choose from {names(dsa=True)}")
    if name == "auto":
        return _create_auto(config, dsa, **kwargs)
    reason = unavailable_reason(name, config)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} cannot run here: {reason}. "
                         f"Available here: {available(config)}")
    return _load(name)(config, **kwargs)
