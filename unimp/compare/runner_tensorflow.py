"""``unimp compare`` in TensorFlow/Keras 3 through unimp's tensorflow backend."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from unimp.backends import tensorflow as backend
from unimp.compare.run import RunSpec, train_loop


def _model(spec: RunSpec, mp: Any) -> keras.Model:
    w = spec.weights
    h, wd, c = spec.x_test.shape[1:]
    hidden = spec.batches[0]["mask"].shape[1]
    with mp.autocast():
        x_in = keras.Input((h, wd, c), name="x")
        m_in = keras.Input((hidden,), name="mask")
        if spec.model == "mlp":
            feat = keras.layers.Dense(w["w1"].shape[1], activation="relu", name="l1")(
                keras.layers.Flatten()(x_in)
            )
        else:
            conv = keras.layers.Conv2D(
                w["k"].shape[3], w["k"].shape[:2], padding="same", activation="relu", name="conv"
            )
            feat = keras.layers.Flatten()(conv(x_in))
        dropped = keras.layers.Multiply()([feat, m_in])
        logits = keras.layers.Dense(w["w2"].shape[1], name="l2")(dropped)
        model = keras.Model([x_in, m_in], logits)
    if spec.model == "mlp":
        model.get_layer("l1").set_weights([w["w1"], w["b1"]])
    else:
        model.get_layer("conv").set_weights([w["k"], w["bk"]])
    model.get_layer("l2").set_weights([w["w2"], w["b2"]])
    return model


def run(spec: RunSpec) -> dict[str, Any]:
    device = "/GPU:0" if spec.device == "cuda" else "/CPU:0"
    with tf.device(device):
        mp = backend.MixedPrecision(spec.recipe)
        model = _model(spec, mp)
        if spec.optimizer == "adam":
            inner = keras.optimizers.Adam(spec.lr, epsilon=1e-8)
        else:
            inner = keras.optimizers.SGD(spec.lr)
        model, opt = mp.prepare(model, inner)

        def loss_fn(model: keras.Model, b: dict[str, tf.Tensor]) -> tf.Tensor:
            logits = tf.cast(model([b["x"], b["mask"]], training=True), tf.float32)
            return tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=b["y"], logits=logits)
            )

        step = mp.train_step(model, opt, loss_fn)
        out = train_loop(step, spec, lambda b: b)
        ones = np.ones((len(spec.x_test), spec.batches[0]["mask"].shape[1]), np.float32)
        logits = model([tf.constant(spec.x_test), tf.constant(ones)], training=False)
        pred = np.argmax(np.asarray(tf.cast(logits, tf.float32)), axis=1)
    peak = None
    if spec.device == "cuda":
        peak = int(tf.config.experimental.get_memory_info("GPU:0")["peak"])
    return {
        "framework": "tensorflow",
        "version": backend.framework_version(),
        "device": device.strip("/").lower(),
        **out,
        "test_accuracy": float((pred == spec.y_test).mean()),
        "peak_memory_bytes": peak,
    }
