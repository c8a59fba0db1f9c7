"""Helpers shared by the tensorflow backend's test files (models, losses, batches, bitwise checks)."""

import os

from conftest import require_backend

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

utf = require_backend("tensorflow")  # skips with a reason if not under test, FAILS if missing


import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

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
