"""An FP8 recipe applies itself: each backend's prepared model (torch ``mp.prepare``, Keras
``mp.prepare``, flax ``mp.module_kwargs(path)`` and plain JAX ``mp.fp8_matmul``) runs float8
matmuls in the layers :meth:`unimp.fp8.recipe.FP8Recipe.select` picks, under the same names."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import require_backend

import unimp
from unimp import fp8

#: in model order: a -> relu -> mlp.fc1 -> relu -> mlp.fc2 -> out (Dense/Linear, 8-16-16-16-4)
LAYERS = (("a", 8, 16), ("mlp.fc1", 16, 16), ("mlp.fc2", 16, 16), ("out", 16, 4))
SELECTED = ("mlp.fc1", "mlp.fc2")  # first and last out by default


def _weights():
    # multiples of 1/8 up to 0.875: exact in bfloat16, so max|W| is 0.875 wherever the kernel is
    # read (flax's Dense casts it to the compute dtype first), and the kernel scale after one
    # step is 448 / 0.875 = 512 exactly
    rng = np.random.default_rng(0)
    out = {}
    for name, i, o in LAYERS:
        w = rng.integers(-7, 8, size=(i, o)).astype(np.float32) / 8
        w[0, 0] = 0.875
        out[name] = w
    return out


def _x():
    return np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)


def _torch(recipe):
    import torch

    w = _weights()

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.mlp, self.out = torch.nn.Linear(8, 16), Mlp(), torch.nn.Linear(16, 4)

        def forward(self, x):
            h = torch.relu(self.a(x))
            h = torch.relu(self.mlp.fc1(h))
            return self.out(self.mlp.fc2(h))

    net = Net()
    mods = dict(net.named_modules())
    with torch.no_grad():
        for name, _, _ in LAYERS:
            mods[name].weight.copy_(torch.from_numpy(w[name].T.copy()))
    mp = unimp.mixed_precision(recipe, backend="torch", device="cpu")
    before = mp.fp8_layers(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    params = [id(p) for p in net.parameters()]
    net, opt = mp.prepare(net, opt)
    assert [id(p) for p in net.parameters()] == params  # the optimizer's Parameters, shared
    net(torch.from_numpy(_x())).float().sum().backward()
    mods = dict(net.named_modules())
    states = {n: {t: float(getattr(mods[n], f"{t}_scale")) for t in ("input", "kernel", "grad")}
              for n in SELECTED if hasattr(mods[n], "input_scale")}
    fp8_kinds = sorted(n for n, m in mods.items() if type(m).__name__ == "FP8Dense")
    return before, mp.fp8_layers(net), fp8_kinds, states


def _tensorflow(recipe):
    import keras
    import tensorflow as tf

    w = _weights()
    mp = unimp.mixed_precision(recipe, backend="tensorflow")
    with mp.autocast():
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="a"),
            keras.Sequential([keras.layers.Dense(16, activation="relu", name="fc1"),
                              keras.layers.Dense(16, name="fc2")], name="mlp"),
            keras.layers.Dense(4, name="out")])
    layers = {"a": model.get_layer("a"), "mlp.fc1": model.get_layer("mlp").get_layer("fc1"),
              "mlp.fc2": model.get_layer("mlp").get_layer("fc2"), "out": model.get_layer("out")}
    for name, _, _ in LAYERS:
        layers[name].kernel.assign(w[name])
    before = mp.fp8_layers(model)
    mp.prepare(model)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.cast(model(_x(), training=True), tf.float32))
    grads = tape.gradient(loss, model.trainable_variables)
    assert all(g is not None for g in grads)
    states = {n: {t: float(getattr(layers[n], f"{t}_scale").numpy()) for t in ("input", "kernel", "grad")}
              for n in SELECTED if hasattr(layers[n], "input_scale")}
    with_states = sorted(n for n, layer in layers.items() if hasattr(layer, "input_scale"))
    return before, mp.fp8_layers(model), with_states, states


def _jax(recipe):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    w = _weights()
    mp = unimp.mixed_precision(recipe, backend="jax")
    selected = mp.fp8_layers([name for name, _, _ in LAYERS])

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, h):
            h = nn.relu(nn.Dense(16, name="fc1", **mp.module_kwargs("mlp.fc1"))(h))
            return nn.Dense(16, name="fc2", **mp.module_kwargs("mlp.fc2"))(h)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.Dense(16, name="a", **mp.module_kwargs("a"))(x))
            return nn.Dense(4, name="out", **mp.module_kwargs("out"))(Mlp(name="mlp")(h))

    x = jnp.asarray(_x())
    variables = Net().init(jax.random.PRNGKey(0), x)
    params = jax.tree_util.tree_map(lambda v: v, variables["params"])
    for name, _, _ in LAYERS:
        scope = params
        for part in name.split("."):
            scope = scope[part]
        scope["kernel"] = jnp.asarray(w[name])
    variables = {**variables, "params": params}
    grads = jax.jit(jax.grad(lambda v: Net().apply(v, x).astype(jnp.float32).sum()))(variables)
    new = grads["_overwrite_with_gradient"]["mlp"]
    states = {f"mlp.{n}": {t: float(new[n]["Fp8DotGeneral_0"][f"{t}_scale"]) for t in ("input", "kernel", "grad")}
              for n in ("fc1", "fc2")}
    with_states = sorted(f"mlp.{n}" for n in new) + sorted(
        n for n in ("a", "out") if n in grads["_overwrite_with_gradient"])
    # plain JAX: the same selection through mp.fp8_states / mp.fp8_matmul
    st = mp.fp8_states()
    assert sorted(st) == list(SELECTED)
    new_st = jax.jit(jax.grad(lambda s: mp.fp8_matmul(s, "mlp.fc1", jnp.ones((5, 16)), jnp.asarray(w["mlp.fc1"])).sum()))(st)
    assert float(new_st["mlp.fc1"][1].scale) == 512.0
    return selected, selected, with_states, states


@pytest.mark.parametrize("recipe", ["fp8-delayed", "fp8-current"])
def test_prepared_model_runs_float8_in_the_selected_layers(backend, recipe):
    require_backend(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        before, after, swapped, states = {"torch": _torch, "tensorflow": _tensorflow, "jax": _jax}[backend](recipe)
    assert before == after == SELECTED
    assert swapped == list(SELECTED)
    for name in SELECTED:
        s = states[name]
        if recipe == "fp8-delayed":  # the scale after one step: 448 / max|W|, the kernel read once
            assert s["kernel"] == 512.0, name
        assert s["input"] != 1.0 and s["grad"] != 1.0, (name, s)


def test_binding_an_fp8_recipe_no_longer_warns(backend):
    require_backend(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        mp = unimp.mixed_precision("fp8", backend=backend)
    assert mp.recipe.fp8 is not None
    assert mp.fp8_layers([] if backend == "jax" else _empty_model(backend)) == ()


def _empty_model(backend):
    if backend == "torch":
        import torch

        return torch.nn.Sequential()
    import keras

    return keras.Sequential([keras.Input((2,))])


def test_keras_weights_of_a_prepared_model_save_and_load(tmp_path):
    # Keras's Dense saves its kernel and bias only; a swapped Dense counts its scaling states
    # too when loading: save_weights -> load_weights into a prepared model failed on the count.
    # The weights load, the states stay; a .keras file still loads as the plain model.
    require_backend("tensorflow")
    import keras

    mp = unimp.mixed_precision("fp8-delayed", backend="tensorflow")

    def build():
        with mp.autocast():
            m = keras.Sequential([keras.Input((16,)), *(keras.layers.Dense(16, name=f"d{i}") for i in range(3))])
        return mp.prepare(m, keras.optimizers.Adam(1e-3))

    model, opt = build()
    step = mp.train_step(model, opt, lambda m, b: keras.ops.mean((m(b[0], training=True) - b[1]) ** 2))
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            step((rng.standard_normal((8, 16)).astype(np.float32), np.zeros((8, 16), np.float32)))
    trained = model.layers[1].input_scale.numpy()
    assert trained != 1.0  # the middle layer runs float8 and its scale moved
    model.save_weights(tmp_path / "w.weights.h5")
    other, _ = build()
    other.load_weights(tmp_path / "w.weights.h5")
    for a, b in zip(other.layers, model.layers, strict=True):
        for va, vb in zip(a.weights[:2], b.weights[:2], strict=True):
            np.testing.assert_array_equal(va.numpy(), vb.numpy())
    assert other.layers[1].input_scale.numpy() == 1.0  # the states are not in Keras's file
    model.save(tmp_path / "m.keras")
    plain = keras.models.load_model(tmp_path / "m.keras")
    assert [len(layer.weights) for layer in plain.layers] == [2, 2, 2]
