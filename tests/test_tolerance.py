"""The GPU checks' tolerance (kernels/tolerance.py): bf16-rounded P passes, real mistakes do not."""

import torch

from mlaserve.kernels.tolerance import attention_close


def _attend(scores, v, p_dtype=torch.float64, drop_key=None):
    """scores [rows, n], v [n, d] -> (out [rows, d], lse [rows]) with P rounded to p_dtype before P V."""
    if drop_key is not None:
        scores = scores.clone()
        scores[:, drop_key] = float("-inf")
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - scores.amax(-1, keepdim=True)).to(p_dtype).double()
    out = (p @ v) / p.sum(-1, keepdim=True)
    return out, lse


def test_bf16_p_on_peaked_short_rows_passes_and_mistakes_fail():
    gen = torch.Generator().manual_seed(0)
    rows, n, d = 64, 5, 512                        # few keys, spread-out scores: peaked attention
    scores = torch.randn(rows, n, generator=gen, dtype=torch.float64) * 4
    v = torch.randn(n, d, generator=gen, dtype=torch.float64)
    ref_out, ref_lse = _attend(scores, v)
    out, lse = _attend(scores, v, torch.bfloat16)
    # FlashMLA's bounds alone reject bf16 P here; the slack is what lets it pass
    strict = ((out - ref_out).abs() > torch.maximum(torch.full_like(out, 1e-3), ref_out.abs() * 2 / 128)).any()
    assert strict
    ok, max_err, why = attention_close(out.bfloat16(), lse.float(), ref_out, ref_lse)
    assert ok, why
    assert 0 < max_err < 0.05
    # a kernel that skipped one key, or that wrote NaN / left an empty row nonzero, fails
    bad_out, bad_lse = _attend(scores, v, torch.bfloat16, drop_key=2)
    assert not attention_close(bad_out.bfloat16(), bad_lse.float(), ref_out, ref_lse)[0]
    nan_out = out.clone()
    nan_out[3, 7] = float("nan")
    assert "NaN" in attention_close(nan_out, lse, ref_out, ref_lse)[2]
    empty_lse = ref_lse.clone()
    empty_lse[5] = float("-inf")
    ref_empty = ref_out.clone()
    ref_empty[5] = 0
    assert "empty rows" in attention_close(out, lse, ref_empty, empty_lse)[2]
