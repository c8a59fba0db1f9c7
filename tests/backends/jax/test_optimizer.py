"""jax backend, ``optimizer``: a skipped step leaves the parameters and the optimizer state unchanged; half optimizer state."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import unimp
import unimp.backends.jax as ujax
from backends.jax.helpers import tree_bits
from unimp import loss_scale as core

GRADS = [[np.nan, 0.0], [np.inf, 0.0], [np.nan, 0.0], [0.5, 0.5], [np.nan, 0.0]]


PARAMS_AFTER = [[1, 2], [1, 2], [1, 2], [0.5, 1.5], [0.5, 1.5]]


CONSECUTIVE = [1, 2, 3, 0, 1]


TOTAL = [1, 2, 3, 3, 4]


SCALES = [2.0**14, 2.0**13, 2.0**12, 2.0**12, 2.0**11]


def _run_optax_sequence(n):
    opt = ujax.loss_scaling(optax.sgd(1.0), core.DynamicLossScale(init_scale=2.0**15))
    params = jnp.array([1.0, 2.0])
    state = opt.init(params)
    update = jax.jit(opt.update)
    for g in GRADS[: n + 1]:
        scaled = ujax.get_loss_scale(state).scale(jnp.array(g, jnp.float32))
        updates, state = update(scaled, state, params)
        params = optax.apply_updates(params, updates)
    return params, ujax.get_loss_scale(state)


@pytest.mark.parametrize("step", range(5))
def test_optax_right_values(step):
    params, ls = _run_optax_sequence(step)
    assert params.tolist() == PARAMS_AFTER[step]
    assert int(ls.state.consecutive_skips) == CONSECUTIVE[step]
    assert int(ls.state.total_skips) == TOTAL[step]
    assert float(ls.loss_scale) == SCALES[step]


def test_optax_skip_leaves_inner_state_bitwise_and_params_bitwise():
    opt = ujax.loss_scaling(optax.adam(0.1), "dynamic")
    params = {"w": jnp.array([-0.0, 1.0, -2.0])}
    state = opt.init(params)
    updates, state = opt.update({"w": jnp.array([1.0, 2.0, 3.0])}, state, params)
    params = optax.apply_updates(params, updates)
    params = {"w": params["w"].at[0].set(-0.0)}
    updates, skipped = opt.update({"w": jnp.array([jnp.nan, 2.0, 3.0])}, state, params)
    assert tree_bits(skipped.inner_state) == tree_bits(state.inner_state)
    assert tree_bits(optax.apply_updates(params, updates)) == tree_bits(params)
    assert float(ujax.get_loss_scale(skipped).loss_scale) == 2.0**14


def test_optax_nonfinite_value_skips_without_backoff():
    opt = ujax.loss_scaling(optax.sgd(1.0), "dynamic")
    state = opt.init(jnp.ones(2))
    updates, state = opt.update(jnp.ones(2), state, value=jnp.float32(jnp.inf))
    ls = ujax.get_loss_scale(state)
    assert float(ls.loss_scale) == 2.0**15 and int(ls.state.total_skips) == 1
    assert jnp.all(updates == 0)


def test_get_loss_scale_needs_exactly_one():
    with pytest.raises(ValueError, match="found 0"):
        ujax.get_loss_scale(optax.sgd(1.0).init(jnp.ones(1)))


def test_loss_scaling_rejects_non_optimizer():
    with pytest.raises(TypeError, match="GradientTransformation"):
        ujax.loss_scaling(lambda g: g)


def _multisteps_run(multisteps_cls, micro_grads):
    opt = multisteps_cls(
        ujax.loss_scaling(optax.sgd(1.0), core.DynamicLossScale(init_scale=2.0)), every_k_schedule=2
    )
    params = jnp.array([1.0, 2.0])
    state = opt.init(params)
    update = jax.jit(opt.update)
    history = []
    for g in micro_grads:
        scaled = ujax.get_loss_scale(state).scale(jnp.array(g, jnp.float32))
        updates, state = update(scaled, state, params)
        params = optax.apply_updates(params, updates)
        history.append((params, state))
    return history


def test_multisteps_skips_a_bad_window_whole_and_resets_to_exact_zeros():
    history = _multisteps_run(ujax.MultiSteps, [[np.nan, 0.0], [1.0, 1.0], [1.0, 3.0], [3.0, 1.0]])
    params, state = history[1]  # end of the bad window
    assert params.tolist() == [1.0, 2.0]
    assert tree_bits(state.acc_grads) == tree_bits(jnp.zeros(2))  # +0.0, not NaN or -0.0
    ls = ujax.get_loss_scale(state)
    assert (float(ls.loss_scale), int(ls.state.total_skips)) == (1.0, 1)
    params, state = history[3]  # the next window applies the mean gradient [2, 2]
    assert params.tolist() == [-1.0, 0.0]
    assert int(ujax.get_loss_scale(state).state.consecutive_skips) == 0


def test_upstream_optax_multisteps_keeps_nan_after_a_bad_window():
    # Why unimp ships MultiSteps: optax resets with 0 * acc, and 0 * nan is nan. If this starts
    # failing, optax fixed it and unimp.backends.jax.MultiSteps can become an alias.
    history = _multisteps_run(optax.MultiSteps, [[np.nan, 0.0], [1.0, 1.0], [1.0, 3.0], [3.0, 1.0]])
    assert bool(jnp.isnan(history[1][1].acc_grads).any())
    assert history[3][0].tolist() == [1.0, 2.0]  # the clean second window is lost too


# the warning and where it is not said (every backend, an injected epsilon):
# tests/conformance/test_half_state_warning.py


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda: optax.adam(1e-3),  # epsilon in a closure: unread, warned about all the same
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adagrad(1e-3)),
    ],
    ids=["adam", "chained-adagrad"],
)
def test_pure_float16_second_moments_warn(make_opt):
    import warnings

    mp = ujax.MixedPrecision(unimp.get_recipe("float16", loss_scale="none"))
    params = {"w": jnp.ones(3)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mp.train_step(lambda p, b: jnp.sum(p["w"] * b), make_opt(), params)
    said = [w for w in caught if issubclass(w.category, unimp.HalfOptimizerStateWarning)]
    assert len(said) == 1
    # float32 optimizer state (a mixed recipe) is never a problem
    with warnings.catch_warnings():
        warnings.simplefilter("error", unimp.HalfOptimizerStateWarning)
        ujax.MixedPrecision("mixed_float16").train_step(lambda p, b: jnp.sum(p["w"] * b), make_opt(), params)


def test_half_state_check_reads_injected_eps_and_never_raises():
    import warnings

    mp = ujax.MixedPrecision(unimp.get_recipe("float16", loss_scale="none"))
    params = {"w": jnp.ones(3)}
    array_eps = optax.inject_hyperparams(optax.adam)(learning_rate=0.1, eps=jnp.full(3, 1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", unimp.HalfOptimizerStateWarning)
        mp.train_step(lambda p, b: jnp.sum(p["w"] * b), array_eps, params)  # used to raise TypeError
    two = optax.chain(
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-3, eps=1e-4),
        optax.inject_hyperparams(optax.rmsprop)(learning_rate=1e-3, eps=1e-8),
    )
    with pytest.warns(unimp.HalfOptimizerStateWarning, match="epsilon=1e-08 becomes 0 in float16"):
        mp.train_step(lambda p, b: jnp.sum(p["w"] * b), two, params)  # the smallest eps counts


def test_injected_hyperparameters_stay_float32_for_bfloat16_params():
    # issue 32: optax.inject_hyperparams casts its hyperparameters to the params' dtype, where
    # b2 = 0.999 is 1.0 in bfloat16, Adam's bias correction 1 - b2**t is 0 and the first step
    # writes NaN. loss_scaling (and the train step) run the inner update in float32 for half
    # params: the moments stay bfloat16, the hyperparameters float32, the weight moves by lr.
    params = {"w": jnp.ones((2,), jnp.bfloat16)}
    opt = ujax.loss_scaling(optax.inject_hyperparams(optax.adam)(learning_rate=0.1), "none")
    state = opt.init(params)
    for _ in range(3):
        updates, state = jax.jit(opt.update)({"w": jnp.array([1.0, -1.0], jnp.bfloat16)}, state, params)
        params = optax.apply_updates(params, updates)
    assert params["w"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(params["w"], np.float32), [0.7, 1.3], rtol=0, atol=2.0**-6)
    inner = state.inner_state
    assert {k: v.dtype for k, v in inner.hyperparams.items()}["b2"] == jnp.float32
    assert float(inner.hyperparams["b2"]) == np.float32(0.999)
    adam = inner.inner_state[0]
    assert adam.mu["w"].dtype == adam.nu["w"].dtype == jnp.bfloat16  # as optax keeps them
    # float32 params: the optimizer runs as it is, its state as optax makes it
    plain = ujax.loss_scaling(optax.inject_hyperparams(optax.adam)(learning_rate=0.1), "none")
    s32 = plain.init({"w": jnp.ones((2,), jnp.float32)})
    assert s32.inner_state.inner_state[0].mu["w"].dtype == jnp.float32


def test_transformations_that_cond_over_their_state_keep_working_on_bfloat16_params():
    # the breaker's case: optax.apply_if_finite lax.cond's over its inner state; widening
    # optax.adam (Python-float hyperparameters, float32 bias correction already) made the two
    # branches' dtypes differ. Only injected hyperparameters are widened.
    mp = unimp.mixed_precision("bfloat16", backend="jax")
    params = {"w": jnp.ones((4, 1))}
    loss = lambda p, x: jnp.sum((x @ p["w"].astype(jnp.float32)) ** 2)  # noqa: E731
    for opt in (optax.apply_if_finite(optax.adam(0.1), 5), optax.conditionally_transform(optax.adam(0.1), lambda c: True)):
        step = mp.train_step(loss, opt, params)
        assert bool(step(jnp.ones((2, 4))).applied)
        assert step.params["w"].dtype == jnp.bfloat16 and float(step.params["w"][0, 0]) < 1.0


# -- half_update (issue 32) ------------------------------------------------------------------


def test_half_update_leaves_float32_leaves_to_the_inner_optimizer_and_composes_with_loss_scaling():
    from unimp.backends.jax import get_loss_scale, half_update, loss_scaling

    params = {"h": jnp.ones(3, jnp.bfloat16), "f": jnp.ones(3, jnp.float32)}
    grads = {"h": jnp.full(3, 1e-3, jnp.bfloat16), "f": jnp.full(3, 1e-3, jnp.float32)}
    plain = optax.sgd(1.0)
    opt = loss_scaling(half_update(optax.sgd(1.0), "kahan"), 4.0)
    state = opt.init(params)
    scaled = jax.tree_util.tree_map(lambda g: g * 4, grads)
    u, state = jax.jit(opt.update)(scaled, state, params)
    want, _ = plain.update(grads, plain.init(params), params)
    assert jnp.array_equal(u["f"], want["f"])  # float32 leaves: the inner optimizer's update
    new = optax.apply_updates(params, u)
    assert new["h"].dtype == jnp.bfloat16 and bool((new["h"] == 1.0).all())  # below half a spacing
    comp = state.inner_state.compensation
    assert comp["f"].shape == (0,) and float(comp["h"][0]) != 0.0  # the lost 1e-3 is kept
    before = state
    bad = jax.tree_util.tree_map(lambda g: g.at[0].set(jnp.inf), scaled)
    u, state = opt.update(bad, state, new)
    assert all(bool((x == 0).all()) for x in jax.tree_util.tree_leaves(u))
    assert jnp.array_equal(state.inner_state.compensation["h"], before.inner_state.compensation["h"])
    assert int(state.inner_state.count) == int(before.inner_state.count) == 1
    assert int(get_loss_scale(state).state.total_skips) == 1


def test_half_update_needs_the_params_to_update():
    # the refusals every backend shares: tests/conformance/test_half_update.py
    from unimp.backends.jax import half_update

    opt = half_update(optax.sgd(1.0))
    with pytest.raises(ValueError, match="call update\\(grads, state, params\\)"):
        opt.update(jnp.ones(2, jnp.bfloat16), opt.init(jnp.ones(2, jnp.bfloat16)))


def test_export_and_import_check_the_mode_against_the_state():
    from unimp.backends.jax import export_update_state, half_update, import_update_state

    p = jnp.ones(3, jnp.bfloat16)
    opt = half_update(optax.sgd(1e-3), "stochastic")
    s = opt.init(p)
    _, s = opt.update(jnp.ones(3, jnp.bfloat16), s, p)
    with pytest.raises(ValueError, match="the optimizer state is of half_update\\(..., 'stochastic or nearest'\\)"):
        export_update_state(s, p, "kahan")
    state = export_update_state(s, p, " Stochastic")  # spelled as half_update takes it
    assert state["params"][0]["step"] == 1
    k = half_update(optax.sgd(1e-3), "kahan")
    ks = k.init(p)
    with pytest.raises(ValueError, match="the optimizer state is of half_update\\(..., 'kahan'\\)"):
        import_update_state(ks, p, state, "stochastic")
    f = {"w": jnp.ones(2, jnp.float32)}
    kf = k.init(f)
    wrong = {"update": "kahan", "seed": 0, "params": [{"step": 0, "compensation": np.zeros(2, np.float32)}]}
    with pytest.raises(ValueError, match="buffers for half parameters only"):
        import_update_state(kf, f, wrong, "kahan")


def test_train_step_refuses_an_optimizer_wrapped_with_half_update():
    from unimp.backends.jax import half_update

    mp = unimp.mixed_precision("bf16-kahan", "jax")
    with pytest.raises(ValueError, match="not one wrapped with half_update\\(\\) \\(the rule would run twice\\)"):
        mp.train_step(lambda p, b: jnp.sum(p["w"].astype(jnp.float32)), half_update(optax.sgd(1.0)), {"w": jnp.ones(2)})
