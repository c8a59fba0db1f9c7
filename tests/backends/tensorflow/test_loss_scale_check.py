"""LossScaleCheck: the loss-scale config's floor_action and max_consecutive_skips under
model.fit, where no step result is read."""


import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import unimp
from unimp.backends.tensorflow import LossScaleCheck, LossScaleOptimizer
from unimp.loss_scale import DynamicLossScale, LossScaleError, LossScaleFloorWarning


class _InfGrad(keras.layers.Layer):
    """The identity whose gradient is inf from batch ``bad_from`` on (the loss stays finite:
    an overflow in the backward pass, the case the floor is about)."""

    def __init__(self, bad_from: int) -> None:
        super().__init__()
        self.bad_from = bad_from
        self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False, name="seen")

    def call(self, x):
        bad = self.seen >= self.bad_from
        self.seen.assign_add(1.0)

        @tf.custom_gradient
        def ident(v):
            return v, lambda g: tf.where(bad, g * np.inf, g)

        return ident(x)


def _fit(config, callbacks, bad_from=0, batches=6):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), _InfGrad(bad_from), keras.layers.Dense(1)])
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.01), loss_scale=config)
    model.compile(optimizer=opt, loss="mse")
    x, y = np.ones((8 * batches, 4), np.float32), np.zeros((8 * batches, 1), np.float32)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)
    return opt


def test_floor_action_raise_stops_fit_at_the_floor():
    config = DynamicLossScale(init_scale=4.0, min_scale=1.0, floor_action="raise")
    with pytest.raises(LossScaleError, match="floor"):
        _fit(config, [LossScaleCheck()])
    # without the callback nothing reads the state: fit runs on at the floor
    opt = _fit(config, [])
    assert float(opt.dynamic_scale.numpy()) == 1.0 and int(opt._state().floor_hits) > 0


def test_floor_action_warn_warns_once_per_new_floor_hit():
    config = DynamicLossScale(init_scale=2.0, min_scale=1.0, floor_action="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(config, [LossScaleCheck()], bad_from=0, batches=4)
    hits = [w for w in caught if issubclass(w.category, LossScaleFloorWarning)]
    # 4 overflowing batches from scale 2: 2 -> 1, then 3 floor hits, each new one warned once
    assert len(hits) == 3


def test_max_consecutive_skips_stops_fit_and_every_spaces_the_checks():
    config = DynamicLossScale(init_scale=2.0**10, min_scale=1.0, max_consecutive_skips=2)
    with pytest.raises(LossScaleError):
        _fit(config, [LossScaleCheck()], bad_from=2)
    _fit(config, [LossScaleCheck(every=100)], bad_from=2)  # never checked within 6 batches


@pytest.mark.parametrize("every", [0, -1, 1.5, True, "2"])
def test_every_must_be_a_positive_int(every):
    with pytest.raises(ValueError, match="every"):
        LossScaleCheck(every=every)


def test_a_model_without_unimps_optimizer_is_named():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    with pytest.raises(TypeError, match="LossScaleCheck needs the model compiled with unimp's LossScaleOptimizer"):
        model.fit(np.ones((8, 4)), np.zeros((8, 1)), verbose=0, callbacks=[LossScaleCheck()])


def test_the_callback_is_exported_with_the_package_path():
    assert unimp.backends.tensorflow.LossScaleCheck.__module__ == "unimp.backends.tensorflow"


def test_the_keras_callback_checks_the_optimizer_backend_keras_prepares_on_tensorflow():
    # backend="keras" on TensorFlow is this backend: its optimizer is checked by
    # unimp.keras.LossScaleCheck too (one script for every Keras engine); Keras's own is not
    import unimp.keras

    config = DynamicLossScale(init_scale=2.0**10, min_scale=1.0, max_consecutive_skips=2)
    with pytest.raises(LossScaleError):
        _fit(config, [unimp.keras.LossScaleCheck()], bad_from=2)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    with pytest.raises(TypeError, match=r"got keras\.src\.optimizers\.loss_scale_optimizer\.LossScaleOptimizer"):
        model.fit(np.ones((8, 4)), np.zeros((8, 1)), verbose=0, callbacks=[unimp.keras.LossScaleCheck()])
