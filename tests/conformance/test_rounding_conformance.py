"""How a half parameter takes its update (unimp.rounding, issue 32): the rule written once, run
on each backend's ``UpdateOps``, against the NumPy reference. The issue's right values: a
bfloat16 weight of 1.0 given 1,000 steps of -1e-3 (SGD, learning rate 1, gradient 1e-3) stays
exactly 1.0 with round to nearest, ends within 1e-2 of 0.0 with Kahan compensation and within
0.05 with stochastic rounding, whose 1,000 values are bit-identical in every framework for one
seed and differ for another."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from unimp import rounding

BF16 = ml_dtypes.bfloat16


def _kit(backend):
    """(ops, from NumPy, to float32 NumPy) for ``backend``."""
    if backend == "torch":
        import torch

        from unimp.backends.torch.optimizer import UpdateOps

        def to(a):
            return torch.from_numpy(np.asarray(a, np.float32)).to(torch.bfloat16)

        return UpdateOps("cpu"), to, lambda t: t.float().numpy()
    if backend == "tensorflow":
        import tensorflow as tf

        from unimp.backends.tensorflow.optimizer import UpdateOps

        return UpdateOps(), lambda a: tf.cast(np.asarray(a, np.float32), tf.bfloat16), lambda t: np.asarray(tf.cast(t, tf.float32))
    import jax.numpy as jnp

    from unimp.backends.jax.optimizer import UpdateOps

    return UpdateOps(), lambda a: jnp.asarray(np.asarray(a, np.float32), jnp.bfloat16), lambda t: np.asarray(t, np.float32)


def _trajectory(ops, to, back, mode, n=1, steps=1000, seed=0, delta=-1e-3):
    """The weights after every step, float32 NumPy of shape (steps, n)."""
    p, c = to(np.ones(n)), to(np.zeros(n))
    d = ops.f32(np.full(n, delta, np.float32))  # float32: -1e-3 itself, not its bfloat16
    out = []
    for step in range(steps):
        bits = rounding.random_bits(ops, seed, step, 0, (n,)) if mode == "stochastic" else None
        p, comp = rounding.apply_update(ops, mode, p, d, c, bits)
        c = comp if comp is not None else c
        out.append(back(p))
    return np.stack(out)


REFERENCE = {}


def _reference(mode, n=1, seed=0):
    key = (mode, n, seed)
    if key not in REFERENCE:
        ops = rounding.NumpyOps
        REFERENCE[key] = _trajectory(ops, lambda a: np.asarray(a, np.float32).astype(BF16), lambda t: np.asarray(t, np.float32), mode, n, seed=seed)
    return REFERENCE[key]


def test_the_issues_right_values_in_every_framework(backend):
    ops, to, back = _kit(backend)
    nearest = _trajectory(ops, to, back, "nearest")
    assert nearest[-1].tolist() == [1.0]  # every step below half the spacing at 1.0 (2**-8)
    kahan = _trajectory(ops, to, back, "kahan")
    assert abs(kahan[-1, 0]) <= 1e-2
    sr = _trajectory(ops, to, back, "stochastic", seed=0)
    assert abs(sr[-1, 0]) <= 0.05
    for mode, got in (("nearest", nearest), ("kahan", kahan), ("stochastic", sr)):
        np.testing.assert_array_equal(got, _reference(mode))  # bit for bit, all 1,000 values
    other = _trajectory(ops, to, back, "stochastic", seed=1)
    assert not np.array_equal(other, sr)
    np.testing.assert_array_equal(other, _reference("stochastic", seed=1))


def test_stochastic_rounding_is_unbiased_and_the_same_everywhere(backend):
    # 256 weights, each its own random stream: their mean ends near 0 (the rounding errors
    # average out; one weight's spread is about 0.045), bit for bit as the reference
    ops, to, back = _kit(backend)
    got = _trajectory(ops, to, back, "stochastic", n=256, seed=3)
    np.testing.assert_array_equal(got, _reference("stochastic", n=256, seed=3))
    assert abs(float(got[-1].mean())) <= 0.01
    assert len(set(got[-1].tolist())) > 50  # the weights took different paths


@pytest.mark.parametrize("mode", ["nearest", "kahan", "stochastic"])
def test_inf_and_nan_stay_themselves(backend, mode):
    ops, to, back = _kit(backend)
    p = to(np.array([np.inf, -np.inf, np.nan, 1.0]))
    c = to(np.zeros(4))
    bits = rounding.random_bits(ops, 0, 0, 0, (4,))
    new, _ = rounding.apply_update(ops, mode, p, ops.f32(np.full(4, -1e-3, np.float32)), c, bits)
    got = back(new)
    assert got[0] == np.inf and got[1] == -np.inf and np.isnan(got[2]) and np.isfinite(got[3])
