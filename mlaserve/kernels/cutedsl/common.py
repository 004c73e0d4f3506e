"""Host-side pieces the CuTe DSL kernels share. The DSL is imported on first use, never at module import,
so that checks and plans work without it."""

import importlib

import torch

# The address given to pointers when compiling: only a pointer's type and assumed alignment reach the code.
COMPILE_ADDRESS = 1 << 20


def cute_dtype(dtype: torch.dtype):
    """bf16/fp16 torch dtype -> the DSL's numeric type."""
    cutlass = importlib.import_module("cutlass")
    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]


def gmem_pointers(kinds, addresses) -> list:
    """Global-memory pointers: kinds[i] = (DSL numeric type, assumed alignment in bytes) of pointer i,
    addresses[i] its address (None: COMPILE_ADDRESS, for compiling)."""
    cute = importlib.import_module("cutlass.cute")
    runtime = importlib.import_module("cutlass.cute.runtime")
    return [runtime.make_ptr(t, COMPILE_ADDRESS if a is None else a, cute.AddressSpace.gmem, assumed_align=align)
            for (t, align), a in zip(kinds, addresses, strict=True)]
