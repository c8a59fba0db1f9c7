"""jax backend, ``stats``: ``tensor_stats`` under jit, ``observe`` and ``train_step(...,
stats_every=k)`` (a second jitted function for statistics steps, the plain program unchanged,
flax linen outputs, names, accumulation, model state, remat). The values against the reference,
unscaled gradients, the dtypes, the refusals and the docstring examples (every backend) are in
tests/conformance/test_stats_conformance.py."""


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import unimp
import unimp.backends.jax as ujax
from benchmarks import _kit_jax
from unimp.backends.jax import stats as jstats

X = np.linspace(-2, 2, 24, dtype=np.float32).reshape(6, 4)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.LayerNorm()(nn.Dense(8)(x))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = ujax.observe("hidden", nn.relu(Block()(x)))
        return nn.Dense(3)(h)


NET = Net()
PARAMS = NET.init(jax.random.key(0), jnp.ones((1, 4)))["params"]


def _loss(p, x):
    return jnp.mean(jnp.square(NET.apply({"params": p}, x).astype(jnp.float32)))


def _step(stats_every=None, recipe="mixed_float16", loss_fn=_loss, params=PARAMS, **kw):
    mp = unimp.mixed_precision(recipe, backend="jax")
    return mp.train_step(loss_fn, optax.sgd(0.1), params, stats_every=stats_every, **kw)


def _primitives(fn, step, x):
    """Every primitive of ``fn``'s jaxpr, sub-jaxprs (the jit, scan bodies) included."""
    args = (step.params, step.opt_state, step.loss_scale, jnp.asarray(x))
    return _kit_jax._primitives(jax.make_jaxpr(fn)(*args).jaxpr)


def test_the_plain_program_is_unchanged():
    plain, with_option = _step(), _step(stats_every=5)
    ops = _primitives(plain.jitted, plain, X)
    assert len(ops) > 50
    assert _primitives(with_option.jitted, with_option, X) == ops
    with_stats = _primitives(with_option._stats_jitted, with_option, X)
    assert len(with_stats) > len(ops)
    assert not [p for p in with_stats if any(h in p for h in _kit_jax.HOST_PRIMITIVES)]


def test_statistics_steps_compile_once_and_do_not_transfer():
    step = _step(stats_every=2)
    x = jnp.asarray(X)
    step(x), step(x)  # both functions compiled
    with jax.transfer_guard("disallow"):
        results = [step(x) for _ in range(4)]  # calls 2..5
    assert step.traces == 2  # the plain step and the statistics step, once each
    assert [r.stats is not None for r in results] == [True, False, True, False]
    assert [r.stats.step for r in results if r.stats is not None] == [2, 4]


def test_names_flax_outputs_and_observed_values():
    r = _step(stats_every=1)(X)
    s = r.stats
    assert list(s.gradients) == [
        "Block_0/Dense_0/bias", "Block_0/Dense_0/kernel", "Block_0/LayerNorm_0/bias",
        "Block_0/LayerNorm_0/scale", "Dense_0/bias", "Dense_0/kernel",
    ]
    # leaf modules by path and observed values, in the order the forward pass saw them
    assert list(s.activations) == ["Block_0/Dense_0", "Block_0/LayerNorm_0", "hidden", "Dense_0"]
    assert s.activations["hidden"].size == 6 * 8 and s.activations["hidden"].counts["zeros"] > 0
    assert s.gradients["Dense_0/kernel"].scale == r.scale == 32768.0
    assert s.activations["hidden"].scale == 1.0


def test_accumulation_takes_every_micro_batch():
    step = _step(stats_every=1, grad_accum_steps=2)
    s = step([X, X]).stats
    one = _step(stats_every=1)(X).stats
    for name, a in s.activations.items():
        assert a.size == 2 * one.activations[name].size
        assert {k: 2 * v for k, v in one.activations[name].counts.items()} == dict(a.counts)


def test_model_state_and_donation():
    mp = unimp.mixed_precision("mixed_float16", backend="jax")

    def loss_fn(p, st, x):
        y = jstats.observe("y", x @ p)
        return jnp.mean(y * y), {"n": st["n"] + 1}

    step = mp.train_step(
        loss_fn, optax.sgd(0.1), jnp.ones((4, 2)), model_state={"n": jnp.int32(0)},
        stats_every=1, donate=True,
    )
    s = step(X).stats
    assert list(s.gradients) == [""] and list(s.activations) == ["y"]  # the root leaf's path
    assert int(step.model_state["n"]) == 1


def test_observe_is_the_identity_outside_statistics_steps():
    x = jnp.arange(3.0)
    assert ujax.observe("x", x) is x
    with pytest.raises(TypeError, match="string name"):
        ujax.observe(1, x)


def test_observe_inside_a_transformation_of_the_loss_is_a_clear_error():
    def loss_fn(p, x):
        def body(c, row):
            return c + jnp.sum(ujax.observe("row", row * p)), None

        return jax.lax.scan(body, 0.0, x)[0]

    step = _step(stats_every=2, loss_fn=loss_fn, recipe="float32", params=jnp.ones(4))
    with pytest.raises(ValueError, match="inside a transformation of the loss function"):
        step(X)  # a statistics step
    plain = unimp.mixed_precision("float32", backend="jax").train_step(
        loss_fn, optax.sgd(0.1), jnp.ones(4)
    )
    assert np.isfinite(plain(X).loss)  # elsewhere observe is the identity


def test_flax_modules_under_remat_are_left_out():
    class Remat(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.remat(nn.Dense)(3)(x)

    net = Remat()
    p = net.init(jax.random.key(1), jnp.ones((1, 4)))["params"]
    step = unimp.mixed_precision("float32", backend="jax").train_step(
        lambda q, x: jnp.sum(net.apply({"params": q}, x)), optax.sgd(0.1), p, stats_every=1
    )
    s = step(X).stats
    assert s.activations == {} and len(s.gradients) == 2


def test_axis_name_is_refused_with_the_fix():
    mp = unimp.mixed_precision("float32", backend="jax")
    with pytest.raises(ValueError, match=r"axis_name=.*drop stats_every=.*replica_step"):
        mp.train_step(_loss, optax.sgd(0.1), PARAMS, axis_name="data", stats_every=1)


def test_tensor_stats_under_jit_equal_eager():
    x = jnp.array([0.0, 2.0**-30, -3.0, jnp.inf])
    eager = ujax.tensor_stats(x, 2.0**10)
    jitted = jax.jit(lambda t, s: ujax.tensor_stats(t, s))(x, jnp.float32(2.0**10))
    for a, b in zip(eager, jitted, strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_observed_pytrees_are_named_as_torch_and_keras_name_layer_outputs():
    mp = unimp.mixed_precision("float32", backend="jax")

    def loss_fn(p, x):
        h = x @ p
        pair = jstats.observe("pair", (h, {"sq": h * h}))
        return jnp.mean(pair[0] + pair[1]["sq"])

    s = mp.train_step(loss_fn, optax.sgd(0.1), jnp.ones((4, 2)), stats_every=1)(X).stats
    assert list(s.activations) == ["pair.0", "pair.1.sq"]  # unimp.stats.output_leaves' rule
