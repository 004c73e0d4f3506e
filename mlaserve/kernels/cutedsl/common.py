"""Host-side pieces the CuTe DSL kernels share. The DSL is imported on first use, never at module import,
so that checks and plans work without it."""

import importlib

import torch

# The address given to pointers when compiling: only a pointer's type and assumed alignment reach the code.
COMPILE_ADDRESS = 1 << 20
REGISTER_FILE = 65536   # 32-bit registers an SM has; ptxas allocates them 8 a thread at a time


D_QK = 576              # q's and a cached token's width: the latent (512) and the rope part (64)
HEAD_DIM_V = 512        # the output's width: the latent


def check_query(kernel: str, q_shape, q_dtype: torch.dtype, head_dim_v: int) -> None:
    """Raise ValueError naming the values unless q is bf16/fp16 [b, s_q, h, D_QK] and head_dim_v is HEAD_DIM_V
    (`kernel` names the caller in the message)."""
    if q_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the {kernel} takes bf16/fp16 q, got {q_dtype}")
    if len(q_shape) != 4 or q_shape[3] != D_QK or head_dim_v != HEAD_DIM_V:
        raise ValueError(f"the {kernel} needs q [b, s_q, h, {D_QK}] and head_dim_v {HEAD_DIM_V}, "
                         f"got q shape {tuple(q_shape)} and head_dim_v {head_dim_v}")


def register_split_fits(*groups: tuple[int, int]) -> bool:
    """Whether a warp-specialized kernel's setmaxnreg split -- (threads, registers a thread) per role -- fits the
    CTA's launch allocation: its threads x the most registers a thread can have at launch (65536 / threads, at
    most 255, rounded down to 8: 168 at 384 threads). The roles only trade registers within that allocation; a
    split that asks more (128 x 112 + 256 x 200 = 65536 against 384 x 168 = 64512) leaves setmaxnreg.inc waiting
    forever."""
    threads = sum(n for n, _ in groups)
    return sum(n * regs for n, regs in groups) <= threads * (min(REGISTER_FILE // threads, 255) // 8 * 8)


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
