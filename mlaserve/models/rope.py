"""Rotary position embedding for MLA and the DSA indexer: plain RoPE and YaRN with mscale.

The tables follow transformers' `_compute_yarn_parameters` (itself DeepSeek's `yarn_find_correction_range`
and linear ramp): inverse frequencies blend interpolation and extrapolation across the rope dims, and
cos/sin carry the attention factor mscale(factor, mscale) / mscale(factor, mscale_all_dim), which is
1 for DeepSeek-V3 and Kimi K2. The softmax scale's mscale² lives in `ModelConfig.softmax_scale`.

Two layouts of the rotated pairs exist:
- interleaved (DeepSeek's own): pairs (x0, x1), (x2, x3), ...; the output is written de-interleaved,
  [evens rotated, odds rotated], as transformers' DeepSeek-V3 does. Queries and keys get the same
  permutation, so every dot product is that of DeepSeek's interleaved layout.
- halves ("rotate_half"): pairs (x_i, x_{i + d/2}).
"""

import math

import torch

from mlaserve.models.config import RopeConfig, yarn_get_mscale


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies float32 [dim // 2] and the cos/sin scale (attention factor)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    pos_freqs = rope.theta ** exponents
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, rope.mscale) / yarn_get_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    orig = rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp            # 1: keep the original frequency (high-frequency dims)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """cos/sin tables for a rope dim; not an nn.Module, so that loading on the meta device leaves it intact."""

    def __init__(self, rope: RopeConfig, dim: int, device: torch.device | str = "cpu"):
        inv_freq, self.attention_factor = rope_inv_freq(rope, dim)
        self.dim = dim
        self.inv_freq = inv_freq.to(device)

    def to(self, device: torch.device | str) -> "RotaryEmbedding":
        self.inv_freq = self.inv_freq.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T] -> (cos, sin) float32 [T, dim // 2], scaled by the attention factor."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotates x [T, ..., d] by cos/sin float32 [T, d // 2] (broadcast over the middle dims); computed in
    float32, returned in x's dtype. Interleaved input pairs come out de-interleaved (module docstring)."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
