"""jax backend, ``casting``: dtype mapping and cast_tree (and module mode / master weights in torch)."""


import jax.numpy as jnp
import numpy as np
import pytest

import unimp.backends.jax as ujax
from backends.jax.helpers import HALF, RECIPE


@pytest.mark.parametrize(
    "name,expected", [("bf16", jnp.bfloat16), ("float16", jnp.float16), ("f32", jnp.float32)]
)
def test_to_dtype(name, expected):
    assert ujax.to_dtype(name) == jnp.dtype(expected)


def test_float64_without_x64_names_the_fix():
    with pytest.raises(ValueError, match="jax_enable_x64"):
        ujax.MixedPrecision("float64")


@pytest.mark.parametrize("half", HALF)
def test_cast_to_compute_floats_only(half):
    mp = ujax.MixedPrecision(RECIPE[half])
    tree = {
        "w": jnp.ones(3, jnp.float32),
        "i": jnp.arange(3, dtype=jnp.int32),
        "b": jnp.array([True]),
        "np": np.ones(2, np.float32),
        "py_float": 1.5,
        "py_int": 3,
        "name": "dense",
    }
    out = mp.cast_to_compute(tree)
    assert out["w"].dtype == jnp.dtype(half)
    assert out["i"].dtype == jnp.int32
    assert out["b"].dtype == jnp.bool_
    assert isinstance(out["np"], np.ndarray) and out["np"].dtype == jnp.dtype(half)
    assert out["py_float"] == 1.5 and type(out["py_float"]) is float
    assert out["py_int"] == 3 and out["name"] == "dense"


def test_cast_right_value_float32_int32_to_float16():
    out = ujax.cast_tree({"a": jnp.ones(2, jnp.float32), "b": jnp.ones(2, jnp.int32)}, "float16")
    assert (out["a"].dtype, out["b"].dtype) == (jnp.float16, jnp.int32)


@pytest.mark.parametrize("half", HALF)
def test_cast_to_param_and_output(half):
    mp = ujax.MixedPrecision(RECIPE[half])
    x = {"h": jnp.ones(2, half), "n": jnp.int32(1)}
    assert mp.cast_to_param(x)["h"].dtype == jnp.float32
    assert mp.cast_to_output(x)["h"].dtype == jnp.float32
    assert mp.cast_to_output(x)["n"].dtype == jnp.int32


def test_cast_tree_bad_dtype():
    with pytest.raises(ValueError, match="expected one of"):
        ujax.cast_tree(jnp.ones(2), "int8")
