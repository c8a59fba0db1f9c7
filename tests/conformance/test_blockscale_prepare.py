"""The block-scaled recipes (``mxfp8``, ``fp8-block``, ``nvfp4``, ``mxfp4``) bound by
``unimp.mixed_precision`` put their rule into the selected layers in every framework: torch's
and Keras's ``prepare`` swap the middle two of four Dense / Linear layers (the FP8 recipes'
first/last rule), and a training step runs through them; JAX's ``fp8_layers`` selects the same
paths and ``block_matmul`` / ``module_kwargs`` run the rule there."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import require_backend

import unimp
from unimp import blockscale_linear as bl

RECIPES = ["mxfp8", "fp8-block", "nvfp4", "mxfp4"]
WIDTH, BATCH = 128, 128  # fp8-block blocks every GEMM axis by 128


def _batch():
    rng = np.random.default_rng(0)
    return rng.standard_normal((BATCH, WIDTH)).astype(np.float32), rng.standard_normal((BATCH, WIDTH)).astype(np.float32)


@pytest.mark.parametrize("recipe", RECIPES)
def test_prepare_swaps_the_selected_layers_and_a_step_trains_through_them(backend, recipe):
    require_backend(backend)
    mp = unimp.mixed_precision(recipe, backend=backend)
    rule = bl.BLOCK_LINEAR_RULES[mp.recipe.block.rule.name]
    assert rule.name == recipe.replace("-", "_")
    x, t = _batch()
    if backend == "torch":
        import torch

        from unimp.backends.torch.blockscale import BlockScaledLinear

        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        assert mp.fp8_layers(model) == ("1", "2")  # the layers prepare will swap, named as after
        model, opt = mp.prepare(model, opt)
        assert [type(m) for m in model] == [torch.nn.Linear, BlockScaledLinear, BlockScaledLinear, torch.nn.Linear]
        assert mp.fp8_layers(model) == ("1", "2")
        step = mp.train_step(model, opt, lambda m, b: torch.nn.functional.mse_loss(m(b[0]).float(), b[1]))
        before = model[1].weight.detach().clone()
        result = step((torch.tensor(x), torch.tensor(t)))
        assert np.isfinite(float(result.loss))
        assert not torch.equal(before, model[1].weight.detach())
        assert int(model[1].block_step) == 1
        return
    if backend == "tensorflow":
        import keras

        with mp.autocast():
            model = keras.Sequential([keras.Input((WIDTH,)), *(keras.layers.Dense(WIDTH, name=f"fc{i}") for i in range(4))])
        assert mp.fp8_layers(model) == ("fc1", "fc2")  # the layers prepare will swap
        model, opt = mp.prepare(model, keras.optimizers.SGD(0.1))
        swapped = [layer.name for layer in model.layers if hasattr(layer, "block_step")]
        assert swapped == ["fc1", "fc2"] and mp.fp8_layers(model) == ("fc1", "fc2")
        step = mp.train_step(model, opt, lambda m, b: keras.ops.mean(
            (keras.ops.cast(m(b[0], training=True), "float32") - b[1]) ** 2))
        before = np.array(model.get_layer("fc1").kernel.numpy())
        result = step((x, t))
        assert np.isfinite(float(result.loss))
        assert not np.array_equal(before, model.get_layer("fc1").kernel.numpy())
        assert int(model.get_layer("fc1").block_step.numpy()) == 1
        return
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from unimp.backends.jax.blockscale import block_scaled_matmul

    assert mp.fp8_layers([f"fc{i}" for i in range(4)]) == ("fc1", "fc2")
    w = jnp.asarray(np.random.default_rng(1).standard_normal((WIDTH, WIDTH)).astype(np.float32))
    xb = jnp.asarray(x, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(mp.block_matmul("fc1", xb, w, 3), np.float32), np.asarray(
        block_scaled_matmul(xb, w, rule, "in_out", 0, 3), np.float32))
    np.testing.assert_array_equal(np.asarray(mp.block_matmul("fc0", xb, w), np.float32), np.asarray(xb @ w, np.float32))
    # a given step: dot_general=; nvfp4 without one keeps a counter (tests/backends/jax/test_block_flax_step.py)
    assert "dot_general" in mp.module_kwargs("fc1", step=0) and "dot_general" not in mp.module_kwargs("fc0")
    dense = nn.Dense(WIDTH, **mp.module_kwargs("fc1"))
    params = dense.init(jax.random.PRNGKey(0), jnp.asarray(x))
    y = dense.apply(params, jnp.asarray(x))
    assert y.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))


def test_the_recipes_round_trip_and_refuse_what_they_cannot_run():
    r = unimp.get_recipe("nvfp4")
    assert r.block.rule.name == "nvfp4" and r.fp8 is None and r.policy.compute_dtype == "bfloat16"
    assert unimp.Recipe.from_dict(r.to_dict()) == r
    assert unimp.get_recipe("mxfp8", block=None).block is None
    with pytest.raises(ValueError, match="give fp8= or block=, not both"):
        unimp.get_recipe("fp8", block={"rule": "mxfp8"})
    with pytest.raises(ValueError, match="runs with bfloat16 compute"):
        unimp.Recipe("mixed_float16", block={"rule": "mxfp4"})
    with pytest.raises(ValueError, match="Did you mean the block-scaled recipe 'nvfp4'"):
        unimp.get_recipe("nvfp5")


def test_keras_class_on_the_tensorflow_engine_refuses_before_anything_changes():
    """unimp.keras's MixedPrecision swaps block-scaled layers on Keras's JAX and torch engines
    (tests/test_keras_backends.py); bound directly on Keras's TensorFlow engine it refuses in
    prepare, naming the TensorFlow backend's class (what backend='keras' binds there), and
    leaves the model alone, which that class then prepares (*TensorFlow only*)."""
    require_backend("tensorflow")
    import keras

    from unimp.keras.mixed_precision import MixedPrecision as KerasMixedPrecision

    mp = unimp.mixed_precision("mxfp8", backend="tensorflow")
    with mp.autocast():
        model = keras.Sequential([keras.Input((WIDTH,)), *(keras.layers.Dense(WIDTH, name=f"fc{i}") for i in range(4))])
    with pytest.raises(ValueError, match="on Keras's 'tensorflow' engine.*backend='tensorflow'"):
        KerasMixedPrecision("mxfp8").prepare(model, keras.optimizers.SGD(0.1))
    assert not any(hasattr(layer, "block_step") for layer in model.layers)
    mp.prepare(model, keras.optimizers.SGD(0.1))  # refused before anything changed: it prepares now
    assert [layer.name for layer in model.layers if hasattr(layer, "block_step")] == ["fc1", "fc2"]
