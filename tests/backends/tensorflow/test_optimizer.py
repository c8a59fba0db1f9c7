"""tensorflow backend, ``optimizer``: a skipped step leaves the parameters and the optimizer state unchanged; half optimizer state."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import pytest
import tensorflow as tf

import unimp
import unimp.backends.tensorflow as utf
from backends.tensorflow.helpers import F32, INF, lso
from unimp.loss_scale import DynamicLossScale, NoLossScale, StaticLossScale


def _one_step(opt, w, mode):
    if mode.startswith("tf_keras2"):
        with tf.GradientTape() as tape:
            scaled = opt.get_scaled_loss(0.5 * w * w)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, [w]))
        if mode == "tf_keras2_clipped":  # transformed after unscaling: still not divided again
            grads, _ = tf.clip_by_global_norm(grads, 10.0)
    else:
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(0.5 * w * w)
        grads = tape.gradient(scaled, [w])
    opt.apply_gradients(zip(grads, [w], strict=True))


@pytest.mark.parametrize("mode", ["keras3", "tf_keras2", "tf_keras2_clipped"])
@pytest.mark.parametrize("compile_", ["eager", "function", "jit"])
def test_right_value_w_is_0_9_after_one_step(mode, compile_):
    # L = 0.5 w^2, w = 1, SGD lr 0.1, scale 1024 -> w == 0.9 (0.99990234 if divided twice)
    opt = lso(StaticLossScale(1024.0), keras.optimizers.SGD(0.1))
    w = keras.Variable(1.0)
    if compile_ == "eager":
        _one_step(opt, w, mode)
    else:
        tf.function(lambda: _one_step(opt, w, mode), jit_compile=compile_ == "jit")()
    assert w.numpy() == F32(0.9)
    assert int(opt.iterations.numpy()) == 1 and float(opt.dynamic_scale.numpy()) == 1024.0


def test_unscaled_flag_lasts_one_step():
    opt = lso(StaticLossScale(1024.0), keras.optimizers.SGD(0.1))
    w = keras.Variable(1.0)
    _one_step(opt, w, "tf_keras2")
    _one_step(opt, w, "keras3")  # gradients of the scaled loss again: divided once
    assert w.numpy() == F32(0.9) - F32(0.1) * F32(0.9)


def test_scaled_loss_is_loss_times_scale_in_float32():
    opt = lso(DynamicLossScale(init_scale=2.0**16))
    scaled = opt.scale_loss(tf.constant(2.0, tf.float16))
    assert scaled.dtype == tf.float32 and float(scaled) == 2.0**17  # float16 would overflow


def test_bfloat16_recipe_has_no_scaling_and_right_value():
    mp = unimp.mixed_precision("mixed_bfloat16", backend="tensorflow")
    opt = mp.loss_scale_optimizer(keras.optimizers.SGD(0.1))
    w = keras.Variable(1.0)
    assert float(opt.scale_loss(tf.constant(3.0))) == 3.0
    _one_step(opt, w, "keras3")
    assert w.numpy() == F32(0.9)
    opt.apply_gradients([(tf.constant(INF), w)])
    assert w.numpy() == F32(0.9) and int(opt.total_skips.numpy()) == 1


@pytest.mark.parametrize("compile_", ["eager", "function", "jit"])
def test_skip_leaves_variables_and_inner_state_unchanged(compile_):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    opt = lso(
        DynamicLossScale(init_scale=256.0, growth_interval=2), keras.optimizers.Adam(schedule)
    )
    w = keras.Variable(np.array([1.0, -2.0], np.float32))

    def step(g):
        opt.apply([g], [w])

    run = step if compile_ == "eager" else tf.function(step, jit_compile=compile_ == "jit")
    run(tf.constant([256.0, 512.0]))
    before = [np.array(v.numpy()) for v in opt.inner_optimizer.variables] + [w.numpy().copy()]
    lr_before = float(opt.inner_optimizer.learning_rate.numpy())
    run(tf.constant([np.nan, 1.0], tf.float32))
    after = [np.array(v.numpy()) for v in opt.inner_optimizer.variables] + [w.numpy()]
    for b, a in zip(before, after, strict=True):
        assert b.tobytes() == a.tobytes()
    assert int(opt.iterations.numpy()) == 1
    assert float(opt.inner_optimizer.learning_rate.numpy()) == lr_before
    assert float(opt.dynamic_scale.numpy()) == 128.0 and int(opt.total_skips.numpy()) == 1


def test_forward_overflow_skips_without_lowering_scale():
    opt = lso(DynamicLossScale(init_scale=1024.0, growth_interval=3))
    w = keras.Variable(1.0)
    with tf.GradientTape() as tape:
        scaled = opt.scale_loss(tf.constant(INF) + 0.0 * w)
    opt.apply_gradients([(tf.constant(1.0), w)])  # finite grads, non-finite loss
    assert scaled.numpy() == INF
    assert w.numpy() == F32(1.0) and int(opt.iterations.numpy()) == 0
    assert float(opt.dynamic_scale.numpy()) == 1024.0
    assert (int(opt.consecutive_skips.numpy()), int(opt.total_skips.numpy())) == (1, 1)
    del tape
    # the pending flag is consumed: the next clean step applies
    _one_step(opt, w, "keras3")
    assert int(opt.iterations.numpy()) == 1 and int(opt.consecutive_skips.numpy()) == 0


def test_failed_apply_changes_nothing():
    opt = lso(DynamicLossScale(init_scale=8.0))
    w = keras.Variable(np.ones(2, np.float32))
    opt.apply([tf.constant([1.0, 1.0])], [w])
    before = (w.numpy().copy(), opt.state_dict(), int(opt.iterations.numpy()))
    with pytest.raises(ValueError, match="gradients"):
        opt.apply([tf.constant([1.0, 1.0]), tf.constant(1.0)], [w])
    assert (w.numpy().tobytes(), opt.state_dict(), int(opt.iterations.numpy())) == (
        before[0].tobytes(),
        before[1],
        before[2],
    )


def test_none_loss_scale_keeps_scale_one_and_counts_skips():
    opt = lso(NoLossScale())
    w = keras.Variable(1.0)
    opt.apply([tf.constant(np.nan)], [w])
    assert float(opt.dynamic_scale.numpy()) == 1.0 and int(opt.total_skips.numpy()) == 1


# the warning and where it is not said (every backend): tests/conformance/test_half_state_warning.py


def test_pure_float16_adam_slots_are_the_float16_ones_warned_about():
    mp = unimp.mixed_precision("float16", backend="tensorflow")
    with mp.autocast():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.warns(unimp.HalfOptimizerStateWarning, match="Adam keeps its moments in float16"):
        step = mp.train_step(model, keras.optimizers.Adam(1e-3), lambda m, b: tf.reduce_mean(m(b)))
    assert {v.dtype for v in step.optimizer.inner_optimizer.variables if "momentum" in v.name} == {"float16"}


def test_half_state_warning_for_a_prebuilt_optimizer_and_numpy_eps_points_at_the_caller():
    mp = unimp.mixed_precision("float16", backend="tensorflow")
    with mp.autocast():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    adam = keras.optimizers.Adam(1e-3, epsilon=np.float32(1e-8))
    adam.build(model.trainable_variables)  # built before unimp wraps it
    with pytest.warns(unimp.HalfOptimizerStateWarning, match="becomes 0 in float16") as caught:
        mp.train_step(model, adam, lambda m, b: tf.reduce_mean(m(b)))
    assert caught[0].filename == __file__


@pytest.mark.parametrize(
    "kwargs, ok",
    [
        ({"dynamic": True}, True),
        ({"weight_decay": None, "use_ema": False, "ema_momentum": 0.99}, True),
        ({"dynamic": False}, False),
        ({"weight_decay": 0.1}, False),
        ({"clipnorm": 1.0}, False),
        ({"learning_rate_typo": 1}, False),
    ],
)
@pytest.mark.parametrize("cls", ["keras", "unimp"])
def test_accepts_and_refuses_what_keras_does(cls, kwargs, ok):
    lso_cls = keras.optimizers.LossScaleOptimizer if cls == "keras" else utf.LossScaleOptimizer
    if ok:
        opt = lso_cls(keras.optimizers.SGD(0.1), **kwargs)
        assert float(opt.initial_scale) == 2.0**15
    else:
        with pytest.raises(ValueError):
            lso_cls(keras.optimizers.SGD(0.1), **kwargs)


@pytest.mark.parametrize(
    "kwargs", [{"weight_decay": 0.1}, {"clipnorm": 1.0}, {"dynamic": False}, {"foo": 1, "bar": 2}]
)
def test_refusals_carry_keras_words_and_name_the_fix(kwargs):
    # code that catches Keras's errors matches on their words: unimp's message holds Keras's
    # whole message, then the fix
    with pytest.raises(ValueError) as keras_error:
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), **kwargs)
    with pytest.raises(ValueError) as unimp_error:
        utf.LossScaleOptimizer(keras.optimizers.SGD(0.1), **kwargs)
    assert str(unimp_error.value).startswith(str(keras_error.value))  # re.escape(keras) matches
    fix = {"dynamic": "loss_scale=1024.0", "foo": "on the inner optimizer"}.get(next(iter(kwargs)), "Adam(...")
    assert fix in str(unimp_error.value)


def test_an_inner_loss_scale_factor_is_cleared_with_a_warning_as_keras_clears_it():
    # Keras 3 sets inner_optimizer.loss_scale_factor = None silently (kept, the gradients
    # would be divided by both scales); unimp does the same and says so
    keras_inner, inner = keras.optimizers.SGD(0.1, loss_scale_factor=128.0), keras.optimizers.SGD(
        0.1, loss_scale_factor=128.0
    )
    keras.optimizers.LossScaleOptimizer(keras_inner)
    with pytest.warns(UserWarning, match=r"loss_scale_factor=128.0.*loss_scale=128.0"):
        opt = utf.LossScaleOptimizer(inner)
    assert keras_inner.loss_scale_factor is None and inner.loss_scale_factor is None
    assert opt.loss_scale_config == DynamicLossScale()
    # a call that fails on another argument leaves the inner optimizer as it was
    failed = keras.optimizers.SGD(0.1, loss_scale_factor=8.0)
    with pytest.raises(ValueError):
        utf.LossScaleOptimizer(failed, loss_scale="sometimes")
    assert failed.loss_scale_factor == 8.0


def test_config_carries_keras_keys_and_reads_configs_keras_wrote():
    opt = utf.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1024.0, dynamic_growth_steps=7)
    cfg = opt.get_config()
    assert (cfg["initial_scale"], cfg["dynamic_growth_steps"]) == (1024.0, 7)
    assert cfg["loss_scale"]["growth_interval"] == 7
    back = utf.LossScaleOptimizer.from_config(cfg)
    assert back.loss_scale_config == opt.loss_scale_config
    # what Keras 3.0-3.11 wrote: its own keys plus the base optimizer's, at their defaults
    keras_cfg = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=512.0, dynamic_growth_steps=3
    ).get_config()
    keras_cfg.update({"weight_decay": None, "clipnorm": None, "global_clipnorm": None,
                      "clipvalue": None, "use_ema": False, "ema_momentum": 0.99,
                      "ema_overwrite_frequency": None, "loss_scale_factor": None,
                      "gradient_accumulation_steps": None})
    for cls in (keras.optimizers.LossScaleOptimizer, utf.LossScaleOptimizer):
        loaded = cls.from_config(dict(keras_cfg))
        assert (float(loaded.initial_scale), loaded.dynamic_growth_steps) == (512.0, 3)
    loaded = utf.LossScaleOptimizer.from_config(dict(keras_cfg))
    assert loaded.loss_scale_config == DynamicLossScale.preset("keras", init_scale=512.0, growth_interval=3)
    # a static rule has no Keras spelling: dynamic_growth_steps is None, the rule round-trips
    static = utf.LossScaleOptimizer(keras.optimizers.SGD(0.1), loss_scale=8.0)
    assert static.get_config()["dynamic_growth_steps"] is None
    assert utf.LossScaleOptimizer.from_config(static.get_config()).loss_scale_config == static.loss_scale_config


def test_pure_bfloat16_adam_learns_as_in_float32():
    # Keras's Adam computes beta_2**t in the variable's dtype: in bfloat16 beta_2=0.999 is 1.0,
    # the bias correction is 0 and the variable never moves. unimp's optimizer computes the
    # update of a half variable in float32 and rounds it once into the variable (issue 32):
    # 0.05 with gradient 0.5 moves by lr per apply, as float32 Adam.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", unimp.HalfOptimizerStateWarning)  # bfloat16: nothing to warn
        half = keras.Variable(np.array([0.05]), dtype="bfloat16")
        full = keras.Variable(np.array([0.05]), dtype="float32")
        opts = []
        for v in (half, full):
            opts.append(utf.LossScaleOptimizer(keras.optimizers.Adam(1e-3), loss_scale="none"))
            for _ in range(3):
                opts[-1].apply([tf.constant([0.5], v.dtype)], [v])
    assert abs(float(full.numpy()[0]) - 0.047) < 1e-6
    assert abs(float(tf.cast(half, tf.float32).numpy()[0]) - 0.047) <= 2 * 2.0**-13  # 2 spacings
    moments = [v for v in opts[0].inner_optimizer.variables if "momentum" in v.path or "velocity" in v.path]
    assert len(moments) == 2 and {m.dtype for m in moments} == {"bfloat16"}  # as Keras keeps them
    assert "update_step" not in vars(opts[0].inner_optimizer)  # the routing is gone after apply



def test_a_positional_number_is_refused_not_read_as_another_rule():
    # Keras: LossScaleOptimizer(opt, 1024.0) is a dynamic scale starting at 1024 (512 after an
    # overflow); unimp's second parameter is loss_scale, where a number is static
    with pytest.raises(ValueError, match=r"initial_scale=1024.0.*loss_scale=1024.0"):
        utf.LossScaleOptimizer(keras.optimizers.SGD(0.1), 1024.0)
    with pytest.raises(ValueError, match="dynamic_growth_steps="):
        utf.LossScaleOptimizer(keras.optimizers.SGD(0.1), None, 100)
    for cls in (keras.optimizers.LossScaleOptimizer, utf.LossScaleOptimizer):
        opt = cls(keras.optimizers.SGD(0.1), initial_scale=1024.0)
        w = keras.Variable(1.0)
        opt.build([w])
        opt.apply_gradients([(tf.constant(float("inf")), w)])
        assert float(opt.dynamic_scale.numpy()) == 512.0 and float(w.numpy()) == 1.0
    # a config object positionally stays unimp's loss_scale (Keras has no such argument)
    assert utf.LossScaleOptimizer(keras.optimizers.SGD(0.1), StaticLossScale(8.0)).loss_scale_config == StaticLossScale(8.0)


# -- update= (issue 32) ----------------------------------------------------------------------


def test_fit_with_a_kahan_recipe_learns_and_saves_its_rule(tmp_path):
    mp = utf.MixedPrecision("bf16-kahan")
    with mp.autocast():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    mp.prepare(model, keras.optimizers.AdamW(1e-2, weight_decay=0.1), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    first = model.evaluate(x, y, verbose=0)
    model.fit(x, y, epochs=20, batch_size=16, verbose=0)
    assert model.evaluate(x, y, verbose=0) < 0.2 * first
    opt = model.optimizer
    comps = [v for v in opt.variables if v.path.endswith("_compensation")]
    assert len(comps) == 4 and {str(v.dtype) for v in comps} == {"bfloat16"}
    assert any(bool(tf.reduce_any(tf.not_equal(tf.cast(v, tf.float32), 0.0))) for v in comps)
    again = utf.LossScaleOptimizer.from_config(opt.get_config())
    assert (again._update_mode, again._update_seed) == ("kahan", 0)


def test_half_update_wraps_a_plain_keras_optimizer_only():
    opt = utf.half_update("sgd", "stochastic", seed=3)
    assert isinstance(opt, utf.LossScaleOptimizer) and not opt.loss_scale_config.enabled
    assert (opt._update_mode, opt._update_seed) == ("stochastic", 3)
    with pytest.raises(TypeError, match="takes the plain Keras optimizer"):
        utf.half_update(opt, "kahan")
    with pytest.raises(ValueError, match="update must be one of"):
        utf.LossScaleOptimizer(keras.optimizers.SGD(), update="fast")
    with pytest.raises(TypeError, match="seed must be an integer"):
        utf.LossScaleOptimizer(keras.optimizers.SGD(), update="kahan", seed="1")
    # the refusals every backend shares, through half_update: tests/conformance/test_half_update.py


def test_the_stochastic_seed_cannot_change_after_fit_traced_the_update():
    """The breaker's finding: a seed set after fit was reported but the traced graph kept the
    old one (the weights were those of seed 0). It is refused once a tf.function traced the
    update; before that it is taken, and setting the same seed again is harmless."""
    mp = utf.MixedPrecision("bf16-stochastic")
    with mp.autocast():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    mp.prepare(model, keras.optimizers.SGD(1e-2), loss="mse")
    opt = model.optimizer
    opt.update_seed = 7  # nothing traced yet: taken
    assert opt.update_seed == 7
    x = np.ones((8, 3), np.float32)
    model.fit(x, np.zeros((8, 2), np.float32), epochs=1, batch_size=8, verbose=0)
    opt.update_seed = 7
    with pytest.raises(ValueError, match="cannot change after a tf.function"):
        opt.update_seed = 12345
    assert opt.update_seed == 7 and opt.get_config()["seed"] == 7
