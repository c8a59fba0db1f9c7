"""tensorflow backend, ``mixed_precision``: the recipe bound to the framework (autocast, prepare, examples).
The exports and the bound dtypes (every backend) are in tests/conformance/test_backend_api.py."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import json
import math
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import unimp
import unimp.backends.tensorflow as utf
from backends.tensorflow.helpers import Vec, lso
from unimp.loss_scale import StaticLossScale


def seed_model(mp, head_dtype=None):
    """The seeds' MLP; ``head_dtype=mp.output_dtype_policy`` is the Keras guide's float32 head."""
    with mp.autocast():
        return keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dropout(0.2),
                keras.layers.Dense(10, activation="softmax", dtype=head_dtype),
            ]
        )


def op_dtypes(model, x, op_type):
    fn = tf.function(lambda x: model(x, training=False))
    graph = fn.get_concrete_function(tf.TensorSpec(x.shape, x.dtype)).graph
    return [op.get_attr("T").name for op in graph.get_operations() if op.type == op_type]


@pytest.mark.parametrize(
    "policy, half", [("mixed_float16", "float16"), ("mixed_bfloat16", "bfloat16")]
)
def test_dtype_audit(policy, half):
    mp = unimp.mixed_precision(policy, backend="tensorflow")
    model = seed_model(mp)
    mp.prepare(model)
    assert all(v.dtype == "float32" for v in model.weights)
    x = tf.random.uniform((4, 784))
    # every layer computes in the compute dtype, the output layer too (as torch and JAX); the
    # model's output is cast to the output dtype
    assert op_dtypes(model, x, "MatMul") == [half, half]
    assert op_dtypes(model, x, "Softmax") == [half]
    assert model(x).dtype == tf.float32
    hidden = model.layers[0](x)
    assert hidden.dtype == utf.to_dtype(half)


def test_prepare_casts_outputs_and_a_float32_output_layer_is_the_users_choice():
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    model = seed_model(mp)
    x = tf.random.uniform((2, 784))
    assert model(x).dtype == tf.float16
    mp.prepare(model)
    assert op_dtypes(model, x, "Softmax") == ["float16"] and model(x).dtype == tf.float32
    # the Keras guide's float32 output layer, said in the model
    with mp.autocast():
        guide = keras.Sequential([keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(10, activation="softmax",
                                                     dtype=mp.output_dtype_policy)])
    mp.prepare(guide)
    assert op_dtypes(guide, x, "Softmax") == ["float32"] and guide(x).dtype == tf.float32


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_autocast_sets_and_restores_policy_even_on_exception(policy):
    mp = unimp.mixed_precision(policy, backend="tensorflow")
    before = keras.config.dtype_policy()
    assert isinstance(mp.dtype_policy, keras.DTypePolicy) and mp.dtype_policy.name == policy
    with pytest.raises(RuntimeError, match="boom"):
        with mp.autocast() as active:
            assert keras.config.dtype_policy().name == policy == active.name
            layer = keras.layers.Dense(2)
            raise RuntimeError("boom")
    assert keras.config.dtype_policy() == before
    assert layer.compute_dtype == policy.split("_")[1] and layer.variable_dtype == "float32"


def test_batchnorm_statistics_in_float32():
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    with mp.autocast():
        bn = keras.layers.BatchNormalization()
    x = tf.cast(tf.linspace(0.0, 600.0, 64)[:, None], tf.float16)  # x**2 overflows float16
    y = bn(x, training=True)
    assert bn.moving_mean.dtype == "float32"
    assert y.dtype == tf.float16 and bool(utf.all_finite(y))
    assert float(bn.moving_variance.numpy()[0]) > 1.0


def test_integer_inputs_and_labels_never_cast():
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    with mp.autocast():
        model = keras.Sequential(
            [
                keras.Input((5,), dtype="int32"),
                keras.layers.Embedding(50, 8),
                keras.layers.Flatten(),
                keras.layers.Dense(3),
            ]
        )
    model, _ = mp.prepare(
        model, "sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    ids = tf.constant(np.random.randint(0, 50, (16, 5)), tf.int32)
    labels = tf.constant(np.random.randint(0, 3, 16), tf.int32)
    assert mp.cast_to_compute((ids, labels)) == (ids, labels)
    out = model(ids)
    assert out.dtype == tf.float32
    model.fit(ids, labels, epochs=1, batch_size=8, verbose=0)
    assert labels.dtype == tf.int32


@pytest.mark.parametrize(
    "policy, jit_compile",
    [("mixed_float16", False), ("mixed_float16", True), ("mixed_bfloat16", False)],
)
def test_seed_model_fit(policy, jit_compile):
    mp = unimp.mixed_precision(policy, backend="tensorflow")
    model = seed_model(mp, head_dtype=mp.output_dtype_policy)  # the Keras guide's float32 head
    model, opt = mp.prepare(
        model, "adam", loss="sparse_categorical_crossentropy", jit_compile=jit_compile
    )
    assert type(model.optimizer) is utf.LossScaleOptimizer and model.optimizer is opt
    x = np.random.rand(128, 784).astype(np.float32)
    y = np.random.randint(0, 10, 128)
    hist = model.fit(x, y, epochs=2, batch_size=32, verbose=0)
    assert all(math.isfinite(v) for v in hist.history["loss"])
    assert model.predict(x[:4], verbose=0).dtype == np.float32
    expected_scale = 2.0**15 if policy == "mixed_float16" else 1.0
    assert int(opt.iterations.numpy()) == 8 and float(opt.dynamic_scale.numpy()) == expected_scale


def test_fit_forward_overflow_skips_without_lowering_scale():
    # Keras's own optimizer would halve the scale here; unimp's rule leaves it (loss not finite)
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    model = seed_model(mp, head_dtype=mp.output_dtype_policy)  # the clean batch stays clean
    model, opt = mp.prepare(model, "sgd", loss="sparse_categorical_crossentropy")
    x = np.random.rand(64, 784).astype(np.float32)
    x[:32] = np.inf  # first batch: the forward pass overflows
    y = np.random.randint(0, 10, 64)
    model.fit(x, y, epochs=1, batch_size=32, shuffle=False, verbose=0)
    assert float(opt.dynamic_scale.numpy()) == 2.0**15
    assert int(opt.iterations.numpy()) == 1
    assert (int(opt.total_skips.numpy()), int(opt.consecutive_skips.numpy())) == (1, 0)
    assert bool(utf.all_finite(model.trainable_variables))


def test_plain_compile_does_not_wrap_unimp_optimizer_again():
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    model = seed_model(mp)
    opt = mp.loss_scale_optimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    assert model.optimizer is opt


def test_prepare_replaces_keras_loss_scale_optimizer():
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    inner = keras.optimizers.SGD(0.01)
    _, opt = mp.prepare(seed_model(mp), keras.optimizers.LossScaleOptimizer(inner))
    assert type(opt) is utf.LossScaleOptimizer and opt.inner_optimizer is inner


def test_prepare_warns_about_model_compiled_with_keras_optimizer():
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    model = seed_model(mp)
    model.compile("adam", loss="sparse_categorical_crossentropy")
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer  # Keras wrapped it
    with pytest.warns(UserWarning, match="Compile through prepare"):
        mp.prepare(model)


_MIRRORED = """
import json, os
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np, unimp
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
with strategy.scope():
    with mp.autocast():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3, activation="softmax")])
    model, opt = mp.prepare(model, "adam", loss="sparse_categorical_crossentropy")
x = np.random.rand(32, 8).astype("float32")
x[12:16] = np.inf  # forward overflow on the second replica of the first global batch only
y = np.random.randint(0, 3, 32)
model.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)
v = model.trainable_variables[0].value
print(json.dumps({"iterations": int(opt.iterations.numpy()), "scale": float(opt.dynamic_scale.numpy()),
                  "skips": int(opt.total_skips.numpy()),
                  "in_sync": bool((v.values[0].numpy() == v.values[1].numpy()).all())}))
"""


def test_fit_under_mirrored_strategy():
    # two logical CPUs must be configured before TensorFlow starts: a fresh process
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "tensorflow"}
    proc = subprocess.run(
        [sys.executable, "-c", _MIRRORED], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # the overflowing replica skips the step on every replica, without lowering the scale
    assert out == {"iterations": 1, "scale": 2.0**15, "skips": 1, "in_sync": True}


def test_loss_scale_optimizer_mismatch_with_recipe():
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    other = lso(StaticLossScale(8.0))
    with pytest.raises(ValueError, match="the recipe.s is .*pass its inner_optimizer"):
        mp.prepare(Vec([1.0]), other)


def test_prepare_warns_when_model_built_outside_autocast():
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.warns(UserWarning, match="autocast"):
        mp.prepare(model)


EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))


def _example(name):
    import runpy

    return runpy.run_path(os.path.join(EXAMPLES, name), run_name="unimp_example")["main"]


def test_example_keras_mlp_fit():
    before = keras.config.dtype_policy()
    out = _example("keras_mlp_fit.py")(samples=256, epochs=1, batch_size=64)
    assert out["output_dtype"] == np.float32 and math.isfinite(out["history"]["loss"][0])
    assert (
        type(out["optimizer"]) is utf.LossScaleOptimizer
        and int(out["optimizer"].iterations.numpy()) == 4
    )
    assert keras.config.dtype_policy() == before


def test_example_tf_keras2_custom_loop():
    out = _example("tf_keras2_custom_loop.py")(samples=256, epochs=1, batch_size=64)
    opt = out["optimizer"]
    assert math.isfinite(out["losses"][0])
    # every one of the 4 batches is either applied or counted as skipped, never both
    assert int(opt.iterations.numpy()) + int(opt.total_skips.numpy()) == 4
    assert out["model"].output.dtype == "float32"


def test_prepare_again_is_refused_as_in_torch():
    import copy

    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    model = seed_model(mp)
    mp.prepare(model)
    with pytest.raises(ValueError, match="already prepared; prepare\\(\\) applies the recipe once"):
        mp.prepare(model)
    x = tf.random.uniform((2, 784))
    assert model(x).dtype == tf.float32
    other = unimp.mixed_precision("params=float32,compute=float16,output=float16", backend="tensorflow")
    with pytest.raises(ValueError, match="already prepared"):
        other.prepare(model)
    # Keras deep-copies through the config (as it saves): the copy runs itself, unprepared
    clone = copy.deepcopy(model)
    clone.layers[-1].kernel.assign(tf.zeros_like(clone.layers[-1].kernel))
    assert clone(x).dtype == tf.float16
    assert not np.allclose(np.asarray(model(x)), np.asarray(clone(x), np.float32))
    import warnings

    with warnings.catch_warnings():  # its layers keep the recipe's policy: no false warning
        warnings.simplefilter("error")
        mp.prepare(clone)
    assert clone(x).dtype == tf.float32
