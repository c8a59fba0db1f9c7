"""tensorflow backend, ``overrides``: covered Keras layers given their override's dtype policy."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import pytest
import tensorflow as tf

import unimp.backends.tensorflow as utf
import unimp.keras.overrides as keras_overrides
from unimp.attached import peek


def _model(mp):
    with mp.autocast():
        x = keras.Input((4,))
        h = keras.layers.Dense(8, name="l1")(x)
        mlp = keras.Sequential([keras.layers.Dense(8, name="fc1"), keras.layers.Dense(8, name="fc2")], name="mlp")
        y = keras.layers.Dense(2, name="head")(mlp(h))
        return keras.Model(x, y)


def _policies(model):
    return {p: layer.dtype_policy.name for p, layer in keras_overrides._walk(model)}


def test_layer_paths_are_names_from_the_model_down():
    assert utf.layer_paths(_model(utf.MixedPrecision("mixed_float16"))) == ["l1", "mlp", "mlp.fc1", "mlp.fc2", "head"]


def test_dtype_policy_map_is_keyed_by_layer_path():
    mp = utf.MixedPrecision("mixed_float16;mlp:bfloat16;head:float32")
    m = utf.dtype_policy_map(mp, _model(mp))
    assert isinstance(m, keras.dtype_policies.DTypePolicyMap)
    assert {k: m[k].name for k in m} == {"mlp": "mixed_bfloat16", "mlp/fc1": "mixed_bfloat16",
                                         "mlp/fc2": "mixed_bfloat16", "head": "float32"}  # fmt: skip
    assert m["l1"].name == "mixed_float16"  # the default: the recipe's policy


def test_prepare_gives_covered_layers_their_policy_and_they_compute_in_it():
    mp = utf.MixedPrecision("mixed_float16;mlp.fc2:bfloat16;head:float32")
    model = _model(mp)
    mp.prepare(model, "sgd")
    assert _policies(model) == {"l1": "mixed_float16", "mlp": "mixed_float16", "mlp.fc1": "mixed_float16",
                                "mlp.fc2": "mixed_bfloat16", "head": "float32"}  # fmt: skip
    by_layer = mp.trace(lambda a: model(a), tf.ones((2, 4)), model=model).summary()["by_layer"]
    assert set(by_layer["head"]) == {"float32"} and set(by_layer["mlp/fc2"]) == {"bfloat16"}


def test_an_output_dtype_other_than_compute_casts_the_layer_outputs():
    mp = utf.MixedPrecision("mixed_float16;head:mixed_bfloat16")  # bfloat16 maths, float32 out
    model = _model(mp)
    mp.prepare(model)
    head = model.get_layer("head")
    assert head.compute_dtype == "bfloat16"
    assert head(tf.ones((1, 8))).dtype == tf.float32


@pytest.mark.parametrize(
    ("recipe", "match"),
    [
        ("mixed_float16;l*:float32;l1:bfloat16", r"conflict at 'l1'"),
        ("mixed_float16;head:params=bfloat16", r"layer 'head' gets .*variables stay float32"),
    ],
)
def test_bad_overrides_change_nothing(recipe, match):
    mp = utf.MixedPrecision(recipe)
    model = _model(mp)
    with pytest.raises(ValueError, match=match):
        mp.prepare(model, "sgd", loss="mse")
    assert set(_policies(model).values()) == {"mixed_float16"}
    assert getattr(model, "optimizer", None) is None and peek(model, "output_dtype") is None


def test_train_step_applies_the_overrides_to_a_model_not_prepared():
    mp = utf.MixedPrecision("mixed_bfloat16;head:float32")
    model = _model(mp)
    mp.train_step(model, "sgd", lambda m, b: tf.reduce_mean(tf.cast(m(b), tf.float32)))
    assert _policies(model)["head"] == "float32" and _policies(model)["l1"] == "mixed_bfloat16"
