"""The block-scaled presets (unimp.blockscale_presets): each one is its implementation's rule as
the reference functions write it, issue 33's right values through the presets, and the edge
cases where they part (a tiny block, an inf, a NaN), with values derived by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from unimp import blockscale as bs
from unimp.blockscale_presets import (
    BLOCK_PRESETS,
    ROLES,
    block_preset,
    block_preset_scales,
    block_quantize_dequantize,
)

E4M3, E5M2, E2M1 = "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"

#: Each preset as a call of the reference, written out here independently of the table:
#: (family function, keyword arguments) per role.
EXPECTED = {
    "ocp_mx": lambda x, role: bs.mx_quantize_dequantize(x, E4M3, "floor"),
    "transformer_engine_mxfp8": lambda x, role: bs.mx_quantize_dequantize(
        x, E4M3, "round_up", variant="transformer_engine"
    ),
    "transformer_engine_block_fp8": lambda x, role: bs.block_fp8_quantize_dequantize(
        x, E4M3, (128, 128) if role == "weight" else (1, 128), True, "kernel"
    ),
    "transformer_engine_nvfp4": lambda x, role: bs.nvfp4_quantize_dequantize(
        x, (16, 16) if role == "weight" else (1, 16), variant="transformer_engine"
    ),
    "torchao_mx": lambda x, role: bs.mx_quantize_dequantize(x, E4M3, "floor", variant="torchao"),
    "torchao_mx_rceil": lambda x, role: bs.mx_quantize_dequantize(x, E4M3, "round_up", variant="torchao"),
    "torchao_nvfp4": lambda x, role: bs.nvfp4_quantize_dequantize(x, (1, 16), variant="torchao"),
    "jax_mxfp8": lambda x, role: bs.mx_quantize_dequantize(x, E4M3, "round_up", variant="jax"),
    "jax_nvfp4": lambda x, role: bs.nvfp4_quantize_dequantize(x, (1, 16), variant="jax"),
}


def _tensor(seed=0):
    """128x256 float32 rows over many binades, a 449, a 6.5, a zero block and a tiny row."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((128, 256)) * 2.0 ** rng.integers(-20, 20, (128, 1))).astype(np.float32)
    x[1, 0], x[2, 5] = 449.0, 6.5
    x[0, :32] = 0.0
    x[3, :] = np.float32(2.0**-120)
    return x


def _same(a, b):
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    np.testing.assert_array_equal(np.where(np.isnan(a), 0, a).view(np.int32), np.where(np.isnan(b), 0, b).view(np.int32))


def test_the_table_names_every_implementation_of_the_issue():
    assert set(BLOCK_PRESETS) == set(EXPECTED)
    for p in BLOCK_PRESETS.values():
        assert p.source.split(":")[0] in {
            "microsoft/microxcaling", "NVIDIA/TransformerEngine", "pytorch/ao", "jax-ml/jax"
        }
        assert "/" in p.source.split(": ")[1]  # a path in that repository


@pytest.mark.parametrize("role", ["activation", "weight"])
@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_preset_is_its_reference_call(name, role):
    x = _tensor()
    _same(block_quantize_dequantize(x, name, role), EXPECTED[name](x, role))


def test_blocks_roundings_and_scales_per_preset():
    te = block_preset("transformer_engine_nvfp4")
    assert (te.tile("activation"), te.tile("weight"), te.tile("gradient")) == ((1, 16), (16, 16), (1, 16))
    assert (te.rounding("weight"), te.rounding("gradient")) == ("nearest_even", "stochastic")
    assert block_preset("torchao_nvfp4").tile("weight") == (1, 16)
    assert block_preset("transformer_engine_block_fp8").tile("weight") == (128, 128)
    assert block_preset("transformer_engine_mxfp8").tile("weight") == (1, 32)
    rules = {n: p.scale_rounding for n, p in BLOCK_PRESETS.items() if p.family == "mx"}
    assert rules == {
        "ocp_mx": "floor", "torchao_mx": "floor", "transformer_engine_mxfp8": "round_up",
        "torchao_mx_rceil": "round_up", "jax_mxfp8": "round_up",
    }


# The issue's right values, through the presets: (element, amax, round-up scale, floor scale)
@pytest.mark.parametrize(
    "fmt,amax,round_up,floor",
    [
        (E4M3, 448.0, 1.0, 1.0),
        (E4M3, 449.0, 2.0, 1.0),
        (E4M3, 511.0, 2.0, 1.0),  # floor: 511 is clipped to 448
        (E4M3, 512.0, 2.0, 2.0),
        (E4M3, 3.0, 2.0**-7, 2.0**-7),
        (E2M1, 6.5, 2.0, 1.0),
        (E2M1, 8.0, 2.0, 2.0),
    ],
)
def test_the_issues_right_values_through_the_presets(fmt, amax, round_up, floor):
    x = np.full((1, 32), 0.0, np.float32)
    x[0, 0] = amax
    up = ["torchao_mx_rceil"] + (["transformer_engine_mxfp8", "jax_mxfp8"] if fmt == E4M3 else [])
    for name in up:
        assert block_preset_scales(x, name, fmt=fmt).tolist() == [[round_up]], name
    for name in ("ocp_mx", "torchao_mx"):
        assert block_preset_scales(x, name, fmt=fmt).tolist() == [[floor]], name
    fmax = 448.0 if fmt == E4M3 else 6.0
    clipped = amax > fmax * floor  # the floor rule clips the block's maximum
    assert float(block_quantize_dequantize(x, "ocp_mx", fmt=fmt)[0, 0]) == (fmax * floor if clipped else amax)


def test_a_block_above_448_keeps_its_small_elements_under_the_floor_rule_only():
    # amax 449: floor scale 1, 0.001 -> E4M3's 2**-9 (0.001 / 2**-9 = 0.512 rounds up);
    # round-up scale 2, 0.0005 / 2**-9 = 0.256 rounds to 0
    x = np.full((1, 32), 0.001, np.float32)
    x[0, 0] = 449.0
    for name in ("ocp_mx", "torchao_mx"):
        assert block_quantize_dequantize(x, name)[0, :2].tolist() == [448.0, 2.0**-9]
    for name in ("transformer_engine_mxfp8", "torchao_mx_rceil", "jax_mxfp8"):
        assert block_quantize_dequantize(x, name)[0, :2].tolist() == [448.0, 0.0]


def test_a_tiny_block_by_preset():
    """amax 2**-120 (E4M3): both rules give byte 0 (2**-127). OCP and JAX divide by it: 2**7
    is exact in E4M3, back to 2**-120. Transformer Engine and torchao's RCEIL leave byte 0
    unscaled: 2**-120 rounds to 0. torchao's FLOOR divides by 2**-126 (64) and multiplies by
    2**-127: 2**-121, half the input."""
    x = np.full((1, 32), 2.0**-120, np.float32)
    want = {
        "ocp_mx": 2.0**-120, "jax_mxfp8": 2.0**-120, "transformer_engine_mxfp8": 0.0,
        "torchao_mx_rceil": 0.0, "torchao_mx": 2.0**-121,
    }
    for name, v in want.items():
        assert set(block_quantize_dequantize(x, name)[0].tolist()) == {v}, name
        assert block_preset_scales(x, name).tolist() == [[2.0**-127]], name


def test_an_infinite_and_a_nan_block_by_preset():
    x = np.full((1, 32), 1.0, np.float32)
    x[0, 0] = np.inf
    for name in ("ocp_mx", "transformer_engine_mxfp8", "torchao_mx", "torchao_mx_rceil"):
        assert block_quantize_dequantize(x, name)[0, :2].tolist() == [np.inf, 0.0], name
    assert np.isnan(block_quantize_dequantize(x, "jax_mxfp8")).all()  # byte 255
    bytes_ = {n: int(bs.mx_scales(x, E4M3, block_preset(n).scale_rounding, variant=block_preset(n).variant)[0, 0])
              for n in ("ocp_mx", "torchao_mx", "jax_mxfp8")}
    assert bytes_ == {"ocp_mx": 254, "torchao_mx": 247, "jax_mxfp8": 255}  # torchao: 128 - 8 + 127
    # a NaN: NVIDIA's byte 255 makes the block NaN; JAX's byte 0 scales the rest by 2**127
    y = np.zeros((1, 32), np.float32)
    y[0, :2] = np.nan, 1.0
    assert np.isnan(block_quantize_dequantize(y, "transformer_engine_mxfp8")).all()
    got = block_quantize_dequantize(y, "jax_mxfp8")[0, :3]
    assert math.isnan(got[0]) and got[1:].tolist() == [448.0 * 2.0**-127, 0.0]


def test_nvfp4_presets_block_holding_the_amax_has_decode_scale_448():
    x = _tensor(3)[:, :64] * np.float32(3.0)
    d, g = bs.nvfp4_scales(x, variant="transformer_engine")
    i, j = np.unravel_index(np.argmax(np.abs(x)), x.shape)
    assert d[i, j // 16] == 448.0
    np.testing.assert_array_equal(block_preset_scales(x, "transformer_engine_nvfp4"), d * g)


def test_stochastic_gradients_need_bits_and_are_reproducible():
    from unimp import rounding

    x = _tensor(4)[:16, :64]
    with pytest.raises(ValueError, match="random_bits"):
        block_quantize_dequantize(x, "transformer_engine_nvfp4", "gradient")
    bits = rounding.random_bits(rounding.NumpyOps, 7, 0, 0, x.shape)
    a = block_quantize_dequantize(x, "transformer_engine_nvfp4", "gradient", bits=bits)
    _same(a, bs.nvfp4_quantize_dequantize(x, (1, 16), "stochastic", bits))
    assert not np.array_equal(a, block_quantize_dequantize(x, "transformer_engine_nvfp4", "activation"))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x: block_quantize_dequantize(x, "transformer_engine_mxpf8"), "Did you mean 'transformer_engine_mxfp8'"),
        (lambda x: block_quantize_dequantize(x, "mxfp8"), "choose one of ocp_mx, transformer_engine_mxfp8"),
        (lambda x: block_quantize_dequantize(x, "ocp_mx", role="bias"), "activation, weight, gradient"),
        (lambda x: block_quantize_dequantize(x, "jax_mxfp8", fmt=E2M1), "stores float8_e4m3fn elements"),
        (lambda x: block_quantize_dequantize(x[:, :48], "ocp_mx"), "multiple of the block size 32"),
        (lambda x: bs.mx_quantize_dequantize(x, E4M3, "floor", variant="jax"), "rule='round_up'"),
    ],
)
def test_bad_input_names_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call(np.ones((16, 64), np.float32))


def test_roles_are_the_three():
    assert ROLES == ("activation", "weight", "gradient")


def test_the_docstring_examples_run():
    import doctest

    import unimp.blockscale_presets as mod

    failures, tried = doctest.testmod(mod)
    assert tried >= 2 and failures == 0


def test_quantization_error_right_values():
    """449 and 31 times 0.001 (float32 0.001 = d): the floor rule keeps d as 2**-9 and clips
    449 to 448; round-up (scale 2) takes every d to 0. Relative MSE = sum(err**2) / sum(x**2)."""
    from unimp.blockscale_presets import quantization_error

    x = np.full((1, 32), 0.001, np.float32)
    x[0, 0] = 449.0
    d = float(np.float32(0.001))
    den = 449.0**2 + 31 * d**2
    floor = quantization_error(x, "ocp_mx")
    assert (float(floor.underflow), float(floor.nonfinite)) == (0.0, 0.0)
    assert float(floor.relative_mse) == pytest.approx((1.0 + 31 * (2.0**-9 - d) ** 2) / den, rel=1e-5)
    up = quantization_error(x, "transformer_engine_mxfp8")
    assert (float(up.underflow), float(up.nonfinite)) == (31 / 32, 0.0)
    assert float(up.relative_mse) == pytest.approx((1.0 + 31 * d**2) / den, rel=1e-5)


def test_quantization_error_of_inf_blocks_and_zero_tensors():
    from unimp.blockscale_presets import quantization_error

    x = np.ones((1, 64), np.float32)
    x[0, 0] = np.inf  # the first block: 1 / 2**127 rounds to 0 (NVIDIA), or the block is NaN (JAX)
    ocp = quantization_error(x, "ocp_mx")
    assert float(ocp.underflow) == np.float32(31 / 63) and float(ocp.nonfinite) == 0.0
    assert float(ocp.relative_mse) == pytest.approx(31 / 63)  # 31 errors of 1 over 63 ones
    jax = quantization_error(x, "jax_mxfp8")
    assert float(jax.nonfinite) == np.float32(31 / 63) and float(jax.underflow) == 0.0
    assert float(jax.relative_mse) == 0.0  # the second block is exact; NaN ones are left out
    zero = quantization_error(np.zeros((2, 32), np.float32), "torchao_mx")
    assert [float(v) for v in zero] == [0.0, 0.0, 0.0]


def test_jax_mxfp8_preset_is_jax_s_quantize_on_inf_and_nan_blocks():
    """Against JAX's own quantize (run on the CPU): an inf block (byte 255: NaN when
    dequantized) and a NaN block (byte 0: the other elements times 2**127, clipped to 448),
    with ordinary blocks beside them. No zero in the NaN block: JAX divides it by the subnormal
    2**-127, which XLA on the CPU flushes, and 0 / 0 would be NaN there."""
    from conftest import require_backend

    require_backend("jax")
    import jax
    from jax._src.cudnn import scaled_matmul_stablehlo as smm

    rng = np.random.default_rng(9)
    x = (rng.standard_normal((4, 128)) * 8).astype(np.float32)
    x[0, 0], x[1, 33], x[2, 70] = np.inf, np.nan, 449.0
    q, s = smm.quantize(jax.numpy.asarray(x), jax.nn.get_scaled_dot_general_config("mxfp8"))
    byte = np.asarray(s).view(np.uint8).astype(np.int32)
    assert (byte[0, 0], byte[1, 1]) == (255, 0)
    scale = np.where(byte == 255, np.float32(np.nan), bs.e8m0_value(byte))
    deq = (np.asarray(q).astype(np.float32).reshape(4, 4, 32) * scale[..., None]).reshape(4, 128)
    _same(block_quantize_dequantize(x, "jax_mxfp8"), deq)
    np.testing.assert_array_equal(bs.mx_scales(x, E4M3, "round_up", variant="jax"), byte)
