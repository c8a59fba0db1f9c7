"""Float8 rounding (``FP8Ops.round_fp8``): the same values as the reference cast in every
backend, and in JAX written in ops a compiler keeps (issue 31: XLA may delete a
``f32 -> f8 -> f32`` cast pair in jitted code on GPU, openxla/xla#41605)."""

from __future__ import annotations

import importlib

import ml_dtypes
import numpy as np
import pytest
from conftest import require_backend
from kits import float_bits as _bits
from kits import native as _native

from unimp.fp8.rule import NumpyOps

FORMATS = {"float8_e4m3fn": (ml_dtypes.float8_e4m3fn, 448.0), "float8_e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def _sweep(dtype: str) -> np.ndarray:
    """Every finite value of the format, every midpoint between two neighbours and the float32
    values either side of it (the ties and near-ties), random values over the whole range and
    the subnormals, signed zeros and NaN; clipped to the format's range, as quantizing clips."""
    kind, fmax = FORMATS[dtype]
    vals = np.arange(256, dtype=np.uint8).view(kind).astype(np.float32)
    vals = np.sort(vals[np.isfinite(vals)])
    mids = ((vals[1:].astype(np.float64) + vals[:-1]) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    rand = (rng.standard_normal(20000) * 10.0 ** rng.uniform(-14, 5, 20000)).astype(np.float32)
    x = np.concatenate([vals, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf), rand,
                        np.float32([0.0, -0.0, np.nan])])  # fmt: skip
    return np.clip(x, -fmax, fmax).astype(np.float32)


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_round_fp8_is_the_reference_cast_bit_for_bit(backend, dtype):
    require_backend(backend)
    ops = importlib.import_module(f"unimp.backends.{backend}.fp8").FP8Ops
    x = _sweep(dtype)
    got = np.asarray(ops.round_fp8(_native(backend, x), dtype), np.float32)
    np.testing.assert_array_equal(_bits(got), _bits(NumpyOps.round_fp8(x, dtype)))


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_jax_float8_rounding_survives_compilation(dtype):
    """The optimized HLO of a jitted quantize-dequantize rounds in reduce-precision ops (which
    XLA never deletes, unlike a cast pair), and a value between two float8 values comes out
    rounded: 0.3 is 0.3125 in e4m3fn and 0.3125 in e5m2, 1/3 * 2**-10 is a subnormal of each."""
    require_backend("jax")
    import jax
    import jax.numpy as jnp

    from unimp import fp8

    mod = importlib.import_module("unimp.backends.jax")
    qdq = jax.jit(lambda x, s, inv: mod.fp8_quantize_dequantize(x, s, inv, dtype))
    x = jnp.asarray([0.3, 2.0**-10 / 3, -700.0], jnp.float32)
    one = jnp.float32(1.0)
    hlo = qdq.lower(x, one, one).compile().as_text()
    assert "reduce-precision" in hlo
    got = np.asarray(qdq(x, one, one))
    want = fp8.quantize_dequantize(np.asarray(x), np.float32(1.0), np.float32(1.0), dtype)
    np.testing.assert_array_equal(got, want)
    assert got[0] == 0.3125 and got[0] != np.float32(0.3)
