"""tensorflow backend, ``scaling``: the loss-scale state and its update against the reference and the framework's own scaler."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import unimp
import unimp.backends.tensorflow as utf
from backends.tensorflow.helpers import F32, INF, lso
from unimp.loss_scale import DynamicLossScale, StaticLossScale, simulate


def test_growth_never_reaches_inf():
    opt = lso(DynamicLossScale(init_scale=3e38, growth_interval=1, min_scale=None, max_scale=None))
    w = keras.Variable(1.0)
    opt.apply_gradients([(tf.constant(1.0), w)])
    assert opt.dynamic_scale.numpy() == F32(3e38)


configs = st.builds(
    DynamicLossScale,
    init_scale=st.sampled_from([1.0, 8.0, 2.0**15, 2.0**24]),
    growth_factor=st.sampled_from([2.0, 3.0, 1.5]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.7]),
    growth_interval=st.integers(1, 4),
    min_scale=st.sampled_from([None, 1.0]),
    max_scale=st.sampled_from([None, 2.0**24]),
)


events = st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=14)


@settings(max_examples=20, deadline=None)
@given(config=configs, flags=events)
def test_matches_reference_bit_for_bit(config, flags):
    opt = lso(config)
    w = keras.Variable(1.0)
    expected = simulate(config, flags)
    for (grads_finite, loss_finite), state in zip(flags, expected, strict=True):
        opt.scale_loss(tf.constant(1.0 if loss_finite else INF))
        opt.apply([tf.constant(1.0 if grads_finite else np.nan)], [w])
        assert opt._state() == state


@settings(max_examples=8, deadline=None)
@given(clean=st.lists(st.booleans(), min_size=1, max_size=16), seed=st.integers(0, 2**16))
@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_matches_keras_loss_scale_optimizer(inner, clean, seed):
    rng = np.random.default_rng(seed)
    init = [
        rng.standard_normal((3, 2)).astype(np.float32),
        rng.standard_normal(2).astype(np.float32),
    ]
    make = {
        "sgd": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(1e-3),
    }
    ref = keras.optimizers.LossScaleOptimizer(make[inner](), dynamic_growth_steps=3)
    ours = lso(DynamicLossScale.preset("keras", growth_interval=3), make[inner]())
    w_ref = [keras.Variable(a) for a in init]
    w_ours = [keras.Variable(a) for a in init]
    for ok in clean:
        grads = [
            tf.constant(rng.standard_normal(a.shape).astype(np.float32) * 2.0**15) for a in init
        ]
        if not ok:
            grads[1] = tf.tensor_scatter_nd_update(grads[1], [[0]], [INF])
        ref.apply(grads, w_ref)
        ours.apply(grads, w_ours)
        assert ours.dynamic_scale.numpy() == ref.dynamic_scale.numpy()
        for a, b in zip(w_ref, w_ours, strict=True):
            assert a.numpy().tobytes() == b.numpy().tobytes()
    assert int(ours.iterations.numpy()) == int(ref.iterations.numpy()) == sum(clean)


@pytest.mark.parametrize("seed, jit_compile", [(0, False), (1, False), (2, True)])
def test_matches_keras_loss_scale_optimizer_compiled(seed, jit_compile):
    rng = np.random.default_rng(seed)
    clean = rng.random(12) > 0.4
    ref = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3), dynamic_growth_steps=2)
    ours = lso(DynamicLossScale.preset("keras", growth_interval=2), keras.optimizers.Adam(1e-3))
    init = rng.standard_normal(4).astype(np.float32)
    w_ref, w_ours = keras.Variable(init), keras.Variable(init)
    ref_step = tf.function(lambda g: ref.apply([g], [w_ref]), jit_compile=jit_compile)
    our_step = tf.function(lambda g: ours.apply([g], [w_ours]), jit_compile=jit_compile)
    for ok in clean:
        g = rng.standard_normal(4).astype(np.float32) * np.float32(2.0**14)
        if not ok:
            g[2] = np.nan
        ref_step(tf.constant(g))
        our_step(tf.constant(g))
        assert ours.dynamic_scale.numpy() == ref.dynamic_scale.numpy()
        assert w_ours.numpy().tobytes() == w_ref.numpy().tobytes()
    assert int(ours.iterations.numpy()) == int(ref.iterations.numpy()) == int(clean.sum())


def _used_optimizer():
    opt = lso(DynamicLossScale(init_scale=1024.0, growth_interval=2), keras.optimizers.Adam(0.01))
    w = keras.Variable(np.ones(2, np.float32))
    opt.apply([tf.constant([INF, 1.0])], [w])
    opt.apply([tf.constant([1.0, 2.0])], [w])
    return opt, w


def test_state_dict_round_trip_and_resume():
    opt, _ = _used_optimizer()
    saved = json.loads(json.dumps(opt.state_dict()))
    assert saved["state"] == {
        "scale": 512.0,
        "counter": 1,
        "consecutive_skips": 0,
        "total_skips": 1,
        "hysteresis_used": 0,
        "overflows_since_rescale": 0,
        "steps_since_rescale": 0,
        "floor_hits": 0,
    }
    fresh = lso(DynamicLossScale(init_scale=1024.0, growth_interval=2))
    fresh.load_state_dict(saved)
    fresh.apply([tf.constant(1.0)], [keras.Variable(0.0)])
    assert float(fresh.dynamic_scale.numpy()) == 1024.0 and int(fresh.counter.numpy()) == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"scale": 65536.0, "_growth_tracker": 3},
        {
            "format": "unimp.loss_scale/1",
            "config": {"kind": "dynamic", "init_scale": 1024.0, "growth_interval": 2},
            "state": {"scale": -1.0},
        },
        "not a dict",
    ],
)
def test_load_state_dict_rejects_bad_input_and_changes_nothing(bad):
    opt, _ = _used_optimizer()
    before = opt.state_dict()
    with pytest.raises(ValueError):
        opt.load_state_dict(bad)
    assert opt.state_dict() == before


STATIC_8 = {
    "format": "unimp.loss_scale/1",
    "config": {"kind": "static", "scale": 8.0},
    "state": {"scale": 8.0, "counter": 0, "consecutive_skips": 0, "total_skips": 2,
              "hysteresis_used": 0, "overflows_since_rescale": 0, "steps_since_rescale": 0, "floor_hits": 0},
}


def test_load_state_dict_adopts_the_saved_config_before_tracing():
    # as torch and JAX (and torch.amp's load_state_dict, which takes the saved factors)
    opt, w = _used_optimizer()  # eager steps: nothing traced
    opt.load_state_dict(STATIC_8)
    assert opt.loss_scale_config == StaticLossScale(8.0)
    assert opt.state_dict() == STATIC_8
    opt.apply([tf.constant([1.0, 2.0])], [w])
    assert float(opt.dynamic_scale.numpy()) == 8.0 and int(opt.total_skips.numpy()) == 2


def test_load_state_dict_refuses_a_new_config_once_traced_and_changes_nothing():
    opt = lso(DynamicLossScale(init_scale=1024.0, growth_interval=2), keras.optimizers.Adam(0.01))
    w = keras.Variable(np.ones(2, np.float32))
    tf.function(lambda g: opt.apply([g], [w]))(tf.constant([1.0, 2.0]))
    before = opt.state_dict()
    with pytest.raises(ValueError, match="TrainStep.load_state_dict"):
        opt.load_state_dict(STATIC_8)
    assert opt.state_dict() == before
    same_config = dict(before, state=dict(before["state"], scale=64.0))
    opt.load_state_dict(same_config)  # the same config loads at any time
    assert float(opt.dynamic_scale.numpy()) == 64.0


def test_after_tracing_a_config_differing_only_outside_the_rule_is_adopted():
    # init_scale only sets the first state and max_consecutive_skips is checked on the host:
    # no traced graph has them built in (torch and JAX adopt them too)
    cfg = DynamicLossScale(init_scale=1024.0, growth_interval=2)
    opt = lso(cfg, keras.optimizers.SGD(0.0))
    w = keras.Variable(np.ones(2, np.float32))
    tf.function(lambda g: opt.apply([g], [w]))(tf.constant([1.0, 2.0]))
    new = cfg.replace(init_scale=8.0, max_consecutive_skips=5)
    opt.load_state_dict(unimp.state_dict(new))
    assert opt.loss_scale_config == new and float(opt.dynamic_scale.numpy()) == 8.0


def test_keras_checkpoint_round_trip(tmp_path):
    # seeded: some initial kernels make fit's first float16 step overflow at 32768 (a correct
    # skip, but the count below is of the one planted NaN step)
    keras.utils.set_random_seed(0)
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    with mp.autocast():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    _, opt = mp.prepare(model, keras.optimizers.Adam(0.01), loss="mse")
    x, y = np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32)
    model.fit(x, y, epochs=1, batch_size=2, verbose=0)
    opt.apply(
        [tf.fill(v.shape, np.nan) for v in model.trainable_variables], model.trainable_variables
    )
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.optimizer) is utf.LossScaleOptimizer
    assert loaded.optimizer.loss_scale_config == opt.loss_scale_config
    assert loaded.optimizer.state_dict() == opt.state_dict()
    assert loaded.optimizer.state_dict()["state"]["total_skips"] == 1
    assert int(loaded.optimizer.iterations.numpy()) == 2


def test_keras_checkpoint_keeps_the_trainers_fields(tmp_path):
    # a rule with hysteresis holds its format-2 fields in one more variable, saved and loaded
    cfg = DynamicLossScale.preset("megatron", init_scale=1024.0, growth_interval=3)
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow", loss_scale=cfg)
    with mp.autocast():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    _, opt = mp.prepare(model, keras.optimizers.SGD(0.01), loss="mse")
    model.fit(np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32), batch_size=4, verbose=0)
    opt.apply([tf.fill(v.shape, np.inf) for v in model.trainable_variables], model.trainable_variables)
    assert opt.state_dict()["state"]["hysteresis_used"] == 1 and float(opt.loss_scale) == 1024.0
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.optimizer.loss_scale_config == cfg
    assert loaded.optimizer.state_dict() == opt.state_dict()


def test_tf_train_checkpoint_round_trip(tmp_path):
    opt, w = _used_optimizer()
    prefix = tf.train.Checkpoint(optimizer=opt).save(str(tmp_path / "ckpt"))
    fresh = lso(DynamicLossScale(init_scale=1024.0, growth_interval=2), keras.optimizers.Adam(0.01))
    fresh.build([keras.Variable(np.ones(2, np.float32))])
    tf.train.Checkpoint(optimizer=fresh).restore(prefix).assert_existing_objects_matched()
    assert fresh.state_dict() == opt.state_dict()


def test_get_config_round_trip():
    opt = lso(
        DynamicLossScale(init_scale=64.0, growth_factor=3.0, max_scale=None),
        keras.optimizers.Adam(0.5),
    )
    again = utf.LossScaleOptimizer.from_config(opt.get_config())
    assert again.loss_scale_config == opt.loss_scale_config
    assert float(again.learning_rate.numpy()) == 0.5
