"""A block-scaled recipe (unimp.blockscale_recipe.BlockRecipe) swaps the selected Dense / Linear
layers in every framework: the same layers (the FP8 recipes' first/last rule and excludes), each
then computing its matmul as the backend's ``block_scaled_matmul`` (bit for bit, within the
framework), and a layer whose features do not split into the rule's blocks refused before
anything changes (torch ``block_swap``, Keras ``block_swap``, JAX ``block_matmul``)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import require_backend

from unimp.blockscale_recipe import BlockRecipe

WIDTHS = (128, 128, 128, 128, 128)  # four layers fc1..fc4; fp8_block needs multiples of 128


def _x():
    return np.random.default_rng(0).standard_normal((128, WIDTHS[0])).astype(np.float32)


def _torch_model(widths=WIDTHS):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False)))


def _keras_model(widths=WIDTHS):
    import keras

    return keras.Sequential([keras.Input((widths[0],)), *(
        keras.layers.Dense(b, name=f"fc{i + 1}") for i, b in enumerate(widths[1:]))])


@pytest.mark.parametrize("rule", ["mxfp8", "fp8_block", "nvfp4", "mxfp4"])
def test_the_selected_layers_run_the_block_scaled_matmul(backend, rule):
    require_backend(backend)
    recipe = BlockRecipe(rule, seed=2)
    x = _x()
    if backend == "torch":
        import torch

        from unimp.backends.torch.blockscale import (
            BlockScaledLinear,
            block_scaled_matmul,
            block_swap,
        )

        model = _torch_model()
        before = [id(p) for p in model.parameters()]
        assert block_swap(model, recipe) == ("1", "2")
        assert [type(m).__name__ for m in model] == ["Linear", "BlockScaledLinear", "BlockScaledLinear", "Linear"]
        assert [id(p) for p in model.parameters()] == before  # the same Parameters
        assert block_swap(model, recipe) == ("1", "2")  # again: kept
        layer = model[1]
        assert isinstance(layer, BlockScaledLinear) and layer.rule.name == rule
        h = torch.tensor(x)
        got = layer(h)
        want = block_scaled_matmul(h, layer.weight, rule, "out_in", 2, 0) + layer.bias
        np.testing.assert_array_equal(got.detach().numpy(), want.detach().numpy())
        return
    if backend == "tensorflow":
        import tensorflow as tf

        from unimp.backends.tensorflow.blockscale import block_scaled_matmul, block_swap

        model = _keras_model()
        assert block_swap(model, recipe) == ("fc2", "fc3")
        assert block_swap(model, recipe) == ("fc2", "fc3")
        layer = model.get_layer("fc2")
        h = tf.constant(x)
        got = layer(h, training=True)
        assert int(layer.block_step.numpy()) == 1
        want = block_scaled_matmul(h, tf.convert_to_tensor(layer.kernel), rule, "in_out", 2, 0) + layer.bias
        np.testing.assert_array_equal(got.numpy(), want.numpy())
        assert not np.array_equal(got.numpy(), (h @ layer.kernel + layer.bias).numpy())
        return
    import jax.numpy as jnp

    from unimp.backends.jax.blockscale import block_matmul, block_scaled_matmul

    selected = recipe.select([(f"fc{i}", "Dense") for i in range(1, 5)])
    assert selected == ("fc2", "fc3")
    w = jnp.asarray(np.random.default_rng(1).standard_normal((128, 128)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(block_matmul(recipe, selected, "fc2", jnp.asarray(x), w)),
                                  np.asarray(block_scaled_matmul(jnp.asarray(x), w, rule, "in_out", 2, 0)))
    np.testing.assert_array_equal(np.asarray(block_matmul(recipe, selected, "fc1", jnp.asarray(x), w)),
                                  np.asarray(jnp.asarray(x) @ w))


@pytest.mark.parametrize("backend", ["torch", "tensorflow"])  # JAX selects paths, swaps no object
def test_a_layer_whose_features_do_not_split_is_refused_before_anything_changes(backend):
    require_backend(backend)
    widths = (64, 128, 96, 128, 64)  # fc2 is 128 -> 96: N = 96 is no multiple of 128
    recipe = BlockRecipe("fp8_block")
    if backend == "torch":
        from unimp.backends.torch.blockscale import block_swap

        model = _torch_model(widths)
        with pytest.raises(ValueError, match=r"'1' \(N \(out features\) is 96, not a multiple of 128.*exclude"):
            block_swap(model, recipe)
        assert [type(m).__name__ for m in model] == ["Linear"] * 4
        assert block_swap(model, BlockRecipe("mxfp8")) == ("1", "2")  # 96 splits into 32s
        return
    from unimp.backends.tensorflow.blockscale import block_swap

    model = _keras_model(widths)
    with pytest.raises(ValueError, match=r"'fc2' \(N \(out features\) is 96, not a multiple of 128.*exclude"):
        block_swap(model, recipe)
    assert not hasattr(model.get_layer("fc2"), "block_step")
    assert block_swap(model, BlockRecipe("mxfp8")) == ("fc2", "fc3")


def test_keras_block_scaled_dense_saves_and_loads_with_its_rule(tmp_path):
    """A model holding BlockScaledDense saved to .keras loads with its class, rule, seed, kernel
    and step counter, and computes the same outputs (*TensorFlow only*)."""
    require_backend("tensorflow")
    import keras

    from unimp.backends.tensorflow.blockscale import BlockScaledDense

    model = keras.Sequential([keras.Input((128,)), BlockScaledDense(128, rule="nvfp4", seed=5, name="b")])
    x = _x()
    model(x, training=True)  # one training call: block_step 1
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    layer = loaded.get_layer("b")
    assert isinstance(layer, BlockScaledDense)
    assert (layer.rule.name, layer.seed, int(layer.block_step.numpy())) == ("nvfp4", 5, 1)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(model(x)))


@pytest.mark.parametrize("rule", ["mxfp8", "nvfp4"])
def test_keras_predict_runs_a_partial_last_batch_through_the_block_layers(rule):
    """Keras's predict traces its last, partial batch with an unknown batch size: the forward
    GEMM quantizes nothing along the batch, so it runs; a training call with an unknown batch
    is refused, naming the fix (*TensorFlow only*)."""
    require_backend("tensorflow")
    import keras
    import tensorflow as tf

    from unimp.backends.tensorflow.blockscale import BlockScaledDense, block_scaled_matmul

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), BlockScaledDense(64, rule=rule), BlockScaledDense(32, rule=rule)])
    x = np.random.default_rng(0).standard_normal((100, 64)).astype(np.float32)
    y = model.predict(x, batch_size=32, verbose=0)  # batches of 32, 32, 32 and 4 rows
    assert y.shape == (100, 32) and np.isfinite(y).all()
    # per batch as predict ran it (NVFP4's global scale is the batch's): the same bits
    np.testing.assert_array_equal(y[96:], model.predict(x[96:], batch_size=32, verbose=0))
    np.testing.assert_array_equal(y[:96], model.predict(x[:96], batch_size=32, verbose=0))
    unknown = tf.function(lambda a, w: block_scaled_matmul(a, w, rule), input_signature=[
        tf.TensorSpec((None, 64)), tf.TensorSpec((64, 64))])
    with pytest.raises(ValueError, match="not fully known.*input_signature with the batch size"):
        unknown(x[:32], model.layers[0].kernel)
