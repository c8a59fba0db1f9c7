"""Plain-JAX float8 states (``mp.fp8_states`` / ``mp.fp8_matmul``) that stay right when a layer
does not run in a step: skipped by ``lax.cond``, or run only under ``stop_gradient``. Its
states' "gradients" are then 0, so taking them as the states after the step set its scale,
scale_inv and history to 0, its output to 0 from then on, and ``check_state`` refused the
state (Transformer Engine leaves a tensor whose recorded amax is 0 alone: TE PR #825)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import unimp
from unimp import fp8


def _mp():
    mp = unimp.mixed_precision("fp8-delayed", backend="jax")
    mp.fp8_layers(["first", "a", "b", "last"])  # a and b float8
    return mp


def _forward(mp, p, st, x, use_b):
    h = mp.fp8_matmul(st, "a", x, p["a"])
    h = jax.lax.cond(use_b, lambda h: mp.fp8_matmul(st, "b", h, p["b"]), lambda h: h, h)
    return jnp.sum(h.astype(jnp.float32))


def _numpy(states):
    return jax.tree_util.tree_map(np.asarray, states)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        yield


def test_a_layer_skipped_by_cond_keeps_its_states_in_the_train_step():
    mp = _mp()
    params = {"a": jnp.full((4, 4), 0.5), "b": jnp.full((4, 4), 0.25)}

    def loss_fn(p, st, x):
        new = jax.grad(lambda s: _forward(mp, jax.lax.stop_gradient(p), s, x, x[0, 0] > 0))(st)
        return _forward(mp, p, st, x, x[0, 0] > 0), new

    step = mp.train_step(loss_fn, optax.sgd(0.01), params, model_state=mp.fp8_states())
    step(jnp.ones((2, 4)))  # b runs: its states take a step
    before = _numpy(step.model_state)
    step(-jnp.ones((2, 4)))  # b is skipped by lax.cond
    after = _numpy(step.model_state)
    for t in range(3):
        for f in fp8.STATE_FIELDS:
            assert np.asarray(getattr(after["b"][t], f)).tobytes() == np.asarray(getattr(before["b"][t], f)).tobytes()
        fp8.check_state(after["b"][t], mp.recipe.fp8.scaling, fp8.LAYER_TENSORS[t])
    assert not np.array_equal(after["a"][0].amax_history, before["a"][0].amax_history)  # a ran


def test_fp8_update_keeps_what_did_not_run_in_a_loop_of_ones_own():
    mp = _mp()
    p = {"a": jnp.full((4, 4), 0.5), "b": jnp.full((4, 4), 0.25)}
    states = mp.fp8_states()
    x = jnp.ones((2, 4))
    # b runs forward only (stop_gradient on its output): no backward through it, its
    # "gradients" are 0 for all three states
    def fwd(st):
        h = mp.fp8_matmul(st, "a", x, p["a"])
        return jnp.sum(h) + jax.lax.stop_gradient(jnp.sum(mp.fp8_matmul(st, "b", h, p["b"])))

    grads = jax.grad(fwd)(states)
    assert float(grads["b"][1].scale) == 0.0  # what taking the gradients as they are would store
    new = mp.fp8_update(states, grads)
    for t in range(3):
        fp8.check_state(_numpy(new["b"][t]), mp.recipe.fp8.scaling, fp8.LAYER_TENSORS[t])
        assert float(new["b"][t].scale) == 1.0
    assert float(new["a"][1].scale) == 448.0 / 0.5  # a's kernel took its step
    y = mp.fp8_matmul(new, "b", x, p["b"])  # usable: not 0
    assert float(jnp.abs(y).max()) > 0
