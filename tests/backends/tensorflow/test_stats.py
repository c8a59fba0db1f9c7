"""tensorflow backend, ``stats``: ``tensor_stats`` in graphs and of IndexedSlices, and
``train_step(..., stats_every=k)`` (a second tf.function for statistics steps, the plain graph
unchanged, layer calls restored, names, accumulation under XLA, strategies). The values against
the reference, unscaled gradients, the dtypes, the refusals and the docstring examples (every
backend) are in tests/conformance/test_stats_conformance.py."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import pytest
import tensorflow as tf

import unimp
import unimp.backends.tensorflow as utf
from benchmarks._kit_tensorflow import HOST_OPS, _all_ops

X = np.linspace(-2, 2, 24, dtype=np.float32).reshape(6, 4)


def _mlp(mp):
    with mp.autocast():
        return keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="l1"),
             keras.layers.Dense(3, name="l2")],
            name="net",
        )


def _loss(m, x):
    return tf.reduce_mean(tf.square(tf.cast(m(x), tf.float32)))


def _step(stats_every=None, recipe="mixed_float16", **kw):
    mp = unimp.mixed_precision(recipe, backend="tensorflow")
    model = _mlp(mp)
    model, opt = mp.prepare(model, keras.optimizers.SGD(0.1))
    return mp.train_step(model, opt, _loss, stats_every=stats_every, **kw), model


def _op_types(function, batch):
    return sorted(op.type for op in _all_ops(function.get_concrete_function(batch).graph))


def test_the_plain_graph_is_unchanged():
    plain, _ = _step()
    with_option, _ = _step(stats_every=5)
    x = tf.constant(X)
    assert _op_types(with_option.function, x) == _op_types(plain.function, x)
    assert len(_op_types(with_option.stats_function, x)) > len(_op_types(plain.function, x))
    assert plain.stats_function is None


def test_statistics_steps_run_their_own_function_traced_once():
    step, _ = _step(stats_every=2)
    results = [step(X) for _ in range(5)]
    assert [r.stats is not None for r in results] == [True, False, True, False, True]
    assert step.tracing_count() == 1
    assert step.stats_function.experimental_get_tracing_count() == 1
    assert not [t for t in _op_types(step.stats_function, tf.constant(X)) if t in HOST_OPS]
    assert [r.stats.step for r in results if r.stats is not None] == [0, 2, 4]


def test_names_and_scales():
    # one naming rule in every backend: from the model down, without the model's own name
    # (Keras puts "net/" first in a Sequential's paths, not in a functional model's)
    step, model = _step(stats_every=1)
    r = step(X)
    s = r.stats
    assert [v.path for v in model.trainable_variables][0] == "net/l1/kernel"
    assert list(s.gradients) == ["l1/kernel", "l1/bias", "l2/kernel", "l2/bias"]
    assert list(s.activations) == ["l1", "l2"]
    assert s.activations["l1"].size == 6 * 8 and s.activations["l1"].scale == 1.0
    assert s.gradients["l2/bias"].scale == r.scale == 32768.0
    # the README's lookups: torch's spelling and Keras's layer.path resolve too
    assert s.gradients["l1.kernel"] is s.gradients["l1/kernel"] and s.activations["net/l1"] is s.activations["l1"]
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    with mp.autocast():
        x = keras.Input((4,))
        out = keras.layers.Dense(3, name="l2")(keras.layers.Dense(8, activation="relu", name="l1")(x))
        functional = keras.Model(x, out, name="net")
    functional, opt = mp.prepare(functional, keras.optimizers.SGD(0.1))
    f = mp.train_step(functional, opt, _loss, stats_every=1)(X).stats
    assert list(f.gradients) == list(s.gradients) and list(f.activations) == list(s.activations)


def test_layer_calls_are_restored_and_compose_with_prepare():
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    with mp.autocast():
        layer = keras.layers.Dense(2, name="solo")
    layer.build((None, 4))
    layer, opt = mp.prepare(layer, keras.optimizers.SGD(0.1))  # a model that is one layer
    prepared_call = layer.__dict__["call"]
    step = mp.train_step(layer, opt, _loss, stats_every=1)
    s = step(X).stats
    assert layer.__dict__["call"] is prepared_call
    assert list(s.activations) == ["solo"]
    assert layer(X).dtype == tf.float32  # still the prepared output cast
    model = step.model
    inner, _ = _step(stats_every=1)
    inner(X)
    assert all("call" not in sub.__dict__ for sub in inner.model.layers)
    assert model is layer


def test_accumulation_takes_every_micro_batch_and_xla_agrees():
    step, model = _step(stats_every=1, grad_accum_steps=2)
    xla, other = _step(stats_every=1, grad_accum_steps=2, jit_compile=True)
    other.set_weights(model.get_weights())
    a, b = step([X, X]).stats, xla([X, X]).stats
    assert a.activations["l1"].size == 2 * 6 * 8
    for name in a.activations:
        assert dict(a.activations[name].counts) == dict(b.activations[name].counts)
        assert a.activations[name].amax == pytest.approx(b.activations[name].amax, rel=1e-6)


def test_a_strategy_is_refused_with_the_fix():
    mp = unimp.mixed_precision("float32", backend="tensorflow")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = _mlp(mp)
    with pytest.raises(ValueError, match=r"tf\.distribute strategy.*drop stats_every="):
        mp.train_step(model, keras.optimizers.SGD(0.1), _loss, stats_every=1)


def test_tensor_stats_in_graphs_and_of_indexed_slices():
    x = tf.constant([0.0, 2.0**-30, -3.0, np.inf])
    eager = [t.numpy() for t in utf.tensor_stats(x, 2.0**10)]
    graph = [t.numpy() for t in tf.function(lambda t: utf.tensor_stats(t, 2.0**10))(x)]
    xla = [t.numpy() for t in tf.function(lambda t: utf.tensor_stats(t, 2.0**10), jit_compile=True)(x)]
    for got in (graph, xla):
        assert (got[0] == eager[0]).all() and (got[1] == eager[1]).all()
    sparse = tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([1]), tf.constant([3, 2]))
    assert utf.tensor_stats(sparse)[0].numpy()[0] == 4  # taken densely: four zeros


def test_functional_and_nested_models_name_outputs_as_their_weights():
    mp = unimp.mixed_precision("float32", backend="tensorflow")
    inp = keras.Input((4,))
    inner = keras.Sequential([keras.layers.Dense(5, name="i1"), keras.layers.ReLU(name="r")], name="inner")
    shared = keras.layers.Dense(5, name="shared")
    out = keras.layers.Dense(2, name="d2")(shared(inner(keras.layers.Dense(5, name="d1")(inp))))
    model = keras.Model(inp, out, name="func")
    step = mp.train_step(model, keras.optimizers.SGD(0.1), _loss, stats_every=1)
    s = step(X).stats
    assert list(s.activations) == ["d1", "inner/i1", "inner/r", "shared", "d2"]
    layers = {n.rsplit("/", 1)[0] for n in s.gradients}
    assert layers == {"d1", "inner/i1", "shared", "d2"} <= set(s.activations)
