"""Helpers shared by the tensorflow backend's test files (models, losses, batches, bitwise checks)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import tensorflow as tf

import unimp.backends.tensorflow as utf

F32 = np.float32


INF = float("inf")


class Vec(keras.layers.Layer):
    """A built layer holding one float32 vector ``w``."""

    def __init__(self, init, **kwargs):
        super().__init__(**kwargs)
        init = np.asarray(init, np.float32)
        self.w = self.add_weight(
            shape=init.shape,
            initializer=lambda shape, dtype=None: tf.constant(init, dtype or "float32"),
            name="w",
        )
        self.built = True


def lso(loss_scale, inner=None):
    return utf.LossScaleOptimizer(inner or keras.optimizers.SGD(0.1), loss_scale)
