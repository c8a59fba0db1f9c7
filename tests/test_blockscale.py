"""The block-scaled formats' scale rules (unimp.blockscale): issue 33's right values, and the
round-up rule's two spellings (multiply by rn(1/max), divide by max) against each other."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unimp.blockscale import E8M0_NAN, ELEMENT_FORMATS, e8m0_floor, e8m0_round_up, e8m0_value


def _scale(byte):
    return float(e8m0_value(np.int32(byte)))


@pytest.mark.parametrize(
    "fmt,amax,round_up,floor",
    [
        ("float8_e4m3fn", 448.0, 1.0, 1.0),
        ("float8_e4m3fn", 449.0, 2.0, 1.0),  # floor: 449 / 1 saturates to 448
        ("float8_e4m3fn", 511.0, 2.0, 1.0),
        ("float8_e4m3fn", 512.0, 2.0, 2.0),
        ("float8_e4m3fn", 3.0, 2.0**-7, 2.0**-7),
        ("float4_e2m1fn", 6.5, 2.0, 1.0),
        ("float4_e2m1fn", 8.0, 2.0, 2.0),
    ],
)
def test_the_issues_right_values(fmt, amax, round_up, floor):
    a = np.float32(amax)
    assert _scale(e8m0_round_up(a, fmt)) == round_up
    assert _scale(e8m0_floor(a, fmt)) == floor


@pytest.mark.parametrize("rule", [e8m0_floor, e8m0_round_up])
@pytest.mark.parametrize("fmt", list(ELEMENT_FORMATS))
def test_special_maxima(rule, fmt):
    got = rule(np.float32([0.0, np.inf, np.nan, 1e-45]), fmt).tolist()
    assert got[:3] == [0, 254, E8M0_NAN] and got[3] == 0
    assert math.isnan(_scale(E8M0_NAN)) and _scale(0) == 2.0**-127 and _scale(254) == 2.0**127


def _ceil_byte(v):
    """ceil(log2(v)) + 127 in float64 (the exact quotient's), clamped to [0, 254], as a byte."""
    v = np.asarray(v, np.float64)
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(v))
    e = np.where(v == 0, -127, e)
    return np.clip(e + 127, 0, 254).astype(np.int32)


@pytest.mark.parametrize("fmt", list(ELEMENT_FORMATS))
def test_round_up_by_multiplying_equals_dividing(fmt):
    """Two million random amaxes over float32's range and every max * 2**k (the issue's right
    value): the byte of ``amax * rn(1/max)`` (Transformer Engine's) is the byte of the float32
    quotient ``amax / max`` rounded up to a power of two."""
    fmax, _ = ELEMENT_FORMATS[fmt]
    rng = np.random.default_rng(0)
    amax = (rng.random(2_000_000) * 2.0 ** rng.integers(-140, 128, 2_000_000)).astype(np.float32)
    with np.errstate(over="ignore"):
        edges = (np.float64(fmax) * 2.0 ** np.arange(-149, 128)).astype(np.float32)
    amax = np.concatenate([amax, edges])
    amax = amax[np.isfinite(amax) & (amax > 0)]
    got = e8m0_round_up(amax, fmt)
    want = _ceil_byte(amax / np.float32(fmax))  # float32 division, correctly rounded
    np.testing.assert_array_equal(got, want)


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=0.0, max_value=float(np.finfo(np.float32).max), width=32), st.sampled_from(list(ELEMENT_FORMATS)))
def test_floor_is_floor_log2_minus_the_element_exponent(amax, fmt):
    _, emax = ELEMENT_FORMATS[fmt]
    a = np.float32(amax)
    want = 0 if a == 0 else int(np.clip(math.floor(math.log2(a)) - emax + 127, 0, 254))
    assert int(e8m0_floor(a, fmt)) == want


def test_e2m1_rounding_is_the_format_s_nearest_even_value():
    """Against ml_dtypes' float4_e2m1fn cast on every value, every midpoint and its float32
    neighbours, and random values in [-6, 6]; NaN stays NaN (the cast makes it -0)."""
    import ml_dtypes

    from unimp.blockscale import round_e2m1

    vals = np.float32([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    vals = np.concatenate([-vals[::-1], vals])
    mids = ((vals[1:].astype(np.float64) + vals[:-1]) / 2).astype(np.float32)
    rand = np.random.default_rng(0).uniform(-6, 6, 100_000).astype(np.float32)
    x = np.concatenate([vals, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf), rand])
    want = x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(round_e2m1(x), want)
    assert np.signbit(round_e2m1(np.float32([-0.0, -0.1]))).all()
    assert np.isnan(round_e2m1(np.float32([np.nan]))).all()


@pytest.mark.parametrize(
    "fmt,first,rule,scaled,rest",
    [
        ("float8_e4m3fn", 449.0, "floor", 448.0, 0.3125),  # scale 1: 449 saturates to 448
        ("float8_e4m3fn", 449.0, "round_up", 448.0, 0.3125),  # scale 2: 224.5 -> 224, times 2
        ("float4_e2m1fn", 6.5, "floor", 6.0, 0.5),  # scale 1: 6.5 saturates to 6, 0.3 -> 0.5
        ("float4_e2m1fn", 6.5, "round_up", 6.0, 0.0),  # scale 2: 3.25 -> 3; 0.15 -> 0
    ],
)
def test_mx_blocks_share_one_scale(fmt, first, rule, scaled, rest):
    from unimp.blockscale import mx_quantize_dequantize

    block = np.float32([first, *([0.3] * 31)])
    out = mx_quantize_dequantize(block, fmt, rule)
    assert out[0] == scaled and (out[1:] == np.float32(rest)).all()
    assert out.shape == block.shape and out.dtype == np.float32


def test_mx_refuses_a_width_that_is_not_a_multiple_of_the_block_and_keeps_nan_blocks():
    from unimp.blockscale import mx_quantize_dequantize

    with pytest.raises(ValueError, match="multiple of the block size 32"):
        mx_quantize_dequantize(np.zeros((2, 48), np.float32), "float8_e4m3fn", "floor")
    with pytest.raises(ValueError, match="unknown scale rule"):
        mx_quantize_dequantize(np.zeros((2, 32), np.float32), "float8_e4m3fn", "even")
    x = np.ones((2, 64), np.float32)
    x[1, 40] = np.nan
    out = mx_quantize_dequantize(x, "float8_e5m2", "round_up")
    assert np.isnan(out[1, 32:]).all() and (out[1, :32] == 1).all() and (out[0] == 1).all()
