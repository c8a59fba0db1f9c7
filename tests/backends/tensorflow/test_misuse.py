"""TensorFlow backend: the mistakes of a custom loop named at run time (issue 30): the inner
optimizer applied directly to gradients of a scaled loss that nobody unscaled."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import unimp.backends.tensorflow as utf


def _setup(loss_scale="dynamic"):
    w = keras.Variable(np.ones(3, np.float32))
    opt = utf.LossScaleOptimizer(keras.optimizers.SGD(0.1), loss_scale=loss_scale)
    with tf.GradientTape() as tape:
        scaled = opt.scale_loss(tf.reduce_sum(w * w))
    return w, opt, tape.gradient(scaled, [w])


@pytest.mark.parametrize("how", ["apply_gradients", "apply"])
def test_the_inner_optimizer_on_scaled_gradients_is_refused_before_it_steps(how):
    w, opt, grads = _setup()
    inner = opt.inner_optimizer
    with pytest.raises(RuntimeError, match="never unscaled.*optimizer.apply_gradients"):
        if how == "apply":
            inner.apply(grads, [w])
        else:
            inner.apply_gradients(zip(grads, [w], strict=True))
    assert w.numpy().tolist() == [1.0, 1.0, 1.0] and int(inner.iterations.numpy()) == 0
    opt.apply_gradients(zip(grads, [w], strict=True))  # the right call still works, and clears the mark
    np.testing.assert_allclose(w.numpy(), 0.8, rtol=1e-6)
    inner.apply_gradients(zip([tf.ones(3)], [w], strict=True))  # a plain step of one's own is fine again


def test_unscaled_gradients_and_unit_scales_may_go_to_the_inner_optimizer():
    w, opt, grads = _setup()
    unscaled = opt.get_unscaled_gradients(grads)
    opt.inner_optimizer.apply_gradients(zip(unscaled, [w], strict=True))  # tf.keras 2's documented loop
    np.testing.assert_allclose(w.numpy(), 0.8, rtol=1e-6)
    for scale in ("none", 1.0):  # the scale is 1: the gradients are already the true ones
        w, opt, grads = _setup(scale)
        opt.inner_optimizer.apply_gradients(zip(grads, [w], strict=True))


def test_the_check_holds_inside_tf_function_and_leaves_fit_alone():
    w, opt, _ = _setup()

    @tf.function
    def wrong():
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(tf.reduce_sum(w * w))
        opt.inner_optimizer.apply_gradients(zip(tape.gradient(scaled, [w]), [w], strict=True))

    with pytest.raises(RuntimeError, match="never unscaled"):
        wrong()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=utf.LossScaleOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    model.fit(np.ones((8, 2), np.float32), np.ones((8, 1), np.float32), epochs=2, verbose=0)
