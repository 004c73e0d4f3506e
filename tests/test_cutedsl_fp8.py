"""The CuTe DSL FP8-KV MLA decode's host side and its dequantization arithmetic, on the CPU.

The FP8 kernels (mlaserve/kernels/cutedsl/fp8_dequant.py) turn 4 e4m3 bytes into two bf16x2 words
with prmt (selectors 0x9180 / 0xB3A2, sign-replicating), << 4, & 0x87F0 per half, and multiply by the
tile's scale * 2^120 formed as (fp32 scale bits + 120 << 23), upper half (prmt 0x3232). Here the same
bit operations run in torch on every byte and on real quantized tiles, against the format's definition
(fp8_format.dequantize). The kernel itself runs in tests/gpu/test_cutedsl_mla.py. CI does not install
the DSL: nothing here imports it.
"""

import importlib

import pytest
import torch

from mlaserve.kernels import fp8_format

cd = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
CPU = torch.device("cpu")


def _prmt(word: torch.Tensor, selector: int) -> torch.Tensor:
    """PTX prmt.b32 d, word, 0, selector (default mode) on int64 tensors holding uint32 values."""
    src = [(word >> (8 * i)) & 0xFF for i in range(4)] + [torch.zeros_like(word)] * 4
    out = torch.zeros_like(word)
    for i in range(4):
        sel = (selector >> (4 * i)) & 0xF
        byte = src[sel & 7]
        if sel & 8:     # replicate the selected byte's sign bit
            byte = torch.where(byte & 0x80 != 0, 0xFF, 0)
        out |= byte << (8 * i)
    return out


def _bf16x2(word: torch.Tensor) -> torch.Tensor:
    """uint32 words (int64) -> float32 [..., 2]: the low and the high bf16 half."""
    halves = torch.stack([word & 0xFFFF, word >> 16], dim=-1).to(torch.int32)
    return (halves << 16).view(torch.float32)


def _unpack(e4m3: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 4 * k] -> float32 [n, k, 4]: the bf16 words the kernel's prmt/shift/mask make (x * 2^-120)."""
    w = e4m3.view(e4m3.shape[0], -1, 4).to(torch.int64)
    word = w[..., 0] | w[..., 1] << 8 | w[..., 2] << 16 | w[..., 3] << 24       # little-endian, as ld.shared
    lo = (_prmt(word, 0x9180) << 4) & 0x87F087F0
    hi = (_prmt(word, 0xB3A2) << 4) & 0x87F087F0
    return torch.cat([_bf16x2(lo), _bf16x2(hi)], dim=-1)


def _kernel_dequant(e4m3: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic: uint8 [n, 4 * k] and fp32 scales [n] -> bf16 values as float32 [n, 4 * k]."""
    values = _unpack(e4m3)                                                      # x * 2^-120, exact
    mult_bits = (scale.view(torch.int32).to(torch.int64) + (120 << 23)) & 0xFFFFFFFF
    mult = _bf16x2(_prmt(mult_bits, 0x3232))[..., 0]                              # scale * 2^120 as bf16
    # fma.rn.bf16x2 with -0.0: one RNE rounding of the exact product (exact in fp32: 8 x 8 significand bits)
    return (values * mult[:, None, None]).to(torch.bfloat16).float().view(e4m3.shape)


def test_every_e4m3_byte_times_every_kind_of_scale_is_the_formats_value():
    codes = torch.arange(256, dtype=torch.uint8)
    numbers = (codes & 0x7F) != 0x7F                      # e4m3fn's NaN codes: the quantizer never writes them
    scales = torch.tensor([fp8_format.MIN_SCALE, 3e-9, 0.0117, 1 / 448, 0.5, 1.0, 1.7, 96.3, fp8_format.MAX_SCALE])
    scales = fp8_format._bf16_at_least(scales.clamp(max=fp8_format.MAX_SCALE))
    e4m3 = codes[None, :].expand(len(scales), -1).contiguous()
    # the definition: bf16 nearest e4m3 * scale
    want = (e4m3.view(torch.float8_e4m3fn).double() * scales.double()[:, None]).to(torch.bfloat16).float()
    got = _kernel_dequant(e4m3, scales)
    assert torch.equal(got[:, numbers], want[:, numbers]), (got - want)[:, numbers].abs().max()


def test_quantized_tiles_dequantize_as_the_format_and_poison_bytes_stay_finite():
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(300, 576, generator=gen) * torch.logspace(-4, 3, 300)[:, None]
    kv[5, :128] = 0.0                                      # a zero tile: MIN_SCALE
    packed = fp8_format.quantize(kv)
    ref = fp8_format.dequantize(packed).float()
    scales = packed[:, 512:528].contiguous().view(torch.float32)   # [300, 4]
    for t in range(4):
        got = _kernel_dequant(packed[:, 128 * t:128 * (t + 1)].contiguous(), scales[:, t].contiguous())
        assert torch.equal(got, ref[:, 128 * t:128 * (t + 1)])
    # 0xFF poison in unused rows: the bit trick yields a finite bf16 (exponent field <= 15), so the kernel's
    # multiplier 0 for rows past a request's end writes zeros there, never NaN
    unpacked = _unpack(torch.arange(256, dtype=torch.uint8)[None])
    assert unpacked.isfinite().all() and (unpacked * 0.0 == 0).all()


def test_plan_and_checks_take_the_fp8_cache():
    plan = cd.plan_mla_decode(2, 1, 16, 512, 64, 64, True, CPU)
    assert plan.config == cd.CONFIG and plan.num_splits == cd.choose_num_splits(2, 1, 16, 64, 64, CPU)
    cd.check_supported((2, 1, 16, 576), torch.bfloat16, (8, 64, 656), torch.uint8, 512)
    q = torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(8, 64, 656, dtype=torch.uint8)
    bt = torch.arange(8, dtype=torch.int32).view(2, 4)
    lens = torch.full((2,), 256, dtype=torch.int32)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        cd.mla_decode(q, kv, bt, lens, 0.1)


@pytest.mark.parametrize("q_dtype, kv_shape, says", [
    (torch.float16, (8, 64, 656), "bf16 q with an FP8 KV cache, got torch.float16"),
    (torch.bfloat16, (8, 32, 656), r"uint8 \[pages, 64, 656\] \(page size 64\), got shape \(8, 32, 656\)"),
    (torch.bfloat16, (8, 64, 576), r"got shape \(8, 64, 576\)"),
])
def test_fp8_inputs_it_cannot_take_raise_naming_the_values(q_dtype, kv_shape, says):
    with pytest.raises(ValueError, match=says):
        cd.check_supported((2, 1, 16, 576), q_dtype, kv_shape, torch.uint8, 512)
