"""The constants of the CuTe kernels' exp2 on the FMA pipe (split_consumers.exp2_poly, EXP2_POLY): its steps in
float32 numpy, as the PTX does them, against 2^x in float64. (The PTX itself runs in the GPU tests.)"""

import numpy as np

from mlaserve.kernels.cutedsl.common import EXP2_POLY_COEFFS

MAGIC = np.float32(1.5 * 2 ** 23)


def exp2_poly(x: np.ndarray) -> np.ndarray:
    """exp2_poly's PTX, step by step in float32: rint by the magic constant, the cubic, j into the exponent's bits,
    0 below -125."""
    x = x.astype(np.float32)
    with np.errstate(invalid="ignore"):
        t = x + MAGIC
        f = x - (t - MAGIC)
        c0, c1, c2, c3 = (np.float32(c) for c in EXP2_POLY_COEFFS)
        p = ((f * c3 + c2) * f + c1) * f + c0
        bits = p.view(np.uint32) + (t.view(np.uint32) << np.uint32(23))
    return np.where(x < np.float32(-125), np.float32(0), bits.view(np.float32))


def test_relative_error_is_far_below_bf16_and_fp16_rounding():
    """Over the softmax's range (x <= 0, and up to 8 where a row's max moves lazily) the relative error stays under
    1e-4: bf16 rounds P at 2^-9 (2e-3), fp16 at 2^-11 (4.9e-4)."""
    x = np.concatenate([np.linspace(-124.9, 8.0, 400_001), -np.random.default_rng(0).exponential(4.0, 100_000)])
    x = x.astype(np.float32)
    got = exp2_poly(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    assert np.max(np.abs(got / want - 1)) < 1e-4


def test_exact_at_integers_within_the_fit_and_zero_below_the_range():
    """At integer x the cubic's value at f = 0 (C0, within the fit's error of 1) times 2^x; -inf and everything below
    -125 give exactly 0 (a masked key adds nothing, a row that saw no key keeps a zero sum)."""
    x = np.arange(-125, 9, dtype=np.float32)
    assert np.allclose(exp2_poly(x) / np.exp2(x.astype(np.float64)), EXP2_POLY_COEFFS[0], rtol=0, atol=1e-7)
    assert np.all(exp2_poly(np.array([-np.inf, -125.5, -300.0, -1e30], dtype=np.float32)) == 0)
