"""jax backend, ``overrides``: casting per pytree path and flax's per-module dtypes."""


import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn

import unimp.backends.jax as ujax
from unimp.overrides import OverrideWarning

PARAMS = {"l1": {"w": jnp.ones((4, 8)), "b": jnp.zeros(8)}, "head": [jnp.ones((8, 2)), jnp.int32(3)]}


def _dtypes(tree):
    return jax.tree_util.tree_map(lambda a: str(a.dtype), tree)


def test_layer_paths_are_key_paths():
    assert ujax.layer_paths(PARAMS) == ["head.0", "head.1", "l1.b", "l1.w"]


def test_casts_follow_the_path_and_pass_integers():
    mp = ujax.MixedPrecision("mixed_float16;head:float32")
    assert _dtypes(mp.cast_to_compute(PARAMS)) == {
        "l1": {"w": "float16", "b": "float16"}, "head": ["float32", "int32"]}  # fmt: skip
    h = jnp.ones((2, 8), jnp.float16)
    assert mp.cast_to_compute(h).dtype == jnp.float16  # a bare array: no path, no override
    assert mp.cast_to_compute(h, path="head").dtype == jnp.float32
    mp16 = ujax.MixedPrecision("mixed_bfloat16;head:params=float16,compute=float16")
    params = mp16.prepare(PARAMS)
    assert _dtypes(params)["head"] == ["float16", "int32"] and _dtypes(params)["l1"]["w"] == "float32"


def test_train_step_warns_for_an_unmatched_pattern():
    mp = ujax.MixedPrecision("mixed_bfloat16;haed:float32")
    with pytest.warns(OverrideWarning, match="did you mean 'head'"):
        mp.train_step(lambda p, b: jnp.sum(p["l1"]["w"]), optax.sgd(0.1), PARAMS)


def test_module_kwargs_per_path_in_a_flax_module():
    mp = ujax.MixedPrecision("mixed_bfloat16;head:float32")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(8, name="l1", **mp.module_kwargs("l1"))(x)
            return nn.Dense(2, name="head", **mp.module_kwargs("head"))(h)

    x = jnp.ones((2, 4))
    variables = Net().init(jax.random.key(0), x)
    assert mp.module_kwargs("head") == {"dtype": jnp.float32, "param_dtype": jnp.float32}
    assert mp.module_kwargs() == {"dtype": jnp.bfloat16, "param_dtype": jnp.float32}
    by_layer = mp.trace(lambda v, a: Net().apply(v, a), variables, x).summary()["by_layer"]
    heads = {k: v for k, v in by_layer.items() if "head" in k}
    assert heads and all(set(v) == {"float32"} for v in heads.values()), by_layer
    assert any("l1" in k and set(v) == {"bfloat16"} for k, v in by_layer.items()), by_layer
