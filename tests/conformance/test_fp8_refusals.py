"""What every backend's FP8 surface refuses, the same way: a float8 layer shared by several call
sites, a model argument of the wrong type, a bad layer config."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import require_backend

import unimp
from unimp import fp8
from unimp.attached import peek
from unimp.fp8.recipe import FP8Recipe


def _shared_model(backend, mp):
    """Dense/Linear a -> shared -> shared (the same layer object) -> b (built under ``mp``'s
    autocast); the shared layer's path."""
    if backend == "torch":
        import torch

        shared = torch.nn.Linear(4, 4)
        return torch.nn.Sequential(torch.nn.Linear(4, 4), shared, shared, torch.nn.Linear(4, 4)), "1"
    import keras

    with mp.autocast():
        shared = keras.layers.Dense(4, name="shared")
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="a"), shared, shared,
                                  keras.layers.Dense(4, name="b")])
    return model, "shared"


def _optimizer(backend, model):
    if backend == "torch":
        import torch

        return torch.optim.SGD(model.parameters(), lr=0.1)
    import keras

    return keras.optimizers.SGD(0.1)


def _fp8_kinds(backend, model):
    if backend == "torch":
        return [type(m).__name__ for m in model]
    return [peek(layer, "fp8_config", None) is not None for layer in model.layers]


# JAX's fp8_layers takes paths, not objects: a flax module shared between call sites has one path
@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_a_shared_float8_layer_is_refused_naming_its_places(backend):
    require_backend(backend)
    mp = unimp.mixed_precision("fp8", backend=backend)
    model, path = _shared_model(backend, mp)
    before = _fp8_kinds(backend, model)
    with pytest.raises(ValueError, match=f"shared by several call sites: '{path}' runs at"):
        mp.fp8_layers(model)
    with pytest.raises(ValueError, match="own layer, or keep the shared one out of float8"):
        mp.prepare(model, _optimizer(backend, model))
    assert _fp8_kinds(backend, model) == before  # nothing swapped
    kept_out = unimp.mixed_precision(
        unimp.get_recipe("fp8", fp8=FP8Recipe(exclude=(path,), exclude_first_last=False)), backend=backend)
    assert path not in kept_out.fp8_layers(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        kept_out.prepare(model, _optimizer(backend, model))


@pytest.mark.parametrize("model", ["abc", [1, 2, 3], None], ids=["str", "ints", "none"])
def test_fp8_layers_refuses_what_is_not_a_model_naming_the_argument(backend, model):
    mp = unimp.mixed_precision("fp8", backend=backend)
    takes = {"torch": "a torch.nn.Module", "tensorflow": "a keras.Model",
             "jax": "a list of dotted layer paths|layers\\[0\\] must be a dotted path"}[backend]
    with pytest.raises(TypeError, match=rf"mp\.fp8_layers\((model|layers)\)(:| takes) .*({takes})"):
        mp.fp8_layers(model)


def _fp8_dense(backend, *sizes, **kwargs):
    mod = require_backend(backend)
    if backend == "torch":
        return mod.FP8Dense(*sizes, **kwargs)
    return mod.FP8Dense(*sizes[1:], **{"use_bias" if k == "bias" else k: v for k, v in kwargs.items()})


@pytest.mark.parametrize(
    ("sizes", "kwargs", "error", "match"),
    [((3, 2.7), {}, TypeError, r"(out_features|units) must be an int, got float 2.7"),
     ((3, "4"), {}, TypeError, r"(out_features|units) must be an int, got str '4'"),
     ((3, True), {}, TypeError, r"(out_features|units) must be an int, got bool"),
     ((3, 0), {}, ValueError, r"(out_features|units) must be a positive int, got 0"),
     ((3, 4), {"bias": "no"}, TypeError, r"(bias|use_bias) must be True or False, got str 'no'"),
     ((3, 4), {"bias": 1}, TypeError, r"(bias|use_bias) must be True or False, got int 1")],
    ids=["float", "str", "bool", "zero", "bias-str", "bias-int"],
)
@pytest.mark.parametrize("backend", ["torch", "tensorflow"])  # JAX's float8 is a dot_general
def test_fp8_dense_refuses_sizes_and_flags_it_would_coerce(backend, sizes, kwargs, error, match):
    with pytest.raises(error, match=f"FP8Dense: {match}"):
        _fp8_dense(backend, *sizes, **kwargs)


def test_torch_fp8_dense_refuses_a_float_in_features():
    with pytest.raises(TypeError, match="FP8Dense: in_features must be an int, got float 3.0"):
        _fp8_dense("torch", 3.0, 4)


def test_keras_fp8_dense_saves_and_loads_with_its_config(tmp_path):
    require_backend("tensorflow")
    import keras

    config = fp8.DelayedScaling(amax_history_len=16, margin=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        layer = _fp8_dense("tensorflow", 3, 4, config=config, native=False)
        model = keras.Sequential([keras.Input((3,)), layer])
        x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
        model(x, training=True)  # one step: states differ from the initial ones
        model.save(tmp_path / "m.keras")
        loaded = keras.models.load_model(tmp_path / "m.keras")
        got = loaded.layers[-1]
        assert type(got) is type(layer) and got.config == config and got.native is False
        assert got.units == 4 and got.use_bias is True
        np.testing.assert_array_equal(got.input_amax_history.numpy(), layer.input_amax_history.numpy())
        np.testing.assert_array_equal(loaded(x).numpy(), model(x).numpy())


@pytest.mark.parametrize("config", ["fp8", unimp.DynamicLossScale()], ids=["preset-name", "loss-scale"])
def test_fp8_layer_refuses_a_config_that_is_not_a_scaling_config(backend, config):
    mod = require_backend(backend)
    hint = r"unimp\.fp8\.fp8_preset\('fp8'\)" if isinstance(config, str) else r"unimp\.fp8\.fp8_preset\("
    where = "fp8_dot_general" if backend == "jax" else "FP8Dense"
    with pytest.raises(TypeError, match=rf"{where}: config must be a unimp\.fp8\.DelayedScaling or "
                                        rf"CurrentScaling \(e\.g\. {hint}"):
        if backend == "jax":
            state = mod.fp8_initial_state(fp8.DelayedScaling())
            mod.fp8_dot_general(config, state, state, state)
        else:
            _fp8_dense(backend, 4, 4, config=config)


def _first_fp8_call(backend):
    """Builds one float8 layer and calls it once, from this file; returns the line of the call
    and its result."""
    import inspect

    mod = require_backend(backend)
    if backend == "torch":
        import torch

        layer, x = mod.FP8Dense(4, 4), torch.ones(2, 4)
        return inspect.currentframe().f_lineno, layer(x)
    if backend == "tensorflow":
        layer, x = mod.FP8Dense(4), np.ones((2, 4), np.float32)
        return inspect.currentframe().f_lineno, layer(x, training=True)
    state = mod.fp8_initial_state(fp8.DelayedScaling())
    return inspect.currentframe().f_lineno, mod.fp8_dot_general(fp8.DelayedScaling(), state, state, state)


def test_emulation_warning_points_at_the_users_line(backend):
    from unimp.fp8 import layers as fp8_config

    fp8_config._EMULATION_WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line, _ = _first_fp8_call(backend)
    got = [(w.filename, w.lineno) for w in caught if issubclass(w.category, fp8.FP8EmulationWarning)]
    assert got == [(__file__, line)]  # not torch's module.py, Keras's layer.py or unimp's own files


def test_emulation_warning_under_tf_function_points_at_the_users_call():
    # tf.function traces an AutoGraph-converted copy of the function, from a temp file: the
    # warning skips it and names the line that called the function
    import inspect

    from unimp.fp8 import layers as fp8_config

    mod = require_backend("tensorflow")
    import tensorflow as tf

    layer = mod.FP8Dense(4)

    @tf.function
    def fwd(x):
        return layer(x, training=True) * 2.0

    fp8_config._EMULATION_WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        fwd(tf.ones((2, 4)))
    got = [(w.filename, w.lineno) for w in caught if issubclass(w.category, fp8.FP8EmulationWarning)]
    assert got == [(__file__, line)]


# JAX's prepare is a pure function of a params pytree (nothing to mark): the same params give
# the same result each time
@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_preparing_a_model_twice_is_refused(backend):
    require_backend(backend)
    mp = unimp.mixed_precision("fp8", backend=backend)
    if backend == "torch":
        import torch

        model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))
    else:
        import keras

        with mp.autocast():
            model = keras.Sequential([keras.Input((4,)), *(keras.layers.Dense(4) for _ in range(3))])
    mp.prepare(model, _optimizer(backend, model))
    with pytest.raises(ValueError, match=r"this model was already prepared; prepare\(\) applies the recipe once"):
        mp.prepare(model, _optimizer(backend, model))
