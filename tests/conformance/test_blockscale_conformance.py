"""The block-scaled formats (unimp.blockscale) run on every backend's own tensors through its
``FP8Ops`` and give the NumPy reference's values bit for bit: MX (floor and round-up, E4M3,
E5M2, E2M1), block FP8 (1x128 and 128x128, both variants), NVFP4 (every variant, nearest
and seeded stochastic rounding) and its random Hadamard transform, on small random tensors
with zero blocks, a 449, a 6.5, -0.0, inf and NaN planted; eagerly, and compiled by XLA
(``jax.jit``, ``tf.function(jit_compile=True)``). Inputs stay in float32's normal range: XLA
and TensorFlow flush subnormals, so results that are float32 subnormals are not promised
alike. TensorFlow's graphs without XLA are not promised either: their CPU kernels divide
vectors approximately (an ulp off), which NVFP4's and non-power-of-two block FP8's scale
arithmetic meets, and Grappler reassociates MX's two power-of-two factors into one flushed
subnormal where the scale is 2**-127 or 2**127."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from conftest import require_backend
from kits import float_bits as _bits
from kits import native as _native

from unimp import blockscale, rounding
from unimp.blockscale_presets import BLOCK_PRESETS, block_quantize_dequantize, quantization_error
from unimp.fp8.rule import NumpyOps


def _ops(backend):
    mod = importlib.import_module(f"unimp.backends.{backend}.fp8")
    return mod.FP8Ops() if backend == "torch" else mod.FP8Ops


def _input(shape, special, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2.0 ** rng.integers(-20, 20, (shape[0], 1))).astype(np.float32)
    x[0, :] = 0.0  # zero blocks and a zero 128x128 tile's first row
    x[1, 0], x[2, 5], x[3, 7] = 449.0, 6.5, -0.0
    x[4, 16:48] = -0.0
    if special:
        x[5, 3], x[6, 40], x[7, 1] = np.inf, -np.inf, np.nan
    return x


def _check(backend, fn, x, **kw):
    got = fn(_native(backend, x), ops=_ops(backend), **kw)
    want = fn(x, ops=NumpyOps, **kw)
    np.testing.assert_array_equal(_bits(np.asarray(got)), _bits(want))


@pytest.mark.parametrize("special", [False, True], ids=["finite", "inf_nan"])
@pytest.mark.parametrize("rule", ["floor", "round_up"])
@pytest.mark.parametrize("fmt", list(blockscale.ELEMENT_FORMATS))
def test_mx_is_the_reference_bit_for_bit(backend, fmt, rule, special):
    _check(backend, blockscale.mx_quantize_dequantize, _input((8, 128), special), fmt=fmt, rule=rule)


@pytest.mark.parametrize("special", [False, True], ids=["finite", "inf_nan"])
@pytest.mark.parametrize("variant", blockscale.BLOCK_FP8_VARIANTS)
@pytest.mark.parametrize("tile", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
def test_block_fp8_is_the_reference_bit_for_bit(backend, tile, variant, special):
    x = _input((128, 256), special)
    for pow2 in (True, False):
        _check(backend, blockscale.block_fp8_quantize_dequantize, x, tile=tile, variant=variant, pow2=pow2)


@pytest.mark.parametrize("special", [False, True], ids=["finite", "inf_nan"])
@pytest.mark.parametrize("variant", blockscale.NVFP4_VARIANTS)
@pytest.mark.parametrize("tile", [(1, 16), (16, 16)], ids=["1x16", "16x16"])
def test_nvfp4_is_the_reference_bit_for_bit(backend, tile, variant, special):
    x = _input((32, 64), special)
    _check(backend, blockscale.nvfp4_quantize_dequantize, x, tile=tile, variant=variant)


def test_nvfp4_stochastic_rounding_is_the_reference_bit_for_bit(backend):
    """One seed's bits (unimp.rounding.random_bits, itself alike in every backend) give the
    same stochastically rounded NVFP4 values everywhere."""
    x = _input((32, 64), False, seed=1)
    bits = rounding.random_bits(rounding.NumpyOps, 11, 4, 2, x.shape)
    got = blockscale.nvfp4_quantize_dequantize(
        _native(backend, x), rounding="stochastic", bits=_native(backend, bits, "int32"), ops=_ops(backend)
    )
    want = blockscale.nvfp4_quantize_dequantize(x, rounding="stochastic", bits=bits)
    np.testing.assert_array_equal(_bits(np.asarray(got)), _bits(want))
    assert not np.array_equal(want, blockscale.nvfp4_quantize_dequantize(x))  # it did round otherwise


@pytest.mark.parametrize("special", [False, True], ids=["finite", "inf_nan"])
def test_random_hadamard_transform_is_the_reference_bit_for_bit(backend, special):
    """NVFP4's random Hadamard transform: float32 sums of 24-bit significands (inexact, alike
    everywhere by their one order) and the bfloat16 rounding from bits; inf and NaN spread."""
    _check(backend, blockscale.random_hadamard_transform, _input((32, 64), special))


@pytest.mark.parametrize("special", [False, True], ids=["finite", "inf_nan"])
@pytest.mark.parametrize("role", ["activation", "weight"])
@pytest.mark.parametrize("preset", list(BLOCK_PRESETS))
def test_every_preset_is_the_reference_bit_for_bit(backend, preset, role, special):
    """Each implementation's preset (unimp.blockscale_presets), its MX variant's handling of
    byte 0, inf and NaN included, gives the same bits on every backend's tensors."""
    _check(backend, block_quantize_dequantize, _input((128, 256), special), preset=preset, role=role)


@pytest.mark.parametrize("preset", ["ocp_mx", "jax_mxfp8", "transformer_engine_nvfp4"])
def test_quantization_error_is_the_reference(backend, preset):
    """Shares exact (counts below 2**24), the relative MSE to float32 summation order."""
    x = _input((128, 256), True)
    got = quantization_error(_native(backend, x), preset, ops=_ops(backend))
    want = quantization_error(x, preset)
    assert [float(np.asarray(v)) for v in got[:2]] == [float(v) for v in want[:2]]
    np.testing.assert_allclose(float(np.asarray(got.relative_mse)), float(want.relative_mse), rtol=1e-5)


COMPILED = [
    (blockscale.mx_quantize_dequantize, {"fmt": "float4_e2m1fn", "rule": "floor"}),
    (blockscale.mx_quantize_dequantize, {"fmt": "float8_e4m3fn", "rule": "round_up"}),
    (blockscale.block_fp8_quantize_dequantize, {"tile": (1, 128)}),
    (blockscale.block_fp8_quantize_dequantize, {"tile": (128, 128), "variant": "kernel", "pow2": False}),
    (blockscale.nvfp4_quantize_dequantize, {}),
    (blockscale.nvfp4_quantize_dequantize, {"variant": "torchao"}),
    (blockscale.nvfp4_quantize_dequantize, {"variant": "jax", "tile": (16, 16)}),
    (block_quantize_dequantize, {"preset": "transformer_engine_mxfp8"}),
    (block_quantize_dequantize, {"preset": "torchao_mx"}),
    (block_quantize_dequantize, {"preset": "jax_mxfp8"}),
    (blockscale.random_hadamard_transform, {}),
]


@pytest.mark.parametrize("case", range(len(COMPILED)), ids=[f"{f.__name__.split('_')[0]}-{kw}" for f, kw in COMPILED])
@pytest.mark.parametrize("backend", ["tensorflow", "jax"])  # XLA's compilation; torch runs eagerly
def test_compiled_by_xla_is_the_reference_bit_for_bit(backend, case):
    """XLA reassociates nothing here, keeps the float8 rounding (JAX's round_fp8) and, with the
    backends' NaN-keeping maxima, every NaN (its CPU reduce-max drops NaN in large reductions)."""
    require_backend(backend)
    fn, kw = COMPILED[case]
    ops = _ops(backend)
    if backend == "jax":
        import jax

        run = jax.jit(lambda a: fn(a, ops=ops, **kw))
    else:
        import tensorflow as tf

        run = tf.function(lambda a: fn(a, ops=ops, **kw), jit_compile=True)
    for special in (False, True):
        x = _input((128, 256), special)
        np.testing.assert_array_equal(_bits(np.asarray(run(_native(backend, x)))), _bits(fn(x, **kw)))
