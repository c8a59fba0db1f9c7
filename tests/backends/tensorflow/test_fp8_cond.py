"""unimp's Keras float8 layer inside ``tf.cond`` under a ``GradientTape`` in a ``tf.function``,
where Keras's own ``Dense.quantize("float8")`` runs: the output gradient's state is read and
assigned in the backward function, whose graph captured the eager variable itself, and cond_v2's
gradient raised "Tensor.graph is undefined when eager execution is enabled"."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import unimp.backends.tensorflow as utf
from unimp import fp8


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        yield


def _run(layer, pred, x):
    with tf.GradientTape() as tape:
        y = tf.cond(pred, lambda: layer(x, training=True), lambda: tf.zeros_like(x))
        loss = tf.reduce_sum(tf.cast(y, tf.float32))
    return tape.gradient(loss, layer.trainable_variables)


def _states(layer):
    return {f"{t}_{f}": np.array(getattr(layer, f"{t}_{f}").numpy()) for t in fp8.LAYER_TENSORS
            for f in fp8.STATE_FIELDS}


def test_fp8_dense_runs_inside_tf_cond_in_a_tf_function_as_keras_float8_dense_does():
    x = tf.ones((2, 4))
    keras_dense = keras.layers.Dense(4)
    keras_dense.build((None, 4))
    keras_dense.quantize("float8")
    tf.function(_run)(keras_dense, tf.constant(True), x)  # Keras's own runs there

    layer = utf.FP8Dense(4, config=fp8.DelayedScaling(amax_history_len=3))
    layer.build((None, 4))
    step = tf.function(_run)
    grads = step(layer, tf.constant(True), x)
    assert all(g is not None for g in grads)
    ran = _states(layer)
    assert ran["grad_amax_history"].tolist() == [1.0, 0.0, 0.0]  # d sum / dy = 1
    assert ran["grad_scale"] == np.float32(57344.0)
    step(layer, tf.constant(False), x)  # skipped: every state bitwise as it was
    skipped = _states(layer)
    assert all(skipped[k].tobytes() == ran[k].tobytes() for k in ran)
    step(layer, tf.constant(True), x)
    assert _states(layer)["grad_amax_history"].tolist() == [1.0, 1.0, 0.0]


def test_accumulating_through_a_cond_branch_runs_with_a_step_per_micro_batch():
    # the window's result cannot leave the branch's graph (InaccessibleTensorError before):
    # inside a branch each micro-batch takes its own step, as docs/fp8.md says
    import unimp

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.a = utf.FP8Dense(2, use_bias=False, config=fp8.DelayedScaling(amax_history_len=4))

        def call(self, x, training=False):
            return tf.cond(tf.reduce_sum(x) > 0, lambda: self.a(x, training=training),
                           lambda: tf.zeros((tf.shape(x)[0], 2), x.dtype))

    mp = unimp.mixed_precision("float32", backend="tensorflow", loss_scale="none")
    model = Net()
    model(np.zeros((1, 2), np.float32))
    step = mp.train_step(model, keras.optimizers.SGD(0.0),
                         lambda m, b: tf.reduce_sum(m(b, training=True)), grad_accum_steps=3)
    assert step([np.full((1, 2), c, np.float32) for c in (3.0, 1.0, 2.0)]).applied
    assert model.a.input_amax_history.numpy().tolist() == [2.0, 1.0, 3.0, 0.0]
