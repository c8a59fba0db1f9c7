"""unimp.compat.flax.DynamicScale against flax's own (installed with the "jax" extra)."""


import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.training import dynamic_scale as flax_ds

from unimp.compat import flax as shim

pytestmark = pytest.mark.backend("jax")


@jax.custom_vjp
def _poison(x, bad):
    return x


_poison.defvjp(
    lambda x, bad: (x, bad),
    lambda bad, g: (g * jnp.where(bad, jnp.inf, 1.0), jnp.zeros_like(bad)),
)


def _grads(ds, w, bad):
    """value_and_grad of sum(w * w); with ``bad`` the gradient overflows, the loss stays finite."""
    return ds.value_and_grad(lambda w: _poison(jnp.sum(w * w), jnp.float32(bad)))(w)


@pytest.mark.parametrize("interval, growth, backoff", [(3, 2.0, 0.5), (1, 4.0, 0.25)])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_flax_step_for_step(interval, growth, backoff, seed):
    flags = np.random.default_rng(seed).random(200) > 0.2
    kw = dict(growth_factor=growth, backoff_factor=backoff, growth_interval=interval, scale=2.0**10)
    theirs, ours = flax_ds.DynamicScale(**kw), shim.DynamicScale(**kw)
    w = jnp.array([0.5, -1.5])
    for ok in flags:
        # a gradient overflow with a finite loss: inf only in the gradient of w[0]
        a, b = _grads(theirs, w, not ok), _grads(ours, w, not ok)
        theirs, ours = a.dynamic_scale, b.dynamic_scale
        assert bool(a.finite) == bool(b.finite) == bool(ok)
        assert (float(theirs.scale), int(theirs.fin_steps)) == (float(ours.scale), int(ours.fin_steps))
        if ok:
            np.testing.assert_array_equal(np.asarray(a.grad), np.asarray(b.grad))
            assert float(a.aux) == float(b.aux)


def test_a_flax_training_step_runs_unchanged():
    def train(DynamicScale):  # noqa: N803 - the class, as a flax script imports it
        ds = DynamicScale(growth_interval=2, scale=2.0**4)
        params = {"w": jnp.array([1.0, 2.0])}

        @jax.jit
        def step(params, ds, x):
            grad_fn = ds.value_and_grad(lambda p: (jnp.sum(p["w"] * x) ** 2, {"n": 1}), has_aux=True)
            ds, is_fin, (loss, aux), grads = grad_fn(params)
            new = jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads)
            params = jax.tree_util.tree_map(functools.partial(jnp.where, is_fin), new, params)
            return params, ds, loss

        out = []
        for x in (jnp.array([1.0, 1.0]), jnp.array([jnp.inf, 1.0]), jnp.array([0.5, 1.0])):
            params, ds, loss = step(params, ds, x)
            out.append((float(ds.scale), int(ds.fin_steps)))
        return params, out

    (p_ours, ours), (p_theirs, theirs) = train(shim.DynamicScale), train(flax_ds.DynamicScale)
    np.testing.assert_array_equal(np.asarray(p_ours["w"]), np.asarray(p_theirs["w"]))
    # step 1: an inf input makes the loss inf: flax backs off (16 -> 8), unimp's forward-overflow
    # rule skips without backing off (documented difference); both skip the update
    assert theirs == [(16.0, 1), (8.0, 0), (8.0, 1)]
    assert ours == [(16.0, 1), (16.0, 1), (16.0, 2)]


def test_pytree_children_and_replace_are_flaxs():
    ds = shim.DynamicScale(scale=8.0)
    ref = flax_ds.DynamicScale(scale=8.0)
    assert len(jax.tree_util.tree_leaves(ds)) == len(jax.tree_util.tree_leaves(ref)) == 2
    assert float(ds.replace(scale=4.0).scale) == 4.0
    assert jax.jit(lambda d: d)(ds).growth_interval == 2000


def test_no_floor_never_reaches_zero():
    # flax with minimum_scale=None backs off to 0 after ~150 overflows; unimp floors at 2**-126
    ours = shim.DynamicScale(scale=1.0, minimum_scale=None)
    theirs = flax_ds.DynamicScale(scale=1.0, minimum_scale=None)
    w = jnp.array([0.5, -1.5])
    for _ in range(160):
        ours = _grads(ours, w, True).dynamic_scale
        theirs = _grads(theirs, w, True).dynamic_scale
    assert float(ours.scale) == 2.0**-126
    assert float(theirs.scale) == 0.0


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="growth_factor"):
        shim.DynamicScale(growth_factor=1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        shim.DynamicScale(backoff_factor=2.0)
    with pytest.raises(ValueError, match="growth_interval"):
        shim.DynamicScale(growth_interval=-1)  # 0 is valid in flax: grow on every finite step


def test_a_train_state_holding_it_checkpoints_like_flaxs():
    import flax
    import optax
    from flax.training import train_state

    class TrainState(train_state.TrainState):
        dynamic_scale: object = None

    def make(ds_cls, **kw):
        return TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1),
                                 dynamic_scale=ds_cls(**kw))

    for ds_cls in (shim.DynamicScale, flax_ds.DynamicScale):
        saved = make(ds_cls, scale=512.0, fin_steps=3)
        blob = flax.serialization.to_bytes(saved)
        restored = flax.serialization.from_bytes(make(ds_cls), blob)
        assert (float(restored.dynamic_scale.scale), int(restored.dynamic_scale.fin_steps)) == (512.0, 3)
        assert flax.serialization.to_state_dict(saved)["dynamic_scale"].keys() == {"fin_steps", "scale"}


def test_a_finite_loss_whose_scaled_copy_overflows_backs_off_as_flaxs():
    # 1e34 is finite; 65536 * 1e34 overflows float32, 32768 * 1e34 does not (issue 28 item 12)
    def scales(ds):
        out = []
        for _ in range(3):
            res = ds.value_and_grad(lambda p: p * 1e34)(jnp.float32(1.0))
            ds = res.dynamic_scale
            out.append((float(ds.scale), int(ds.fin_steps), bool(res.finite)))
        return out

    theirs, ours = scales(flax_ds.DynamicScale()), scales(shim.DynamicScale())
    assert theirs[0] == (32768.0, 0, False)
    assert ours == theirs
