"""The one FP8 latent-KV format (DESIGN.md, "Paged KV cache").

One cached token is 656 bytes:

    bytes   0 .. 511   c_kv, 512 values in float8_e4m3fn, 4 tiles of 128
    bytes 512 .. 527   4 float32 scales, one per tile (value = fp8 * scale)
    bytes 528 .. 655   k_pe, 64 values in bfloat16, unquantized

Every kernel that reads FP8 KV reads exactly this layout; the torch functions here
are its definition. An entry is fp8 * scale (DESIGN.md). `dequantize` gives the
bfloat16 nearest it, which is what the dequantizing kernels put in front of the
tensor cores and what the reference computes on; the FP8-MMA decodes
(kernels/triton/mla_decode_gluon_fp8mma.py, kernels/cutedsl/mla_decode_fp8_mma_kernel.py)
feed the e4m3 bytes to FP8 MMAs and apply the scales in fp32, i.e. use fp8 * scale exactly. The two readings differ
by at most 2^-9 of an entry (bf16's rounding), which moves a score by at most
2^-9 * softmax_scale * sum |q_i| |c_kv_i|; the GPU tests accept a result that matches the
reference on either reading (`dequantize(..., exact=True)` gives the exact one).
(Power-of-two scales would make fp8 * scale exact in bf16, but they round a tile's
largest value, and c_kv's outliers cost a tiny model 8x in log-prob error.)
"""

import torch

KV_LORA_RANK = 512
ROPE_DIM = 64
D_QK = KV_LORA_RANK + ROPE_DIM          # 576
TILE = 128
NUM_TILES = KV_LORA_RANK // TILE        # 4
SCALE_OFFSET = KV_LORA_RANK             # 512
ROPE_OFFSET = SCALE_OFFSET + 4 * NUM_TILES  # 528
PACKED_BYTES = ROPE_OFFSET + 2 * ROPE_DIM   # 656
E4M3_MAX = 448.0
# A tile of zeros still gets a positive scale, so that dequantization never divides by zero.
MIN_SCALE = 1e-10
# Scales are bf16 values no larger than 2^7 (c_kv magnitudes up to 448 * 2^7 = 57344; larger ones saturate):
# then a kernel forms e4m3 * scale with no conversion instruction — the bf16 whose bits are an e4m3 byte's
# sign | exponent-and-mantissa << 4 is that byte's value times 2^-120, and one bf16 multiply by
# scale * 2^120 (exact, < 2^128) rounds the product once, to the format's value.
MAX_SCALE = 128.0


def quantize(kv: torch.Tensor) -> torch.Tensor:
    """kv [..., 576] (bf16/fp16/fp32) -> packed uint8 [..., 656]."""
    lead = kv.shape[:-1]
    flat = kv.reshape(-1, D_QK)
    ckv = flat[:, :KV_LORA_RANK].float().view(-1, NUM_TILES, TILE)
    scale = _bf16_at_least((ckv.abs().amax(dim=-1) / E4M3_MAX).clamp(MIN_SCALE, MAX_SCALE))  # [n, 4]
    q = (ckv / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    out = torch.empty(flat.shape[0], PACKED_BYTES, dtype=torch.uint8, device=kv.device)
    out[:, :SCALE_OFFSET] = q.view(-1, KV_LORA_RANK).view(torch.uint8)
    out[:, SCALE_OFFSET:ROPE_OFFSET] = scale.contiguous().view(torch.uint8)
    kpe = flat[:, KV_LORA_RANK:].to(torch.bfloat16).contiguous()
    out[:, ROPE_OFFSET:] = kpe.view(torch.uint8)
    return out.view(*lead, PACKED_BYTES)


def _bf16_at_least(x: torch.Tensor) -> torch.Tensor:
    """float32 x > 0 -> the smallest bf16 value >= x, as float32 (so that amax / scale stays <= 448)."""
    b = x.to(torch.bfloat16)
    below = b.float() < x
    b = torch.where(below, (b.view(torch.int16) + 1).view(torch.bfloat16), b)
    return b.float()


def dequantize(packed: torch.Tensor, dtype: torch.dtype = torch.bfloat16, exact: bool = False) -> torch.Tensor:
    """packed uint8 [..., 656] -> [..., 576] in `dtype`: the bf16 values of the entries, cast to `dtype`; with
    `exact`, e4m3 * scale itself (float32 holds it exactly: 4 significant bits times a bf16 scale's 8), which
    float32 and float64 keep."""
    lead = packed.shape[:-1]
    flat = packed.reshape(-1, PACKED_BYTES)
    q = flat[:, :SCALE_OFFSET].contiguous().view(torch.float8_e4m3fn).float().view(-1, NUM_TILES, TILE)
    scale = flat[:, SCALE_OFFSET:ROPE_OFFSET].contiguous().view(torch.float32)  # [n, 4]
    ckv = (q * scale[..., None]).view(-1, KV_LORA_RANK)
    kpe = flat[:, ROPE_OFFSET:].contiguous().view(torch.bfloat16).float()
    values = torch.cat([ckv, kpe], dim=-1)
    if not exact:
        values = values.to(torch.bfloat16)
    return values.to(dtype).view(*lead, D_QK)
