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


# --- block FP8 (Transformer Engine Float8BlockScaling) -----------------------------------------

F32_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize(
    "amax,fmt,pow2,want",
    [
        (448.0, "float8_e4m3fn", True, 1.0),
        (449.0, "float8_e4m3fn", True, 0.5),  # 448 / 449 = 0.9978, floored to a power of two
        (449.0, "float8_e4m3fn", False, float(np.float32(448) / np.float32(449))),
        (3.0, "float8_e4m3fn", True, 128.0),  # 149.33 floored
        (1.0, "float8_e5m2", True, 32768.0),  # 57344 floored
        (2.0**-149, "float8_e4m3fn", True, 2.0**127),  # 448 / amax overflows: FLT_MAX, floored
        (2.0**-149, "float8_e4m3fn", False, F32_MAX),
        (0.0, "float8_e4m3fn", True, 1.0),  # a block of zeros
        (0.0, "float8_e4m3fn", False, 1.0),
    ],
)
def test_block_fp8_scale_right_values(amax, fmt, pow2, want):
    from unimp.blockscale import block_fp8_scale

    for variant in ("reference", "kernel"):
        got = block_fp8_scale(np.float32(amax), fmt, pow2, variant)
        assert got.dtype == np.float32 and float(got) == want


@pytest.mark.parametrize("pow2", [True, False])
def test_block_fp8_scale_of_inf_and_nan_by_variant(pow2):
    """TE's PyTorch reference: inf -> 0 (quantize_scale_calc.py), NaN divides through; its CUDA
    kernels (recipe_common.cuh): inf and NaN -> 1."""
    from unimp.blockscale import block_fp8_scale

    ref = block_fp8_scale(np.float32([np.inf, np.nan]), pow2=pow2)
    assert ref[0] == 0.0 and np.isnan(ref[1])
    np.testing.assert_array_equal(block_fp8_scale(np.float32([np.inf, np.nan]), pow2=pow2, variant="kernel"), [1.0, 1.0])


def test_block_fp8_rows_of_128_each_take_their_own_scale():
    """Row 0 holds 449: S = 0.5, 449 -> 224.5 -> 224 (E4M3 spacing 16 in [128, 256)) -> 448;
    0.3 -> 0.15 -> 0.15625 (spacing 2**-6, 9.6 -> 10) -> 0.3125. Row 1 (amax 1): S = 256,
    0.7 -> 179.2 -> 176 -> 0.6875. Row 2 is zeros (S = 1). Row 3 holds inf: the reference
    makes it NaN (S = 0, 1 / S = inf); the kernels take S = 1, inf saturates to 448 and 0.3
    rounds to 0.3125 (spacing 2**-5 in [0.25, 0.5))."""
    from unimp.blockscale import block_fp8_quantize_dequantize

    x = np.zeros((4, 128), np.float32)
    x[0, :] = 0.3
    x[0, 7] = 449.0
    x[1, :] = 0.7
    x[1, 100] = -1.0
    x[3, :] = 0.3
    x[3, 9] = np.inf
    ref = block_fp8_quantize_dequantize(x)
    assert ref.shape == x.shape and ref.dtype == np.float32
    assert ref[0, 7] == 448.0 and (np.delete(ref[0], 7) == np.float32(0.3125)).all()
    assert ref[1, 100] == -1.0 and (np.delete(ref[1], 100) == np.float32(0.6875)).all()
    assert (ref[2] == 0).all() and not np.signbit(ref[2]).any()
    assert np.isnan(ref[3]).all()
    kern = block_fp8_quantize_dequantize(x, variant="kernel")
    np.testing.assert_array_equal(kern[:3], ref[:3])
    assert kern[3, 9] == 448.0 and (np.delete(kern[3], 9) == np.float32(0.3125)).all()


def test_block_fp8_kernel_variant_skips_nan_in_the_amax():
    from unimp.blockscale import block_fp8_quantize_dequantize

    x = np.full((1, 128), 0.7, np.float32)
    x[0, 0] = np.nan
    kern = block_fp8_quantize_dequantize(x, variant="kernel")  # amax 0.7: S = 512, 358.4 -> 352
    assert np.isnan(kern[0, 0]) and (kern[0, 1:] == np.float32(352 / 512)).all()
    assert np.isnan(block_fp8_quantize_dequantize(x)).all()


def test_block_fp8_weight_tiles_are_128_by_128():
    """One 449 in the top tile gives all of it S = 0.5 (0.7 -> 0.35 -> 0.34375 -> 0.6875, and
    0.3 -> 0.3125); the bottom tile, amax 1, S = 256 (0.3 -> 76.8 -> 80 -> 0.3125)."""
    from unimp.blockscale import BLOCK_FP8_TILES, block_fp8_quantize_dequantize

    x = np.full((256, 128), 0.3, np.float32)
    x[5, 70] = 449.0
    x[100, 3] = 0.7
    x[200, 1] = 1.0
    out = block_fp8_quantize_dequantize(x, tile=BLOCK_FP8_TILES["weight"])
    assert out[5, 70] == 448.0 and out[100, 3] == 0.6875 and out[200, 1] == 1.0
    rest = np.ones(x.shape, bool)
    rest[[5, 100, 200], [70, 3, 1]] = False
    assert (out[rest] == np.float32(0.3125)).all()
    # as 1x128 rows instead, row 100 (amax 0.7: S = 512) keeps 0.7 closer: 358.4 -> 352
    assert block_fp8_quantize_dequantize(x)[100, 3] == np.float32(352 / 512)


def _te_block_fp8(x, tile, fmt, pow2):
    """A transcription of Transformer Engine's BlockwiseQuantizerReference (multiply, clamp,
    cast; scale_from_amax_tensor with eps 0, frexp / ldexp) in float64-free NumPy, dequantized
    with the reciprocal scale, for finite inputs."""
    import ml_dtypes

    fmax = np.float32(ELEMENT_FORMATS[fmt][0])
    m, k = x.shape
    tr, tc = tile
    t = x.reshape(m // tr, tr, k // tc, tc)
    amax = np.abs(t).max(axis=(1, 3), keepdims=True)
    with np.errstate(divide="ignore"):
        scale = fmax / amax
    scale = np.where(np.isinf(scale), np.float32(F32_MAX), scale).astype(np.float32)
    if pow2:
        _, e = np.frexp(scale)
        scale = np.ldexp(np.float32(1.0), e - 1).astype(np.float32)
    scale = np.where(amax == 0, np.float32(1.0), scale)
    q = np.clip(t * scale, -fmax, fmax).astype(getattr(ml_dtypes, fmt)).astype(np.float32)
    return (q * (np.float32(1.0) / scale)).reshape(m, k)


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("tile", [(1, 128), (128, 128)])
def test_block_fp8_matches_a_transcription_of_transformer_engine_s_reference(tile, fmt, pow2):
    from unimp.blockscale import block_fp8_quantize_dequantize

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((256, 256)) * 2.0 ** rng.integers(-20, 20, (256, 1))).astype(np.float32)
    x[:128, :128] = 0.0  # a tile of zeros
    x[200, 10] = 449.0
    x[130, 200] = 2.0**-140  # a subnormal amax: the scale overflows to FLT_MAX
    x[130, 130:] = 0.0
    x[130, 129] = 2.0**-140
    got = block_fp8_quantize_dequantize(x, fmt, tile, pow2)
    np.testing.assert_array_equal(got.view(np.int32), _te_block_fp8(x, tile, fmt, pow2).view(np.int32))


def test_block_fp8_refuses_bad_input_naming_the_fix():
    from unimp.blockscale import block_fp8_quantize_dequantize

    with pytest.raises(ValueError, match="multiple of 128"):
        block_fp8_quantize_dequantize(np.zeros((2, 100), np.float32))
    with pytest.raises(ValueError, match="product of the others of 128"):
        block_fp8_quantize_dequantize(np.zeros((64, 128), np.float32), tile=(128, 128))
    with pytest.raises(ValueError, match="reshape it to"):
        block_fp8_quantize_dequantize(np.zeros(128, np.float32), tile=(128, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn or float8_e5m2"):
        block_fp8_quantize_dequantize(np.zeros((1, 128), np.float32), "float4_e2m1fn")
    with pytest.raises(ValueError, match="choose one of reference, kernel"):
        block_fp8_quantize_dequantize(np.zeros((1, 128), np.float32), variant="cuda")
