import os

from conftest import require_backend

# Quiet TensorFlow's C++ logging and select Keras's TensorFlow backend for this test process
# only (unimp itself never sets environment variables).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

utf = require_backend("tensorflow")

import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import unimp  # noqa: E402
from unimp.backends._base import COMMON_API, MixedPrecisionBase  # noqa: E402
from unimp.loss_scale import DynamicLossScale, NoLossScale, StaticLossScale, simulate  # noqa: E402

F32 = np.float32
INF = float("inf")


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


@tf.custom_gradient
def _grad_times(x, factor):
    """Identity forward; multiplies the incoming gradient by ``factor`` (inject inf grads)."""

    def grad(dy):
        return dy * factor, tf.zeros_like(factor)

    return tf.identity(x), grad


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


def linear_loss(model, batch):
    """loss = sum(w * c): the gradient is c (times batch["inj"], 1 or inf)."""
    w = _grad_times(model.w, batch["inj"])
    return tf.reduce_sum(w * batch["c"])


def vec_batch(c, inj=1.0):
    return {"c": np.asarray(c, np.float32), "inj": np.float32(inj)}


def seed_model(mp):
    with mp.autocast():
        return keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dropout(0.2),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )


def op_dtypes(model, x, op_type):
    fn = tf.function(lambda x: model(x, training=False))
    graph = fn.get_concrete_function(tf.TensorSpec(x.shape, x.dtype)).graph
    return [op.get_attr("T").name for op in graph.get_operations() if op.type == op_type]


def lso(loss_scale, inner=None):
    return utf.LossScaleOptimizer(inner or keras.optimizers.SGD(0.1), loss_scale)


# ------------------------------------------------------------------------------------------
# module surface
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", COMMON_API)
def test_exports_common_api(name):
    assert name in utf.__all__
    assert getattr(utf, name) is not None


def test_mixed_precision_subclasses_base_and_registry_returns_it():
    mp = unimp.mixed_precision("mixed_float16", backend="tf")
    assert isinstance(mp, utf.MixedPrecision) and isinstance(mp, MixedPrecisionBase)
    assert mp.compute_dtype == tf.float16 and mp.param_dtype == tf.float32
    assert mp.output_dtype == tf.float32
    assert utf.StepResult is unimp.StepResult


@pytest.mark.parametrize("other", ["jax", "torch", "numpy"])
def test_other_keras_backend_is_a_clear_error(monkeypatch, other):
    # what the import of unimp.backends.tensorflow runs (checked in-process: a subprocess
    # importing TensorFlow costs ~10 s on this machine)
    monkeypatch.setattr(keras.backend, "backend", lambda: other)
    with pytest.raises(ImportError, match="KERAS_BACKEND=tensorflow") as info:
        utf._check_keras()
    assert repr(other) in str(info.value)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("float16", tf.float16),
        ("bf16", tf.bfloat16),
        ("float", tf.float32),
        (tf.float64, tf.float64),
    ],
)
def test_to_dtype(name, expected):
    assert utf.to_dtype(name) == expected


def test_framework_version_and_device_info():
    assert utf.framework_version() == tf.__version__
    info = utf.device_info()
    assert info and {"device", "kind", "float16", "bfloat16", "recommended"} <= set(info[0])
    assert info[0]["kind"] == "cpu" and info[0]["recommended"] == "float32"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cast_tree_casts_floating_leaves_only(dtype):
    ids = tf.constant([1, 2], tf.int32)
    mask = tf.constant([True, False])
    tree = {
        "x": tf.ones(3),
        "v": tf.Variable(tf.ones(2, tf.float64)),
        "np": np.ones(2, np.float32),
        "ids": ids,
        "mask": mask,
        "n": 3.5,
        "s": "text",
        "nested": [np.arange(3), (tf.zeros(1),)],
    }
    out = utf.cast_tree(tree, dtype)
    target = utf.to_dtype(dtype)
    assert out["x"].dtype == target and out["v"].dtype == target and out["np"].dtype == target
    assert out["nested"][1][0].dtype == target
    assert out["ids"] is ids and out["mask"] is mask
    assert out["n"] == 3.5 and out["s"] == "text"
    assert out["nested"][0].dtype == np.int64


@pytest.mark.parametrize(
    "tree, expected",
    [
        ([tf.ones(3), tf.constant([1, 2])], True),
        ([tf.constant([1.0, INF])], False),
        ({"a": tf.constant([np.nan], tf.float16)}, False),
        ([tf.constant([INF], tf.bfloat16), None], False),
        ([tf.IndexedSlices(tf.constant([[INF]]), tf.constant([0]), tf.constant([4, 1]))], False),
        ([], True),
    ],
)
def test_all_finite(tree, expected):
    result = utf.all_finite(tree)
    assert result.dtype == tf.bool and bool(result) is expected


# ------------------------------------------------------------------------------------------
# dtype policies
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy, half", [("mixed_float16", "float16"), ("mixed_bfloat16", "bfloat16")]
)
def test_dtype_audit(policy, half):
    mp = unimp.mixed_precision(policy, backend="tensorflow")
    model = seed_model(mp)
    mp.prepare(model)
    assert all(v.dtype == "float32" for v in model.weights)
    x = tf.random.uniform((4, 784))
    # hidden Dense matmul in the compute dtype, output Dense (and its softmax) in float32
    assert op_dtypes(model, x, "MatMul") == [half, "float32"]
    assert op_dtypes(model, x, "Softmax") == ["float32"]
    assert model(x).dtype == tf.float32
    hidden = model.layers[0](x)
    assert hidden.dtype == utf.to_dtype(half)


def test_seed_model_softmax_is_float16_without_prepare():
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    model = seed_model(mp)
    x = tf.random.uniform((2, 784))
    assert op_dtypes(model, x, "Softmax") == ["float16"]  # what prepare fixes
    mp.prepare(model)
    assert op_dtypes(model, x, "Softmax") == ["float32"]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_autocast_sets_and_restores_policy_even_on_exception(policy):
    mp = unimp.mixed_precision(policy, backend="tensorflow")
    before = keras.config.dtype_policy()
    assert isinstance(mp.dtype_policy, keras.DTypePolicy) and mp.dtype_policy.name == policy
    with pytest.raises(RuntimeError, match="boom"):
        with mp.autocast() as active:
            assert keras.config.dtype_policy().name == policy == active.name
            layer = keras.layers.Dense(2)
            raise RuntimeError("boom")
    assert keras.config.dtype_policy() == before
    assert layer.compute_dtype == policy.split("_")[1] and layer.variable_dtype == "float32"


def test_batchnorm_statistics_in_float32():
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    with mp.autocast():
        bn = keras.layers.BatchNormalization()
    x = tf.cast(tf.linspace(0.0, 600.0, 64)[:, None], tf.float16)  # x**2 overflows float16
    y = bn(x, training=True)
    assert bn.moving_mean.dtype == "float32"
    assert y.dtype == tf.float16 and bool(utf.all_finite(y))
    assert float(bn.moving_variance.numpy()[0]) > 1.0


def test_integer_inputs_and_labels_never_cast():
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    with mp.autocast():
        model = keras.Sequential(
            [
                keras.Input((5,), dtype="int32"),
                keras.layers.Embedding(50, 8),
                keras.layers.Flatten(),
                keras.layers.Dense(3),
            ]
        )
    model, _ = mp.prepare(
        model, "sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    ids = tf.constant(np.random.randint(0, 50, (16, 5)), tf.int32)
    labels = tf.constant(np.random.randint(0, 3, 16), tf.int32)
    assert mp.cast_to_compute((ids, labels)) == (ids, labels)
    out = model(ids)
    assert out.dtype == tf.float32
    model.fit(ids, labels, epochs=1, batch_size=8, verbose=0)
    assert labels.dtype == tf.int32


# ------------------------------------------------------------------------------------------
# LossScaleOptimizer: right values and the unscale-once contract
# ------------------------------------------------------------------------------------------


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


def test_growth_never_reaches_inf():
    opt = lso(DynamicLossScale(init_scale=3e38, growth_interval=1, min_scale=None, max_scale=None))
    w = keras.Variable(1.0)
    opt.apply_gradients([(tf.constant(1.0), w)])
    assert opt.dynamic_scale.numpy() == F32(3e38)


# ------------------------------------------------------------------------------------------
# the reference algorithm and Keras itself
# ------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------
# fit, compile, checkpoints, state
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy, jit_compile",
    [("mixed_float16", False), ("mixed_float16", True), ("mixed_bfloat16", False)],
)
def test_seed_model_fit(policy, jit_compile):
    mp = unimp.mixed_precision(policy, backend="tensorflow")
    model = seed_model(mp)
    model, opt = mp.prepare(
        model, "adam", loss="sparse_categorical_crossentropy", jit_compile=jit_compile
    )
    assert type(model.optimizer) is utf.LossScaleOptimizer and model.optimizer is opt
    x = np.random.rand(128, 784).astype(np.float32)
    y = np.random.randint(0, 10, 128)
    hist = model.fit(x, y, epochs=2, batch_size=32, verbose=0)
    assert all(math.isfinite(v) for v in hist.history["loss"])
    assert model.predict(x[:4], verbose=0).dtype == np.float32
    expected_scale = 2.0**15 if policy == "mixed_float16" else 1.0
    assert int(opt.iterations.numpy()) == 8 and float(opt.dynamic_scale.numpy()) == expected_scale


def test_fit_forward_overflow_skips_without_lowering_scale():
    # Keras's own optimizer would halve the scale here; unimp's rule leaves it (loss not finite)
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    model, opt = mp.prepare(seed_model(mp), "sgd", loss="sparse_categorical_crossentropy")
    x = np.random.rand(64, 784).astype(np.float32)
    x[:32] = np.inf  # first batch: the forward pass overflows
    y = np.random.randint(0, 10, 64)
    model.fit(x, y, epochs=1, batch_size=32, shuffle=False, verbose=0)
    assert float(opt.dynamic_scale.numpy()) == 2.0**15
    assert int(opt.iterations.numpy()) == 1
    assert (int(opt.total_skips.numpy()), int(opt.consecutive_skips.numpy())) == (1, 0)
    assert bool(utf.all_finite(model.trainable_variables))


def test_plain_compile_does_not_wrap_unimp_optimizer_again():
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    model = seed_model(mp)
    opt = mp.loss_scale_optimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    assert model.optimizer is opt


def test_prepare_replaces_keras_loss_scale_optimizer():
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    inner = keras.optimizers.SGD(0.01)
    _, opt = mp.prepare(seed_model(mp), keras.optimizers.LossScaleOptimizer(inner))
    assert type(opt) is utf.LossScaleOptimizer and opt.inner_optimizer is inner


def test_prepare_warns_about_model_compiled_with_keras_optimizer():
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    model = seed_model(mp)
    model.compile("adam", loss="sparse_categorical_crossentropy")
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer  # Keras wrapped it
    with pytest.warns(UserWarning, match="Compile through prepare"):
        mp.prepare(model)


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
    "state": {"scale": 8.0, "counter": 0, "consecutive_skips": 0, "total_skips": 2},
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


def test_keras_checkpoint_round_trip(tmp_path):
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


_MIRRORED = """
import json, os
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np, unimp
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
with strategy.scope():
    with mp.autocast():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3, activation="softmax")])
    model, opt = mp.prepare(model, "adam", loss="sparse_categorical_crossentropy")
x = np.random.rand(32, 8).astype("float32")
x[12:16] = np.inf  # forward overflow on the second replica of the first global batch only
y = np.random.randint(0, 3, 32)
model.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)
v = model.trainable_variables[0].value
print(json.dumps({"iterations": int(opt.iterations.numpy()), "scale": float(opt.dynamic_scale.numpy()),
                  "skips": int(opt.total_skips.numpy()),
                  "in_sync": bool((v.values[0].numpy() == v.values[1].numpy()).all())}))
"""


def test_fit_under_mirrored_strategy():
    # two logical CPUs must be configured before TensorFlow starts: a fresh process
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "tensorflow"}
    proc = subprocess.run(
        [sys.executable, "-c", _MIRRORED], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # the overflowing replica skips the step on every replica, without lowering the scale
    assert out == {"iterations": 1, "scale": 2.0**15, "skips": 1, "in_sync": True}


# ------------------------------------------------------------------------------------------
# train_step
# ------------------------------------------------------------------------------------------


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


def test_train_step_forward_overflow_keeps_scale():
    model, step = _step(init=(1.0, 2.0))
    r = step(vec_batch([INF, 1.0]))
    assert r.loss_finite is False and r.applied is False and r.consecutive_skips == 1
    assert float(step.optimizer.dynamic_scale.numpy()) == r.scale == 2.0**15
    np.testing.assert_array_equal(model.w.numpy(), np.array([1.0, 2.0], np.float32))


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


def test_train_step_state_dict_round_trip():
    _, step = _step()
    step(vec_batch([1.0, 1.0], np.inf))
    saved = step.state_dict()
    _, other = _step()
    other.load_state_dict(saved)
    assert other.state_dict() == saved and saved["state"]["scale"] == 2.0**14


# ------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------


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
            lambda: utf.LossScaleOptimizer(keras.optimizers.SGD(loss_scale_factor=8.0)),
            ValueError,
            "loss_scale_factor",
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
            TypeError,
            "inner optimizer",
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


def test_loss_scale_optimizer_mismatch_with_recipe():
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    other = lso(StaticLossScale(8.0))
    with pytest.raises(ValueError, match="differs"):
        mp.prepare(Vec([1.0]), other)


def test_none_loss_scale_keeps_scale_one_and_counts_skips():
    opt = lso(NoLossScale())
    w = keras.Variable(1.0)
    opt.apply([tf.constant(np.nan)], [w])
    assert float(opt.dynamic_scale.numpy()) == 1.0 and int(opt.total_skips.numpy()) == 1


def test_prepare_warns_when_model_built_outside_autocast():
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.warns(UserWarning, match="autocast"):
        mp.prepare(model)


# ------------------------------------------------------------------------------------------
# examples
# ------------------------------------------------------------------------------------------

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _example(name):
    import runpy

    return runpy.run_path(os.path.join(EXAMPLES, name), run_name="unimp_example")["main"]


def test_example_keras_mlp_fit():
    before = keras.config.dtype_policy()
    out = _example("keras_mlp_fit.py")(samples=256, epochs=1, batch_size=64)
    assert out["output_dtype"] == np.float32 and math.isfinite(out["history"]["loss"][0])
    assert (
        type(out["optimizer"]) is utf.LossScaleOptimizer
        and int(out["optimizer"].iterations.numpy()) == 4
    )
    assert keras.config.dtype_policy() == before


def test_example_tf_keras2_custom_loop():
    out = _example("tf_keras2_custom_loop.py")(samples=256, epochs=1, batch_size=64)
    opt = out["optimizer"]
    assert math.isfinite(out["losses"][0])
    # every one of the 4 batches is either applied or counted as skipped, never both
    assert int(opt.iterations.numpy()) + int(opt.total_skips.numpy()) == 4
    assert out["model"].output.dtype == "float32"


def test_pure_float16_adam_warns_when_keras_builds_float16_slots():
    mp = unimp.mixed_precision("float16", backend="tensorflow")
    with mp.autocast():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.warns(unimp.HalfOptimizerStateWarning, match="Adam keeps its moments in float16"):
        step = mp.train_step(model, keras.optimizers.Adam(1e-3), lambda m, b: tf.reduce_mean(m(b)))
    assert {v.dtype for v in step.optimizer.inner_optimizer.variables if "momentum" in v.name} == {"float16"}


@pytest.mark.parametrize(
    "recipe,make_opt",
    [
        ("float16", lambda: keras.optimizers.SGD(0.1, momentum=0.9)),
        ("float16", lambda: keras.optimizers.Adam(1e-3, epsilon=1e-4)),
        ("mixed_float16", lambda: keras.optimizers.Adam(1e-3)),
        ("bfloat16", lambda: keras.optimizers.Adam(1e-3)),
    ],
)
def test_no_half_state_warning_where_the_state_is_safe(recipe, make_opt):
    import warnings

    mp = unimp.mixed_precision(recipe, backend="tensorflow")
    with mp.autocast():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", unimp.HalfOptimizerStateWarning)
        mp.train_step(model, make_opt(), lambda m, b: tf.reduce_mean(m(b)))


def test_half_state_warning_for_a_prebuilt_optimizer_and_numpy_eps_points_at_the_caller():
    mp = unimp.mixed_precision("float16", backend="tensorflow")
    with mp.autocast():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    adam = keras.optimizers.Adam(1e-3, epsilon=np.float32(1e-8))
    adam.build(model.trainable_variables)  # built before unimp wraps it
    with pytest.warns(unimp.HalfOptimizerStateWarning, match="becomes 0 in float16") as caught:
        mp.train_step(model, adam, lambda m, b: tf.reduce_mean(m(b)))
    assert caught[0].filename == __file__


def test_device_does_not_start_the_tensorflow_runtime():
    # virtual devices and memory growth can only be configured before the runtime starts
    code = (
        "import os; os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'\n"
        "import tensorflow as tf\n"
        "from unimp.backends import tensorflow as utf\n"
        "utf.MixedPrecision('mixed_float16', device='cpu')\n"
        "try:\n    utf.MixedPrecision('mixed_float16', device='gpu:3')\nexcept ValueError:\n    pass\n"
        "cpu = tf.config.list_physical_devices('CPU')[0]\n"
        "tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)\n"
        "mp = utf.MixedPrecision('mixed_float16', device='cpu:1')\n"
        "with mp.autocast():\n    pass\n"
        "try:\n    utf.MixedPrecision('mixed_float16', device='cpu:5').autocast().__enter__()\n"
        "except ValueError as e:\n    print('lazy check:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "lazy check: device /CPU:5: TensorFlow has no such device here" in out.stdout
