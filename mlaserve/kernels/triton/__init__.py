"""mlaserve's Triton kernels, one module per op; each is imported on first use."""

import importlib
import sys
import types

_MODULES = {"mla_decode": "mla_decode", "sparse_mla": "sparse_mla", "indexer_topk": "indexer"}


class _OpsPackage(types.ModuleType):
    """Resolves op names to functions on every lookup.

    Importing the submodule `sparse_mla` binds the *module* to this package's attribute of the
    same name, so a plain lazy `__getattr__` would hand out the module from the second lookup on.
    """

    def __getattribute__(self, name):
        if name in _MODULES:
            return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
        return super().__getattribute__(name)


sys.modules[__name__].__class__ = _OpsPackage
