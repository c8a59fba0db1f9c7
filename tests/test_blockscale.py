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


# --- NVFP4 (Transformer Engine NVFP4BlockScaling; torchao's variant) ---------------------------


def test_nvfp4_right_values_with_a_global_scale_of_one():
    """Global amax 2688 = 448 * 6: S_enc = 1. Block 0 holds it: 2688 * rn(1/6) = 448.0000134,
    448 in float32, e4m3 448; 2688 -> 6 -> 2688, 100 / 448 = 0.22 -> 0, 200 / 448 = 0.45 -> 0.5
    -> 224. Block 1 (amax 5): 5 * rn(1/6) = 0.8333 rounds to the e4m3 0.8125 (13/16; spacing
    1/16 in [0.5, 1)); 1 / 0.8125 = 1.2308: 5 -> 6.15 -> 6 -> 4.875, 1 -> 1.23 -> 1 -> 0.8125,
    2 -> 2.46 -> 2 -> 1.625, 0.3 -> 0.37 -> 0.5 -> 0.40625, -0 -> +0 (TE's cast_to_fp4x2)."""
    from unimp.blockscale import nvfp4_block_scale, nvfp4_global_scale, nvfp4_quantize_dequantize

    x = np.zeros((1, 32), np.float32)
    x[0, :3] = [2688.0, 100.0, 200.0]
    x[0, 16:21] = [5.0, 1.0, 2.0, 0.3, -0.0]
    assert nvfp4_global_scale(np.float32(2688.0)) == 1.0
    assert nvfp4_block_scale(np.float32([2688.0, 5.0]), np.float32(1.0)).tolist() == [448.0, 0.8125]
    out = nvfp4_quantize_dequantize(x)
    want = np.zeros((1, 32), np.float32)
    want[0, :3] = [2688.0, 0.0, 224.0]
    want[0, 16:20] = [4.875, 0.8125, 1.625, 0.40625]
    np.testing.assert_array_equal(out.view(np.int32), want.view(np.int32))  # +0 everywhere


def test_nvfp4_block_holding_the_tensor_s_amax_has_decode_scale_448():
    """The issue's right value: 448 * 6 / amax * rn(1/6) * amax is within a few ulps of 448,
    and e4m3's spacing there is 32."""
    from unimp.blockscale import nvfp4_block_scale, nvfp4_global_scale

    rng = np.random.default_rng(2)
    amax = (rng.random(100_000) * 2.0 ** rng.integers(-100, 100, 100_000)).astype(np.float32)
    amax = amax[amax > 0]
    assert (nvfp4_block_scale(amax, nvfp4_global_scale(amax)) == 448.0).all()


def test_nvfp4_global_scale_cap_zero_and_inf():
    """448 * 6 / 2**-120 = 2688 * 2**120 > FLT_MAX: capped; 2**-110 still fits (exactly
    2688 * 2**110); amax 0 or inf: 1 (TE's compute_global_encode_scaling_factor_FP4)."""
    from unimp.blockscale import nvfp4_global_scale

    got = nvfp4_global_scale(np.float32([2.0**-120, 2.0**-110, 0.0, np.inf, 2688.0 * 4]))
    assert got.tolist() == [F32_MAX, 2688.0 * 2.0**110, 1.0, 1.0, 0.25]


def test_nvfp4_under_the_global_scale_cap():
    """A tensor whose amax is 2**-120: S_enc = FLT_MAX and s_global = rn(1 / FLT_MAX) = 2**-128
    (1 / FLT_MAX = 2**-128 * (1 + 2**-24 + ...), a subnormal rounded to 2**-128). The block
    decode scale is e4m3(2**-120 * rn(FLT_MAX * rn(1/6))) = e4m3(42.67) = 44 (spacing 4 in
    [32, 64)): not 448, the cap costs range. 2**-120 * (2**128 / 44) = 5.82 -> 6, dequantized
    (6 * 44) * 2**-128 = 33 * 2**-125."""
    from unimp.blockscale import nvfp4_quantize_dequantize

    x = np.zeros((1, 16), np.float32)
    x[0, 0] = 2.0**-120
    out = nvfp4_quantize_dequantize(x)
    assert out[0, 0] == np.float32(33 * 2.0**-125) and (out[0, 1:] == 0).all()


def test_nvfp4_zeros_stay_zeros_and_a_nan_makes_the_tensor_nan():
    from unimp.blockscale import nvfp4_quantize_dequantize

    z = nvfp4_quantize_dequantize(np.zeros((16, 32), np.float32), tile=(16, 16))
    assert (z == 0).all() and not np.signbit(z).any()
    x = np.ones((2, 32), np.float32)
    x[1, 3] = np.nan  # the global amax is NaN (torch.max propagates it), so every scale
    assert np.isnan(nvfp4_quantize_dequantize(x)).all()


def _te_fp4(y):
    """Transformer Engine's cast_to_fp4x2 (reference_nvfp4.py) read as values: its thresholds,
    ties to the neighbour whose mantissa bit is 0, and -0.0 to +0 (it tests x >= 0.0)."""
    a = np.abs(y)
    q = np.full(a.shape, np.float32(6.0))
    for mid, lo, hi in [(5.0, 4, 6), (3.5, 3, 4), (2.5, 2, 3), (1.75, 1.5, 2), (1.25, 1, 1.5), (0.75, 0.5, 1), (0.25, 0, 0.5)]:
        tie = np.float32(hi if lo in (0.5, 1.5, 3) else lo)
        q = np.where(a < mid, np.float32(lo), np.where(a == mid, tie, q))
    return np.where(y < 0, -q, q)


def _te_nvfp4(x, tile):
    """A transcription of Transformer Engine's reference_nvfp4.py (_quantize_blockwise_reference,
    the default path; cast_to_fp4x2's thresholds; the reference's FLT_MAX for an amax of 0),
    dequantized as (q * s_block) * s_global, for finite inputs."""
    import ml_dtypes

    m, n = x.shape
    tr, tc = tile
    t = x.reshape(m // tr, tr, n // tc, tc)
    gamax = np.abs(x).max()
    with np.errstate(divide="ignore"):
        s_enc = np.minimum(np.float32(2688.0) / gamax, np.float32(F32_MAX))
    s_enc = np.float32(1.0) if s_enc == 0 else s_enc
    s_dec = np.float32(1.0) / s_enc
    vec_max = np.abs(t).max(axis=(1, 3), keepdims=True)
    d = vec_max * (s_enc * (np.float32(1.0) / np.float32(6.0)))
    d = np.clip(np.minimum(d, np.float32(F32_MAX)), -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    with np.errstate(divide="ignore"):
        enc = np.minimum(np.float32(1.0) / (d * s_dec), np.float32(F32_MAX))
    q = _te_fp4(np.clip(t * enc, -6, 6))
    return ((q * d) * s_dec).astype(np.float32).reshape(m, n)


def test_the_transcribed_fp4_thresholds_are_ml_dtypes_e2m1_rounding():
    """The transcription's cast against ml_dtypes' float4_e2m1fn (valid on finite values in
    [-6, 6]; the two differ only at -0.0 and NaN), ties included."""
    import ml_dtypes

    x = np.random.default_rng(3).uniform(-6, 6, 50_000).astype(np.float32)
    ties = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = np.concatenate([x, ties, -ties])
    want = x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(_te_fp4(x), want)


@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
def test_nvfp4_matches_a_transcription_of_transformer_engine_s_reference(tile):
    from unimp.blockscale import nvfp4_quantize_dequantize

    rng = np.random.default_rng(4)
    x = (rng.standard_normal((64, 64)) * 2.0 ** rng.integers(-12, 12, (64, 1))).astype(np.float32)
    x[:16, :16] = 0.0  # a zero tile
    x[20, 5] = -0.0
    x[40, 40] = 1e4  # the global amax
    got = nvfp4_quantize_dequantize(x, tile)
    np.testing.assert_array_equal(got.view(np.int32), _te_nvfp4(x, tile).view(np.int32))


def test_torchao_nvfp4_clamps_a_small_block_scale_at_2_to_the_minus_6():
    """Global amax 2688 (TE: S_enc = 1; torchao: p = 1). A block of amax 0.03: 0.03 / 6 = 0.005.
    TE rounds it to the e4m3 subnormal 3 * 2**-9 = 0.00586 (2.56 -> 3): 0.03 * 170.67 = 5.12 ->
    6, dequantized 6 * 3 * 2**-9 = 0.03515625. torchao clamps it to 2**-6: 0.03 * 64 = 1.92 ->
    2, dequantized 2 * 2**-6 = 0.03125. The block of the amax agrees (448)."""
    from unimp.blockscale import nvfp4_quantize_dequantize

    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 2688.0
    x[0, 16] = 0.03
    te = nvfp4_quantize_dequantize(x)
    ao = nvfp4_quantize_dequantize(x, variant="torchao")
    assert te[0, 16] == np.float32(0.03515625) and ao[0, 16] == np.float32(0.03125)
    assert te[0, 0] == ao[0, 0] == 2688.0
    # torchao's dynamic per-tensor scale of an all-zero tensor is 0, its block scales 0 / 0
    assert np.isnan(nvfp4_quantize_dequantize(np.zeros((1, 16), np.float32), variant="torchao")).all()


def _bits_for(u):
    """int32 random bits whose top 24 bits read as the fraction ``u`` (a multiple of 2**-24)."""
    return np.int32(np.uint32(int(u * 2**24) << 8).view(np.int32))


@pytest.mark.parametrize(
    "x,u,want",
    [
        (0.3, 0.5, 0.5),  # 0.6 of the way from 0 to 0.5: up where u < 0.6
        (0.3, 0.75, 0.0),
        (-5.0, 0.25, -6.0),  # halfway between 4 and 6
        (-5.0, 0.5, -4.0),
        (3.0, 0.0, 3.0),  # representable: never moves
        (2.5, 0.0, 3.0),
        (6.0, 0.0, 6.0),
    ],
)
def test_stochastic_e2m1_right_values(x, u, want):
    from unimp.blockscale import round_e2m1_stochastic

    got = round_e2m1_stochastic(np.float32([x]), np.array([_bits_for(u)], np.int32))
    assert got.tolist() == [want]


def test_stochastic_nvfp4_is_unbiased_and_reproducible_from_a_seed():
    from unimp import rounding
    from unimp.blockscale import nvfp4_quantize_dequantize, round_e2m1_stochastic

    x = np.full((1, 200_000), 0.3, np.float32)
    bits = rounding.random_bits(rounding.NumpyOps, 7, 0, 0, x.shape)
    y = round_e2m1_stochastic(x, bits)
    assert set(np.unique(y).tolist()) == {0.0, 0.5} and abs(float(y.mean()) - 0.3) < 0.005
    g = np.random.default_rng(5).standard_normal((4, 32)).astype(np.float32)
    b1 = rounding.random_bits(rounding.NumpyOps, 1, 3, 2, g.shape)
    one = nvfp4_quantize_dequantize(g, rounding="stochastic", bits=b1)
    np.testing.assert_array_equal(one, nvfp4_quantize_dequantize(g, rounding="stochastic", bits=b1))
    b2 = rounding.random_bits(rounding.NumpyOps, 2, 3, 2, g.shape)
    assert not np.array_equal(one, nvfp4_quantize_dequantize(g, rounding="stochastic", bits=b2))
    with pytest.raises(ValueError, match="random_bits"):
        nvfp4_quantize_dequantize(g, rounding="stochastic")
    with pytest.raises(ValueError, match="choose one of nearest_even, stochastic"):
        nvfp4_quantize_dequantize(g, rounding="even")
    with pytest.raises(ValueError, match="choose one of transformer_engine, torchao"):
        nvfp4_quantize_dequantize(g, variant="te")
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_quantize_dequantize(np.zeros((2, 24), np.float32))


# --- against JAX's own quantizer (jax.nn.scaled_dot_general's configs), where JAX is under test


def _jax_quantize():
    from conftest import require_backend

    require_backend("jax")
    import jax
    from jax._src.cudnn import scaled_matmul_stablehlo as smm  # what jax.nn.scaled_matmul calls

    return jax, smm


def _planted(shape, seed, zeros=True):
    """Random normal-range float32 rows with 449 and 6.5 planted, and a zero block. No
    subnormal: XLA on CPU and GPU flushes them (DAZ), so JAX's results differ there."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2.0 ** rng.integers(-30, 30, (shape[0], 1))).astype(np.float32)
    x[1, 0] = 449.0
    x[2, 5] = 6.5
    if zeros:
        x[0, :32] = 0.0
    return x


def test_mx_round_up_equals_jax_s_mxfp8_quantize():
    """JAX divides amax by 448 and rounds up from the quotient's bits; unimp multiplies by
    rn(1/448): the same bytes, and the same dequantized values, on blocks whose scale is a
    normal float32. (A block of zeros, scale byte 0 = 2**-127, is NaN in JAX on XLA's CPU:
    it divides by the subnormal scale, which XLA flushes to 0; unimp keeps it 0.)"""
    jax, smm = _jax_quantize()
    from unimp.blockscale import e8m0_round_up, e8m0_value, mx_quantize_dequantize

    x = _planted((16, 256), 6, zeros=False)
    cfg = jax.nn.get_scaled_dot_general_config("mxfp8")
    q, s = smm.quantize(jax.numpy.asarray(x), cfg)
    byte = np.asarray(s).view(np.uint8).astype(np.int32)
    amax = np.abs(x.reshape(16, 8, 32)).max(-1)
    np.testing.assert_array_equal(e8m0_round_up(amax, "float8_e4m3fn"), byte)
    deq = np.asarray(q).astype(np.float32).reshape(16, 8, 32) * e8m0_value(byte)[..., None]
    got = mx_quantize_dequantize(x, "float8_e4m3fn", "round_up")
    np.testing.assert_array_equal(got.view(np.int32), deq.reshape(16, 256).view(np.int32))


def test_jax_s_mxfp8_scale_of_inf_and_nan_is_not_nvidia_s():
    """Where the rules part: JAX's cast_to_e8m0_with_rounding_up gives inf the NaN byte 255
    (NVIDIA: 254) and NaN byte 0 (its exponent 255 + 1 wraps in uint8; NVIDIA: 255)."""
    _, smm = _jax_quantize()
    from unimp.blockscale import E8M0_NAN, e8m0_round_up

    special = np.float32([np.inf, np.nan])
    jax_bytes = np.asarray(smm.cast_to_e8m0_with_rounding_up(special)).astype(np.int32).tolist()
    assert jax_bytes == [255, 0]
    assert e8m0_round_up(special, "float8_e4m3fn").tolist() == [254, E8M0_NAN]


def test_nvfp4_jax_variant_equals_jax_s_nvfp4_quantize():
    jax, smm = _jax_quantize()
    from unimp.blockscale import nvfp4_quantize_dequantize

    x = _planted((16, 128), 7)
    g = np.float32(np.abs(x).max()) / np.float32(2688.0)
    cfg = jax.nn.get_scaled_dot_general_config("nvfp4", global_scale=jax.numpy.float32(g))
    q, s = smm.quantize(jax.numpy.asarray(x), cfg)
    d = np.asarray(s).astype(np.float32).reshape(16, 8, 1)
    deq = ((np.asarray(q).astype(np.float32).reshape(16, 8, 16) * d) * g).reshape(16, 128)
    got = nvfp4_quantize_dequantize(x, variant="jax")
    np.testing.assert_array_equal(got.view(np.int32), deq.view(np.int32))
    # Transformer Engine's arithmetic (multiplying by rounded reciprocals) gives values an ulp
    # or a rounding step apart in about a quarter of 1x32 standard normal tensors
    ys = np.random.default_rng(8).standard_normal((64, 1, 32)).astype(np.float32)
    differ = [not np.array_equal(nvfp4_quantize_dequantize(y), nvfp4_quantize_dequantize(y, variant="jax")) for y in ys]
    assert 4 <= sum(differ) <= 40


# --- the random Hadamard transform (NVFP4's weight-gradient operands) --------------------------


def test_the_hadamard_matrix_is_transformer_engine_s_and_orthogonal():
    """diag(signs) @ H16 / 4 with TE's hard-coded signs (get_wgrad_sign_vector), H16's rows as
    TE's get_hadamard_matrix lists them (H[i, j] = (-1)**popcount(i & j)): T @ T.T = I."""
    from unimp.blockscale import RHT_SIGNS, hadamard_matrix

    assert RHT_SIGNS == (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
    t = hadamard_matrix()
    h = np.array([[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)], np.float64)
    np.testing.assert_array_equal(t * 4, np.diag(RHT_SIGNS) @ h)
    assert (h[3, :8] == [1, -1, -1, 1, 1, -1, -1, 1]).all()  # TE's fourth row
    np.testing.assert_array_equal((4 * t) @ (4 * t).T, 16 * np.eye(16))  # unnormalized: 16 I
    np.testing.assert_array_equal(t @ t.T, np.eye(16))  # normalized by 1 / sqrt(16)
    np.testing.assert_array_equal(hadamard_matrix([1] * 16), h / 4)
    with pytest.raises(ValueError, match="16 values of 1 or -1"):
        hadamard_matrix([1] * 15 + [0])


def test_random_hadamard_transform_right_values():
    """Each chunk of 16 along the last axis becomes bf16(v @ T): a one-hot chunk is a row of T,
    ones with all-plus signs are (4, 0, ..., 0), and the bfloat16 rounding is to nearest even."""
    from unimp.blockscale import hadamard_matrix, random_hadamard_transform

    t = hadamard_matrix()
    x = np.zeros((3, 32), np.float32)
    x[0, 5], x[0, 16 + 12] = 1.0, 2.0  # two chunks of one row
    x[1, :16] = 1.0
    x[2, :16] = 1.0 + 2.0**-8  # 0.25 * (1 + 2**-8): a tie between two bfloat16 values, to even
    x[2, 16:] = 1.0 + 3 * 2.0**-8  # a tie the other way: up to 0.25 * (1 + 2**-6) in magnitude
    y = random_hadamard_transform(x)
    np.testing.assert_array_equal(y[0, :16], t[5])
    np.testing.assert_array_equal(y[0, 16:], 2 * t[12])
    np.testing.assert_array_equal(y[1, :16], t.sum(axis=0))  # signs' sum / 4 = (6 - 10) / 4 first
    assert y[1, 0] == -1.0
    ones = random_hadamard_transform(np.ones((1, 16), np.float32), signs=[1] * 16)
    np.testing.assert_array_equal(ones, [[4.0] + [0.0] * 15])
    e0 = random_hadamard_transform(np.float32([[1 + 2.0**-8] + [0.0] * 15]), signs=[1] * 16)
    np.testing.assert_array_equal(e0, np.full((1, 16), 0.25, np.float32))  # 0.25 * (1 + 2**-8) -> 0.25
    e0 = random_hadamard_transform(np.float32([[1 + 3 * 2.0**-8] + [0.0] * 15]), signs=[1] * 16)
    np.testing.assert_array_equal(np.abs(e0), np.full((1, 16), 0.25 * (1 + 2.0**-6), np.float32))
    np.testing.assert_array_equal(random_hadamard_transform(x.T.copy(), axis=0), y.T)  # down columns
    with pytest.raises(ValueError, match=r"dimension 1 \(24\) must be a multiple of 16.*pad"):
        random_hadamard_transform(np.ones((2, 24), np.float32))
    with pytest.raises(ValueError, match="axis 2 is not an axis"):
        random_hadamard_transform(np.ones((2, 16), np.float32), axis=2)


def test_random_hadamard_transform_on_bfloat16_inputs_is_transformer_engine_s():
    """TE's kernels: a bfloat16 input times the bfloat16 T, summed in float32, rounded to
    bfloat16. Where the sums are exact (bfloat16 values over a few binades, as here) any order
    gives TE's bits: the float64 product rounded to bfloat16."""
    import ml_dtypes

    from unimp.blockscale import hadamard_matrix, random_hadamard_transform

    rng = np.random.default_rng(9)
    x = rng.choice([-1.0, 1.0], (64, 128)) * rng.uniform(0.25, 4.0, (64, 128)) * 2.0 ** rng.integers(-9, 9, (64, 1))
    x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    exact = x.astype(np.float64).reshape(-1, 16) @ hadamard_matrix().astype(np.float64)
    assert (exact.astype(np.float32) == exact).all()  # the premise: float32 holds every sum
    want = exact.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32).reshape(x.shape)
    np.testing.assert_array_equal(random_hadamard_transform(x), want)
    assert not np.array_equal(want, exact.reshape(x.shape))  # the rounding to bfloat16 did round


def test_round_bf16_is_the_nearest_even_bfloat16():
    """From the bits, against ml_dtypes' cast: ties, subnormals, the overflow to inf, specials."""
    import ml_dtypes

    from unimp.blockscale import round_bf16

    rng = np.random.default_rng(10)
    x = (rng.standard_normal(100_000) * 2.0 ** rng.integers(-140, 126, 100_000)).astype(np.float32)
    ties = (np.arange(1, 200, dtype=np.int32) * 2**16 + 2**15).view(np.float32)  # exactly half an ulp
    special = np.float32([0.0, -0.0, np.inf, -np.inf, 3.4028235e38, -3.3961776e38, 1e-45])
    x = np.concatenate([x, ties, -ties, special])
    with np.errstate(over="ignore"):
        want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(round_bf16(x).view(np.int32), want.view(np.int32))
    assert np.isnan(round_bf16(np.float32([np.nan]))).all()


def test_the_docstring_examples_run():
    import doctest

    import unimp.blockscale as mod

    failures, tried = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert tried >= 2 and failures == 0
