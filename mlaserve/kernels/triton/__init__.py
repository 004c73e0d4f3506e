"""mlaserve's Triton kernels, one module per op; each is imported on first use."""

import importlib

_MODULES = {"mla_decode": "mla_decode", "sparse_mla": "sparse_mla", "indexer_topk": "indexer"}


def __getattr__(name):
    if name in _MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
