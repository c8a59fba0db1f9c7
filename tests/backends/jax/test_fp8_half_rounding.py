"""The float8 rule reads a half-precision input as its dtype holds it, inside jit too: XLA's
excess-precision simplification may keep a bfloat16 op's result in float32 and drop its
rounding, and the amax then read a value no bfloat16 holds (8.2099 where torch and TensorFlow
read 8.1875, the breaker's Keras-JAX case)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from unimp.backends.jax.fp8 import FP8Ops, fp8_amax


def test_a_bfloat16_matmuls_amax_is_a_bfloat16_value_under_jit():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 8)).astype(np.float32) * 3)
    w = jnp.asarray(np.random.default_rng(2).normal(size=(8, 16)).astype(np.float32) * 0.3)

    def amax(x, w):
        return fp8_amax(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16))

    eager = float(amax(x, w))
    assert eager == float(jnp.asarray(eager, jnp.bfloat16))  # a bfloat16 value
    assert float(jax.jit(amax)(x, w)) == eager


def test_widening_a_half_value_changes_no_bit():
    rng = np.random.default_rng(3)
    values = rng.normal(size=2000) * 10.0 ** rng.integers(-9, 5, 2000)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 6e-8, -3e-5, 65504.0, 1e-40]
    for dtype in (jnp.float16, jnp.bfloat16):
        v = jnp.asarray(np.concatenate([values, special]).astype(np.float32)).astype(dtype)
        got = np.asarray(jax.jit(FP8Ops.to_f32)(v))
        want = np.asarray(v.astype(jnp.float32))
        np.testing.assert_array_equal(got, want)
        assert np.array_equal(np.signbit(got), np.signbit(want))
