"""unimp.compat.tf_experimental: TensorFlow 2.1-2.3's experimental mixed-precision API (seed 004's
``tf.keras.mixed_precision.experimental``) on Keras 3 through unimp, by one changed import line
(issue 30 item 1); its loss scales checked against TensorFlow's own ``DynamicLossScale``, which
TensorFlow still ships as ``tf.compat.v1.mixed_precision``."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import pytest

pytestmark = pytest.mark.backend("tensorflow")

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _global_policy():
    import keras

    before = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(before)


def test_seed_004_runs_as_written_through_unimps_optimizer():
    from unimp.backends.tensorflow import LossScaleOptimizer
    from unimp.compat.tf_experimental import tf
    from unimp.loss_scale import DynamicLossScale

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the seed's calls mean what they did
        policy = tf.keras.mixed_precision.experimental.Policy("mixed_float16")
        tf.keras.mixed_precision.experimental.set_policy(policy)
        model = tf.keras.Sequential([
            tf.keras.Input((784,)),
            tf.keras.layers.Dense(512, activation="relu"),
            tf.keras.layers.Dropout(0.2),
            tf.keras.layers.Dense(10, activation="softmax"),
        ])  # fmt: skip
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    assert tf.keras.mixed_precision.experimental.global_policy() is policy
    assert (model.layers[0].kernel.dtype, model.layers[0].compute_dtype) == ("float32", "float16")
    assert isinstance(model.optimizer, LossScaleOptimizer)
    assert model.optimizer.loss_scale_config == DynamicLossScale.preset("tf_keras")  # TF 2.x's rule
    rng = np.random.default_rng(0)
    history = model.fit(rng.random((256, 784), dtype=np.float32), rng.integers(0, 10, 256), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    # everything else is TensorFlow's own
    import tensorflow

    assert tf.constant is tensorflow.constant and tf.keras.layers.Dense is tensorflow.keras.layers.Dense
    assert tf.keras.mixed_precision.Policy is tensorflow.keras.mixed_precision.Policy


@pytest.mark.parametrize(
    "name, loss_scale, kind",
    [
        ("mixed_float16", "auto", "dynamic"),
        ("mixed_bfloat16", "auto", None),
        ("float32", "auto", None),
        ("mixed_float16", "dynamic", "dynamic"),
        ("mixed_float16", 128, "static"),
        ("mixed_float16", None, None),
    ],
)
def test_policy_loss_scale_and_compile_follow_tensorflow_2(name, loss_scale, kind):
    from unimp.compat import tf_experimental as mixed_precision
    from unimp.compat.tf_experimental import tf

    policy = mixed_precision.Policy(name, loss_scale=loss_scale)
    assert (None if policy.loss_scale is None else policy.loss_scale.kind) == kind
    assert policy.compute_dtype == name.replace("mixed_", "") and policy.variable_dtype == "float32"
    mixed_precision.set_policy(policy)
    model = tf.keras.models.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])  # the same class
    assert tf.keras.models.Sequential is tf.keras.Sequential
    model.compile(optimizer="sgd", loss="mse")
    wrapped = getattr(model.optimizer, "loss_scale_config", None)
    if kind is None:  # TF 2.3's compile wrapped only a policy with a loss scale
        assert wrapped is None or name == "mixed_float16"
    else:
        assert wrapped == policy.loss_scale
    assert mixed_precision.Policy.from_config(policy.get_config()).loss_scale == policy.loss_scale


def test_the_dynamic_loss_scale_is_tensorflows_step_for_step():
    import keras
    import tensorflow

    from unimp.compat.tf_experimental import tf

    flags = [True, True, False, False, False, False, True, True, True]
    theirs = tensorflow.compat.v1.mixed_precision.DynamicLossScale(initial_loss_scale=4, increment_period=2, multiplier=2)
    ours = tf.keras.mixed_precision.experimental.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        tf.mixed_precision.experimental.DynamicLossScale(initial_loss_scale=4, increment_period=2, multiplier=2),
    )
    v = keras.Variable(np.zeros(1, np.float32))
    got, want = [], []
    for ok in flags:
        g = tensorflow.constant([1.0 if ok else float("inf")])
        theirs.update([g])
        want.append(float(theirs()))
        ours.apply([g], [v])
        got.append(float(ours.loss_scale))
    assert got == want == [4.0, 8.0, 4.0, 2.0, 1.0, 1.0, 1.0, 2.0, 2.0]  # the floor of 1 included


def test_loss_scale_optimizer_and_the_graph_rewrite_map_onto_unimp():
    import keras

    from unimp.backends.tensorflow import LossScaleOptimizer
    from unimp.compat.tf_experimental import tf

    exp = tf.keras.mixed_precision.experimental
    fixed = exp.LossScaleOptimizer(keras.optimizers.SGD(0.1), 64)
    assert isinstance(fixed, LossScaleOptimizer) and fixed.loss_scale_config.kind == "static"
    assert float(fixed.loss_scale) == 64.0
    with pytest.warns(DeprecationWarning, match=r"enable_mixed_precision_graph_rewrite was removed.*mp.prepare"):
        opt = tf.train.experimental.enable_mixed_precision_graph_rewrite(keras.optimizers.Adam())
    assert isinstance(opt, LossScaleOptimizer) and keras.config.dtype_policy().name == "mixed_float16"
    for bad, match in [("auto", "loss_scale must be 'dynamic'"), (-1, "finite number > 0"), (float("inf"), "finite number > 0")]:
        with pytest.raises(ValueError, match=match):
            exp.LossScaleOptimizer(keras.optimizers.SGD(0.1), bad)
    with pytest.raises(TypeError, match=r"tf.keras.optimizers.Adam\(learning_rate=...\)"):
        exp.LossScaleOptimizer(object(), "dynamic")
    with pytest.raises(TypeError, match="set_policy takes a Policy"):
        exp.set_policy(3)


@pytest.mark.slow
def test_the_example_runs():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tf_experimental_policy.py"), "--samples", "256", "--epochs", "1"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "unimp.backends.tensorflow.LossScaleOptimizer around Adam" in out.stdout
    assert "TensorFlow 2.x's rule" in out.stdout and "DeprecationWarning" not in out.stderr


def test_a_saved_model_loads_compiled_with_its_loss_scale(tmp_path):
    import keras

    from unimp.backends.tensorflow import LossScaleOptimizer
    from unimp.compat.tf_experimental import tf

    tf.keras.mixed_precision.experimental.set_policy(tf.keras.mixed_precision.experimental.Policy("mixed_float16", loss_scale=128))
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    path = tmp_path / "m.keras"
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Keras warned that compile() was not called on load
        loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, LossScaleOptimizer) and loaded.optimizer.loss_scale_config == model.optimizer.loss_scale_config
