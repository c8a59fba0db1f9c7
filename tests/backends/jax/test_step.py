"""jax backend, ``step``: the train step (clipping, accumulation, skips, state, syncs, bad input)."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import unimp
import unimp.backends.jax as ujax
from backends.jax.helpers import HALF, RECIPE, LinenMLP, _affine_loss, _xent, tree_bits
from unimp import loss_scale as core


def _dot_loss(params, batch):
    return jnp.dot(params, batch)


def _half_dot(params, batch):
    # float16 compute: a large input keeps the loss finite but overflows the scaled gradient.
    return jnp.dot(params.astype(jnp.float16), batch.astype(jnp.float16)).astype(jnp.float32)


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
    "chain-clip-adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    "inject-hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
}


@pytest.mark.parametrize("host_params", [False, True], ids=["jax-params", "numpy-params"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_train_step_second_call_does_not_recompile(opt, host_params):
    arr = np if host_params else jnp
    params = {"w": arr.zeros(2, arr.float32), "b": arr.float32(0.0)}
    step = ujax.MixedPrecision("mixed_float16").train_step(_affine_loss, OPTIMIZERS[opt](), params)
    step(jnp.ones(2))
    step(jnp.array([jnp.inf, 1.0]))  # a skipped step runs the same compiled function
    step(jnp.ones(2) * 2)
    assert step.traces == 1
    assert step._call_jitted._cache_size() == 1  # the program step(batch) runs


@pytest.mark.parametrize("opt", ["adam", "chain-clip-adamw"])
def test_train_step_donate_updates_in_place_with_the_same_results(opt):
    params = {"w": jnp.array([0.5, -1.0]), "b": jnp.float32(0.25)}
    mp = ujax.MixedPrecision("mixed_float16")
    kept = mp.train_step(_affine_loss, OPTIMIZERS[opt](), params)
    donated = mp.train_step(_affine_loss, OPTIMIZERS[opt](), params, donate=True)
    batches = [jnp.ones(2), jnp.array([jnp.inf, 1.0]), jnp.array([3.0, -2.0]), jnp.ones(2) * 2]
    for b in batches:  # a skipped step in the middle
        before = donated.params
        r_kept, r_donated = kept(b), donated(b)
        assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(before))  # in place
        assert (r_kept.applied, r_kept.scale, r_kept.loss) == (r_donated.applied, r_donated.scale, r_donated.loss)
        assert tree_bits(donated.params) == tree_bits(kept.params)
        assert tree_bits(donated.opt_state) == tree_bits(kept.opt_state)
    assert donated.traces == 1
    # the caller's params were copied, never donated
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(params))
    assert float(params["b"]) == 0.25
    with pytest.raises(TypeError, match="donate must be True or False"):
        mp.train_step(_affine_loss, optax.sgd(0.1), params, donate="yes")


@pytest.mark.parametrize(
    "scale, donate",
    [(core.NoLossScale(), False), (core.DynamicLossScale(init_scale=4.0, growth_interval=2), False),
     (core.DynamicLossScale(init_scale=4.0, hysteresis=2, floor_action="warn"), False),
     (core.NoLossScale(), True)],
    ids=["none", "dynamic", "dynamic-format-2", "none-donated"],
)
def test_call_runs_a_lean_twin_of_jitted_with_the_same_state_and_report(scale, donate):
    # step(batch) compiles the step without the outputs it holds already (each was an XLA
    # copy a step); what it keeps and reports must be jitted's, bit for bit
    mp = ujax.MixedPrecision(unimp.Recipe("float32", scale))
    params = {"w": jnp.array([0.5, -1.0]), "b": jnp.float32(0.25)}
    step = mp.train_step(_affine_loss, optax.adam(0.1), params, donate=donate)
    state = jax.tree_util.tree_map(jnp.copy, (step.params, step.opt_state, step.loss_scale))
    pure = jax.jit(step.replica_step)
    for b in [jnp.ones(2), jnp.array([jnp.inf, 1.0]), jnp.array([3.0, -2.0]), jnp.ones(2) * 2]:
        r = step(b)
        *state, raw = pure(*state, b)
        assert tree_bits(step.params) == tree_bits(state[0])
        assert tree_bits(step.opt_state) == tree_bits(state[1])
        assert tree_bits(step.loss_scale) == tree_bits(state[2])
        assert step.loss_scale.config == state[2].config
        got = {k: v for k, v in r.raw.items() if k != "floor_step"}  # the host's step index
        assert sorted(got) == sorted(raw) and tree_bits(got) == tree_bits(raw)
    assert step.traces == 1 + 1  # the lean twin, and jit(replica_step) above


def test_train_step_grad_overflow_skips_and_backs_off():
    step = ujax.MixedPrecision("mixed_float16").train_step(
        _half_dot, optax.adam(0.1), jnp.array([-0.0, 1.0])
    )
    step(jnp.ones(2))
    params, opt_state = step.params, step.opt_state
    r = step(jnp.array([1000.0, 1.0]))  # loss ~1000 is finite; 2**15 * 1000 overflows float16
    assert not r.applied and not r.grads_finite and r.loss_finite
    assert tree_bits(step.params) == tree_bits(params)
    assert tree_bits(step.opt_state) == tree_bits(opt_state)
    assert step.loss_scale.loss_scale == 2.0**14 and (r.consecutive_skips, r.total_skips) == (1, 1)


@pytest.mark.parametrize("loss_scale", ["none", 128.0, "dynamic"])
def test_train_step_every_kind_skips_and_counts(loss_scale):
    mp = ujax.MixedPrecision(unimp.Recipe("mixed_bfloat16", loss_scale))
    step = mp.train_step(_dot_loss, optax.sgd(1.0), jnp.ones(2))
    r1 = step(jnp.array([jnp.nan, 1.0]))
    r2 = step(jnp.array([jnp.nan, 1.0]))
    r3 = step(jnp.array([1.0, 1.0]))
    assert [r.applied for r in (r1, r2, r3)] == [False, False, True]
    assert (r2.consecutive_skips, r2.total_skips, r3.consecutive_skips, r3.total_skips) == (
        2,
        2,
        0,
        2,
    )
    assert step.params.tolist() == [0.0, 0.0]


def _mse(params, batch):
    return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)


def test_train_step_accumulation_is_mean_of_micro_batch_grads():
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=8), jnp.float32),
    }
    mp = ujax.MixedPrecision("mixed_float16")
    full = mp.train_step(_mse, optax.sgd(0.1), jnp.ones(3))
    accum = mp.train_step(_mse, optax.sgd(0.1), jnp.ones(3), grad_accum_steps=4)
    micro = [{k: v[i * 2 : (i + 1) * 2] for k, v in batch.items()} for i in range(4)]
    r_full, r_acc = full(batch), accum(micro)
    np.testing.assert_allclose(accum.params, full.params, rtol=1e-6)
    expected_loss = np.mean(
        [
            float(_mse(jnp.ones(3), {k: v[i * 2 : (i + 1) * 2] for k, v in batch.items()}))
            for i in range(4)
        ]
    )
    np.testing.assert_allclose(r_acc.loss, expected_loss, rtol=1e-6)
    assert r_full.applied and r_acc.applied


def test_train_step_accumulation_skips_the_whole_window():
    x = jnp.ones((4, 3)).at[3, 0].set(jnp.inf)
    step = ujax.MixedPrecision("mixed_float16").train_step(
        _mse, optax.sgd(0.1), jnp.ones(3), grad_accum_steps=2
    )
    r = step([{"x": x[:2], "y": jnp.zeros(2)}, {"x": x[2:], "y": jnp.zeros(2)}])
    assert not r.applied and step.params.tolist() == [1.0, 1.0, 1.0]
    r = step([{"x": jnp.ones((2, 3)), "y": jnp.zeros(2)}] * 2)
    assert r.applied and step.traces == 1


def test_train_step_bad_state_dict_changes_nothing():
    step = ujax.MixedPrecision("mixed_float16").train_step(_dot_loss, optax.sgd(1.0), jnp.ones(2))
    before = step.state_dict()
    with pytest.raises(ValueError, match="format"):
        step.load_state_dict({"scale": 1.0})
    assert step.state_dict() == before


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"grad_accum_steps": 0}, ValueError, "grad_accum_steps"),
        ({"grad_accum_steps": 1.5}, ValueError, "grad_accum_steps"),
        ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
        ({"max_grad_norm": float("nan")}, ValueError, "max_grad_norm"),
        ({"optimizer": "adam"}, TypeError, "GradientTransformation"),
        ({"loss_fn": None}, TypeError, "loss_fn"),
        ({"optimizer": ujax.loss_scaling(optax.sgd(1.0))}, ValueError, "plain optax optimizer"),
    ],
    ids=[
        "accum-0",
        "accum-float",
        "norm-negative",
        "norm-nan",
        "optimizer-str",
        "loss-none",
        "double-scaling",
    ],
)
def test_train_step_errors(kwargs, exc, match):
    args = {"loss_fn": _dot_loss, "optimizer": optax.sgd(1.0), "params": jnp.ones(2), **kwargs}
    with pytest.raises(exc, match=match):
        ujax.MixedPrecision().train_step(**args)


@pytest.mark.parametrize(
    "batch,needle",
    [
        ({"x": jnp.ones((6, 3)), "y": jnp.zeros(6)}, "list of 3 micro-batches"),
        ([{"x": jnp.ones((2, 3)), "y": jnp.zeros(2)}] * 2, "list of 3 micro-batches, got list of length 2"),
        ([{"x": jnp.ones((2, 3)), "y": jnp.zeros(2)}] * 2 + [{"x": jnp.ones((3, 3)), "y": jnp.zeros(3)}], "micro-batch 2 has 3 rows where micro-batch 0 has 2"),
    ],
    ids=["not-a-list", "wrong-length", "ragged"],
)
def test_train_step_bad_window_changes_nothing(batch, needle):
    step = ujax.MixedPrecision().train_step(_mse, optax.sgd(0.1), jnp.ones(3), grad_accum_steps=3)
    with pytest.raises(ValueError, match=needle):
        step(batch)
    assert step.params.tolist() == [1.0, 1.0, 1.0] and step.traces == 0


def test_train_step_non_scalar_loss():
    step = ujax.MixedPrecision().train_step(lambda p, b: p * b, optax.sgd(0.1), jnp.ones(2))
    with pytest.raises(ValueError, match="scalar loss"):
        step(jnp.ones(2))


@pytest.mark.parametrize("half", HALF)
def test_train_step_linen_dtypes(half):
    mp = ujax.MixedPrecision(RECIPE[half])
    model = LinenMLP(**mp.module_kwargs())
    x, y = jnp.ones((4, 8)), jnp.arange(4)
    variables = model.init(jax.random.key(0), x)
    seen = {}

    def loss_fn(params, batch):
        logits = model.apply({**variables, "params": params}, batch["x"])
        seen["logits"] = logits.dtype
        return _xent(mp.cast_to_output(logits), batch["y"])

    step = mp.train_step(loss_fn, optax.adam(1e-3), variables["params"])
    r = step({"x": x, "y": y})
    assert r.applied and seen["logits"] == jnp.dtype(half)
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(step.params))
    assert all(
        m.dtype == jnp.float32
        for m in jax.tree_util.tree_leaves(step.opt_state)
        if jnp.issubdtype(m.dtype, jnp.floating)
    )


def test_shard_map_replicas_take_the_same_decision():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    P = jax.sharding.PartitionSpec
    n = len(jax.devices())
    grads = jnp.ones((n, 2)).at[0, 0].set(jnp.nan)  # one replica overflows

    def per_replica(g, ls):
        finite = ujax.all_finite(g, axis_name="d")
        return ls.adjust(finite).loss_scale[None], finite[None]

    fn = jax.shard_map(per_replica, mesh=mesh, in_specs=(P("d"), P()), out_specs=(P("d"), P("d")))
    scales, finite = fn(grads, ujax.LossScale(core.DynamicLossScale(init_scale=8.0)))
    assert scales.tolist() == [4.0] * n and finite.tolist() == [False] * n


def test_integer_loss_is_refused_like_the_other_backends():
    step = ujax.MixedPrecision().train_step(lambda p, b: jnp.sum(b).astype(jnp.int32), optax.sgd(0.1), jnp.ones(2))
    with pytest.raises(TypeError, match="floating loss"):
        step(jnp.ones(2))
    assert step.params.tolist() == [1.0, 1.0]


def _nnx_bn_step(**kwargs):
    from flax import nnx

    mp = unimp.mixed_precision("mixed_float16", backend="jax")
    kw = mp.module_kwargs()

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(3, 4, rngs=rngs, **kw)
            self.bn = nnx.BatchNorm(4, rngs=rngs, **kw)
            self.l2 = nnx.Linear(4, 1, rngs=rngs, **kw)

        def __call__(self, x):
            return self.l2(self.bn(self.l1(x)))

    graphdef, params, stats = nnx.split(Net(nnx.Rngs(0)), nnx.Param, nnx.BatchStat)

    def loss_fn(p, s, x):
        model = nnx.merge(graphdef, p, s, copy=True)  # fresh Variables at this trace level
        out = model(x)
        _, _, new_s = nnx.split(model, nnx.Param, nnx.BatchStat)
        return jnp.mean(jnp.square(out.astype(jnp.float32))), new_s

    return mp.train_step(loss_fn, optax.sgd(0.1), params, model_state=stats, **kwargs)


@pytest.mark.parametrize("donate", [False, True])
def test_nnx_batch_stats_are_carried_and_kept_on_a_skipped_step(donate):
    step = _nnx_bn_step(donate=donate)
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    first = tree_bits(step.model_state)
    for _ in range(3):
        step(x)
    assert tree_bits(step.model_state) != first  # the forward pass moved the statistics
    before = (tree_bits(step.model_state), tree_bits(step.params), tree_bits(step.opt_state))
    r = step(x * 1e5)
    assert r.applied is False
    assert (tree_bits(step.model_state), tree_bits(step.params), tree_bits(step.opt_state)) == before
    step(x)
    assert step.traces == 1


def test_model_state_threads_through_accumulated_micro_batches():
    import flax.linen as nn

    bn = nn.BatchNorm(use_running_average=False, momentum=0.5)
    variables = bn.init(jax.random.key(0), jnp.zeros((2, 1)))

    def loss_fn(p, s, x):
        out, upd = bn.apply({"params": p, "batch_stats": s}, x, mutable=["batch_stats"])
        return jnp.mean(out), upd["batch_stats"]

    mp = unimp.mixed_precision("float32", backend="jax")
    step = mp.train_step(loss_fn, optax.sgd(0.0), variables["params"],
                         model_state=variables["batch_stats"], grad_accum_steps=2)
    step([jnp.full((2, 1), 2.0), jnp.full((2, 1), 4.0)])
    # momentum 0.5, in order: 0 -> 0.5 * 0 + 0.5 * 2 = 1 -> 0.5 * 1 + 0.5 * 4 = 2.5
    assert float(step.model_state["mean"][0]) == 2.5
    bad = step([jnp.full((2, 1), 2.0), jnp.full((2, 1), jnp.nan)])
    assert bad.applied is False and float(step.model_state["mean"][0]) == 2.5


def test_model_state_loss_fn_must_return_loss_and_state():
    mp = unimp.mixed_precision("float32", backend="jax")
    step = mp.train_step(lambda p, s, x: jnp.sum(p * x), optax.sgd(0.1), jnp.ones(2),
                         model_state={"n": jnp.zeros(())})
    with pytest.raises(TypeError, match=r"must return \(loss, new_model_state\)"):
        step(jnp.ones(2))
