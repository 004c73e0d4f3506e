"""mlaserve's CuTe DSL kernels for Hopper (`nvidia-cutlass-dsl`), one module per op, imported on first use.

Checks and planning import without the DSL installed; the DSL itself is imported on the first launch.
"""

import importlib
import sys
import types

_MODULES = {"mla_decode": "mla_decode", "sparse_mla": "sparse_mla"}


class _OpsPackage(types.ModuleType):
    """Resolves op names to functions on every lookup (a submodule named like its op would shadow it)."""

    def __getattribute__(self, name):
        if name in _MODULES:
            return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
        return super().__getattribute__(name)


sys.modules[__name__].__class__ = _OpsPackage
