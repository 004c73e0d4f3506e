"""mlaserve: a serving engine for Multi-head Latent Attention models.

`from mlaserve import LLM, SamplingParams` is the offline API. The names are resolved
lazily so that `import mlaserve.ops` pulls in no engine or server code.
"""

__version__ = "0.1.0"

_LAZY = {"LLM": "mlaserve.engine.llm", "SamplingParams": "mlaserve.engine.sampling_params"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mlaserve' has no attribute {name!r}")
