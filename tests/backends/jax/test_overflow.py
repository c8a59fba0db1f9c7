"""jax backend, ``overflow``: what JAX adds to all_finite (Python floats are leaves, replica
agreement through ``axis_name``) and ``select_tree``. The rule itself (every backend) is in
tests/conformance/test_all_finite_conformance.py."""


import jax
import jax.numpy as jnp
import pytest

import unimp.backends.jax as ujax
from backends.jax.helpers import tree_bits


def test_all_finite_reads_python_floats_as_leaves():
    # a pytree's Python floats are leaves in JAX (torch and TensorFlow pass them by)
    out = ujax.all_finite((1.0, float("inf")))
    assert out.dtype == jnp.bool_ and out.shape == () and bool(out) is False


def test_all_finite_axis_name_agrees_across_replicas():
    x = jnp.array([[1.0, 2.0], [jnp.nan, 0.0], [3.0, 4.0]])
    local = jax.vmap(ujax.all_finite)(x)
    shared = jax.vmap(lambda r: ujax.all_finite(r, axis_name="i"), axis_name="i")(x)
    assert local.tolist() == [True, False, True]
    assert shared.tolist() == [False, False, False]


def test_select_tree_is_bitwise():
    a = {"x": jnp.array([-0.0, jnp.nan]), "n": jnp.int32(1)}
    b = {"x": jnp.array([1.0, 2.0]), "n": jnp.int32(2)}
    assert tree_bits(ujax.select_tree(jnp.array(True), a, b)) == tree_bits(a)
    assert tree_bits(jax.jit(ujax.select_tree)(jnp.array(False), a, b)) == tree_bits(b)


@pytest.mark.parametrize(
    "pred,a,b,match",
    [
        (jnp.array([True]), jnp.ones(1), jnp.ones(1), "bool scalar"),
        (jnp.float32(1), jnp.ones(1), jnp.ones(1), "bool scalar"),
        (True, {"a": jnp.ones(1)}, {"b": jnp.ones(1)}, "structure"),
        (True, jnp.ones(1), jnp.ones(1, jnp.float16), "differs"),
    ],
    ids=["shape", "dtype", "structure", "leaf-dtype"],
)
def test_select_tree_errors(pred, a, b, match):
    with pytest.raises(ValueError, match=match):
        ujax.select_tree(pred, a, b)
