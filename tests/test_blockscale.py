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
