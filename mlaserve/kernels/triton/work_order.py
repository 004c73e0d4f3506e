"""The order in which a persistent decode kernel takes its requests: longest first.

A persistent launch hands work items to SMs as they free up. Taken in batch order, a long request drawn last
finishes alone while the other SMs idle; taken longest first (LPT list scheduling), the last items drawn are
the shortest and the SMs finish close together. With lengths uniform in [s/2, 3s/2] over 128 requests on 66
slots, a simulation of the two orders put the step at 1.40x (index order) and 1.05x (longest first) the
perfectly balanced time (2 items per request: 1.19x and 1.03x).

A grid of more programs than the SMs hold is list-scheduled the same way by the hardware, which starts
programs in grid order as SMs free up: the grid kernels (triton's tl, 64-row Gluon, narrow and FP8-MMA kernels,
the CuTe kernels' grids) map their request axis through the same order when their grid takes more than one
wave (`grid_order`). Measured on the H200 in interleaved A/Bs: 1.1-1.4x faster with variable lengths, 0.4-3%
slower with fixed ones (this kernel's launch; bench/NOTES.md 52).

The order is computed on the GPU from the lengths in one small kernel (no host sync, so that a decode step
stays capturable in a CUDA graph): rank(i) = #{j : len_j > len_i, or len_j == len_i and j < i}, a stable
descending sort, so that equal lengths keep batch order (and a batch of one length keeps the identity).
"""

import torch
import triton
import triton.language as tl

from mlaserve.kernels.triton.mla_decode_plan import _num_sms

BLOCK = 128


@triton.jit
def _longest_first_kernel(lens_ptr, order_ptr, b, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    len_i = tl.load(lens_ptr + i, mask=i < b, other=0)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for j0 in range(0, b, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        len_j = tl.load(lens_ptr + j, mask=j < b, other=0)
        ahead = (len_j[None, :] > len_i[:, None]) | ((len_j[None, :] == len_i[:, None]) & (j[None, :] < i[:, None]))
        ahead = ahead & (j[None, :] < b)
        rank += tl.sum(ahead.to(tl.int32), axis=1)
    tl.store(order_ptr + rank, i, mask=i < b)


def longest_first(lens: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [b]: the request indices by length, longest first, ties in index order (lens: int32 [b])."""
    if lens.dim() != 1 or lens.dtype != torch.int32:
        raise ValueError(f"lens must be int32 [b], got {lens.dtype} {tuple(lens.shape)}")
    b = lens.shape[0]
    if out is None:
        out = torch.empty(b, dtype=torch.int32, device=lens.device)
    elif out.shape != (b,) or out.dtype != torch.int32 or out.device != lens.device:
        raise ValueError(f"out must be int32 [{b}] on {lens.device}, got {out.dtype} {tuple(out.shape)} "
                         f"on {out.device}")
    if b:
        _longest_first_kernel[(triton.cdiv(b, BLOCK),)](lens.contiguous(), out, b, BLOCK=BLOCK)
    return out


def grid_order(cache_seqlens: torch.Tensor, programs: int, num_splits: int) -> torch.Tensor | None:
    """The longest-first order for a grid kernel of `programs` programs per split, request-major, or None where
    the order cannot matter: grids of one wave (small batches' splits are counted to fill one). The hardware
    starts a grid's programs split by split, so with two splits of requests longest first the second halves
    follow the first ones longest first too (mla_decode_plan.balanced_splits)."""
    if programs * num_splits <= _num_sms(cache_seqlens.device):
        return None
    return longest_first(cache_seqlens)
