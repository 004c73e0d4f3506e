"""Kernel backends by name, imported lazily so that a missing optional package costs nothing
until it is asked for."""

import importlib
import os
from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass(frozen=True)
class KernelBackend:
    name: str
    module: str          # imported on first use; exposes the op functions it implements
    description: str

    def unavailable_reason(self, device: torch.device) -> str | None:
        """None when this backend can run on `device`, else why not."""
        return _REASONS[self.name](device)

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


def _torch_reason(device: torch.device) -> str | None:
    return None


def _triton_reason(device: torch.device) -> str | None:
    try:
        importlib.import_module("triton")
    except ImportError:
        return "the `triton` package is not installed (pip install triton)"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "needs a CUDA GPU, and torch sees none here"
        major, _ = torch.cuda.get_device_capability(device)
        return None if major >= 8 else f"needs an NVIDIA GPU of compute capability >= 8.0, found {major}.x"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"runs on CUDA tensors (or on the CPU with TRITON_INTERPRET=1), got a {device.type} tensor"


def _cutedsl_reason(device: torch.device) -> str | None:
    need = "a Hopper GPU (compute capability 9.x) and the `nvidia-cutlass-dsl` package"
    # the device first: importing the DSL takes seconds, and a CPU caller needs no import to be told no
    if device.type != "cuda":
        return f"runs on CUDA tensors on {need}; got a {device.type} tensor"
    if not torch.cuda.is_available():
        return f"needs {need}; torch sees no CUDA GPU here"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"needs {need}; found a GPU of compute capability {major}.{minor}"
    try:
        importlib.import_module("cutlass")
    except ImportError as e:
        return f"the `nvidia-cutlass-dsl` package is not installed (pip install nvidia-cutlass-dsl): {e}"
    return None


_REASONS = {"torch": _torch_reason, "triton": _triton_reason, "cutedsl": _cutedsl_reason}

BACKENDS: dict[str, KernelBackend] = {
    "torch": KernelBackend("torch", "mlaserve.kernels.reference", "the reference, fp32 accumulation"),
    "triton": KernelBackend("triton", "mlaserve.kernels.triton", "mlaserve's Triton kernels"),
    "cutedsl": KernelBackend("cutedsl", "mlaserve.kernels.cutedsl", "mlaserve's CuTe DSL kernels (Hopper)"),
}

# backend=None takes the first of these that can run the op on the tensors' device.
PREFERENCE = ("triton", "torch")


def available(op: str, device: torch.device) -> list[str]:
    """Names of the backends that implement `op` and can run on `device`."""
    names = []
    for name, backend in BACKENDS.items():
        if backend.unavailable_reason(device) is None and hasattr(backend.load(), op):
            names.append(name)
    return names


def resolve(op: str, backend: str | None, device: torch.device):
    """The function implementing `op` in `backend` (None: the preferred one that can run here)."""
    if backend is None:
        for name in PREFERENCE:
            if BACKENDS[name].unavailable_reason(device) is None:
                fn = getattr(BACKENDS[name].load(), op, None)
                if fn is not None:
                    return fn
        raise ValueError(f"no backend implements {op} on {device}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} for {op}; known: {sorted(BACKENDS)}; "
                         f"available on {device.type}: {available(op, device)}")
    reason = BACKENDS[backend].unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"backend {backend!r} cannot run {op} here: {reason}; "
                         f"available on {device.type}: {available(op, device)}")
    fn = getattr(BACKENDS[backend].load(), op, None)
    if fn is None:
        raise ValueError(f"backend {backend!r} does not implement {op}; "
                         f"available on {device.type}: {available(op, device)}")
    return fn
