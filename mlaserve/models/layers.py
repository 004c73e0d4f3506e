"""Small building blocks shared by the DeepSeek-family layers: RMSNorm and the SwiGLU MLP."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x²) + eps) computed in float32, scaled by `weight` in the input dtype (as transformers)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense layers, each routed expert and the shared experts.

    x [T, hidden] -> [T, hidden]. Under tensor parallelism `intermediate_size` is this rank's share
    and the output a partial sum; `reduce` (a ParallelConfig) all-reduces it here — the dense layers
    pass it, while the MoE's experts leave the sum to the MoE, which reduces once for all of them.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, reduce=None):
        super().__init__()
        self.reduce = reduce
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out if self.reduce is None else self.reduce.all_reduce(out)
