"""tensorflow backend, ``step``: the train step (clipping, accumulation, skips, state, syncs, bad input)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import unimp
import unimp.backends.tensorflow as utf
from backends.tensorflow.helpers import INF, Vec, lso
from unimp.loss_scale import DynamicLossScale


@tf.custom_gradient
def _grad_times(x, factor):
    """Identity forward; multiplies the incoming gradient by ``factor`` (inject inf grads)."""

    def grad(dy):
        return dy * factor, tf.zeros_like(factor)

    return tf.identity(x), grad


def linear_loss(model, batch):
    """loss = sum(w * c): the gradient is c (times batch["inj"], 1 or inf)."""
    w = _grad_times(model.w, batch["inj"])
    return tf.reduce_sum(w * batch["c"])


def vec_batch(c, inj=1.0):
    return {"c": np.asarray(c, np.float32), "inj": np.float32(inj)}


def test_train_step_load_refuses_a_new_rule_when_model_fit_traced_the_optimizer():
    cfg = DynamicLossScale(init_scale=4.0, growth_interval=1, max_scale=None)
    mp = unimp.mixed_precision("float32", loss_scale=cfg, backend="tensorflow")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    opt = lso(cfg, keras.optimizers.SGD(0.0))
    model.compile(optimizer=opt, loss="mse")
    x, y = np.ones((8, 3), np.float32), np.zeros((8, 1), np.float32)
    model.fit(x, y, batch_size=4, verbose=0)  # fit's train function has cfg built in
    step = mp.train_step(model, opt, lambda m, b: tf.reduce_mean(m(b)))
    before = opt.state_dict()
    capped = cfg.replace(min_scale=2.0, max_scale=16.0)
    with pytest.raises(ValueError, match="model.fit"):
        step.load_state_dict(unimp.state_dict(capped))
    assert opt.state_dict() == before and opt.loss_scale_config == cfg


def test_train_step_load_state_dict_retraces_for_a_new_config():
    mp = unimp.mixed_precision("float32", loss_scale=DynamicLossScale(init_scale=4.0, growth_interval=1000), backend="tensorflow")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    step = mp.train_step(model, keras.optimizers.SGD(0.0), lambda m, b: tf.reduce_mean(m(b)))
    x = tf.ones((4, 2))
    assert step(x).scale == 4.0 and step(x).scale == 4.0
    step.load_state_dict(unimp.state_dict(DynamicLossScale(init_scale=4.0, growth_interval=1)))
    assert [step(x).scale for _ in range(3)] == [4.0, 8.0, 16.0]  # the new interval, traced anew
    assert step.tracing_count() == 1


def _step(mp_recipe="mixed_float16", init=(0.0, 0.0), lr=1.0, **kwargs):
    mp = unimp.mixed_precision(mp_recipe, backend="tensorflow")
    model = Vec(init)
    return model, mp.train_step(model, keras.optimizers.SGD(lr), linear_loss, **kwargs)


def test_train_step_traces_once():
    _, step = _step()
    for c in ([1.0, 2.0], [3.0, 4.0], [5.0, 6.0]):
        step(vec_batch(c))
    step(vec_batch([1.0, 1.0], np.inf))
    assert step.tracing_count() == 1


@pytest.mark.parametrize("jit_compile", [False, True])
def test_clipping_acts_on_unscaled_gradients(jit_compile):
    # scale 2**16, gradient (3, 4), max norm 1: grad_norm 5.0, update on (0.6, 0.8)
    recipe = unimp.get_recipe("mixed_float16", loss_scale=DynamicLossScale(init_scale=2.0**16))
    model, step = _step(recipe, lr=1.0, max_grad_norm=1.0, jit_compile=jit_compile)
    r = step(vec_batch([3.0, 4.0]))
    assert r.scale == 2.0**16 and r.grad_norm == 5.0 and r.applied
    np.testing.assert_array_equal(model.w.numpy(), -np.array([0.6, 0.8], np.float32))


@pytest.mark.parametrize("grad_accum_steps", [1, 2])
def test_train_step_with_sparse_embedding_gradients(grad_accum_steps):
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    with mp.autocast():
        model = keras.Sequential(
            [keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 4), keras.layers.Dense(1)]
        )
    mp.prepare(model)

    def loss_fn(model, batch):
        return tf.reduce_mean(tf.square(model(batch["ids"])))

    step = mp.train_step(
        model,
        keras.optimizers.SGD(0.1),
        loss_fn,
        grad_accum_steps=grad_accum_steps,
        max_grad_norm=1.0,
    )
    table = model.layers[0].embeddings.numpy().copy()
    b = {"ids": np.array([[1, 2, 2]], np.int32)}
    r = step(b if grad_accum_steps == 1 else [b] * grad_accum_steps)
    assert r.applied and math.isfinite(r.grad_norm)
    changed = np.any(model.layers[0].embeddings.numpy() != table, axis=1)
    assert changed.tolist() == [False, True, True] + [False] * 7


def test_clipping_with_inf_gradient_skips():
    model, step = _step(init=(1.0, 2.0), max_grad_norm=1.0)
    r = step(vec_batch([3.0, 4.0], np.inf))
    assert not math.isfinite(r.grad_norm) and r.applied is False and r.grads_finite is False
    assert r.loss_finite is True and r.total_skips == 1
    np.testing.assert_array_equal(model.w.numpy(), np.array([1.0, 2.0], np.float32))
    assert int(step.optimizer.iterations.numpy()) == 0


def test_grad_accumulation_is_the_mean():
    model, step = _step(lr=0.5, grad_accum_steps=2)
    r = step([vec_batch([1.0, 2.0]), vec_batch([3.0, 6.0])])
    assert r.applied is True and r.loss == 0.0
    np.testing.assert_array_equal(model.w.numpy(), [-1.0, -2.0])  # 0.5 * mean((1,2),(3,6))
    assert step.tracing_count() == 1


@pytest.mark.parametrize("bad_micro", [0, 1])
def test_grad_accumulation_skips_whole_window(bad_micro):
    model, step = _step(lr=0.5, grad_accum_steps=2)
    r = step([vec_batch([1.0, 2.0], np.inf if i == bad_micro else 1.0) for i in range(2)])
    assert r.applied is False and r.grads_finite is False and r.total_skips == 1
    np.testing.assert_array_equal(model.w.numpy(), [0.0, 0.0])
    assert int(step.optimizer.iterations.numpy()) == 0
    assert float(step.optimizer.dynamic_scale.numpy()) == 2.0**14
    r = step([vec_batch([2.0, 2.0]), vec_batch([2.0, 4.0])])
    assert r.applied is True
    np.testing.assert_array_equal(model.w.numpy(), [-1.0, -1.5])  # only the clean window


@pytest.mark.parametrize("batch", ["one", "short"])
def test_grad_accumulation_needs_a_list_of_k(batch):
    model, step = _step(lr=0.5, grad_accum_steps=2)
    b = vec_batch([1.0, 2.0]) if batch == "one" else [vec_batch([1.0, 2.0])]
    with pytest.raises(ValueError, match="list of 2 micro-batches"):
        step(b)
    np.testing.assert_array_equal(model.w.numpy(), [0.0, 0.0])


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: utf.LossScaleOptimizer("adam"), TypeError, "keras.optimizers.Optimizer"),
        (
            lambda: utf.LossScaleOptimizer(
                keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
            ),
            ValueError,
            "inner_optimizer",
        ),
        (
            lambda: utf.LossScaleOptimizer(keras.optimizers.SGD(), loss_scale="sometimes"),
            ValueError,
            "dynamic",
        ),
        (
            lambda: utf.LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=-1.0),
            ValueError,
            "scale",
        ),
        (
            lambda: utf.LossScaleOptimizer(
                keras.optimizers.SGD(), loss_scale="dynamic", initial_scale=8.0
            ),
            ValueError,
            "not both",
        ),
        (
            lambda: utf.LossScaleOptimizer(keras.optimizers.SGD(), clipnorm=1.0),
            ValueError,  # as keras.optimizers.LossScaleOptimizer, in its words
            "set `clipnorm` on the `inner_optimizer`",
        ),
        (lambda: utf.MixedPrecision("params=float64,compute=float16"), ValueError, "mixed_float16"),
        (lambda: utf.MixedPrecision("mixed_flaot16"), ValueError, "mixed_float16"),
        (
            lambda: unimp.mixed_precision("mixed_float16", backend="tensorfow"),
            ValueError,
            "tensorflow",
        ),
        (lambda: utf.MixedPrecision().prepare("model"), TypeError, "keras.Model"),
        (lambda: utf.MixedPrecision().prepare(Vec([1.0]), object()), TypeError, "optimizer"),
        (lambda: utf.MixedPrecision().prepare(Vec([1.0]), loss="mse"), ValueError, "optimizer"),
        (lambda: utf.MixedPrecision().train_step(Vec([1.0]), "sgd", "loss"), TypeError, "callable"),
        (
            lambda: utf.MixedPrecision().train_step(
                Vec([1.0]), "sgd", linear_loss, grad_accum_steps=0
            ),
            ValueError,
            "grad_accum_steps",
        ),
        (
            lambda: utf.MixedPrecision().train_step(
                Vec([1.0]), "sgd", linear_loss, max_grad_norm=-1.0
            ),
            ValueError,
            "max_grad_norm",
        ),
        (
            lambda: utf.MixedPrecision().train_step(
                Vec([1.0]), "sgd", linear_loss, max_grad_norm=INF
            ),
            ValueError,
            "max_grad_norm",
        ),
        (
            lambda: utf.MixedPrecision().train_step(
                keras.Sequential([keras.layers.Dense(2)]), "sgd", linear_loss
            ),
            ValueError,
            "build",
        ),
        (lambda: utf.to_dtype("int8"), ValueError, "float16"),
    ],
)
def test_bad_input_is_a_clear_error(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_skip_guard_covers_statistics_not_frozen_weights():
    from unimp.keras.step import forward_state_variables as _forward_state

    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    with mp.autocast():
        frozen = keras.layers.Dense(8)
        model = keras.Sequential([keras.Input((3,)), frozen, keras.layers.BatchNormalization(),
                                  keras.layers.Dropout(0.5), keras.layers.Dense(1)])
    frozen.trainable = False
    paths = sorted(v.path.split("/")[-1] for v in _forward_state(model))
    assert paths == ["moving_mean", "moving_variance"]  # not the frozen kernel, not the seed
