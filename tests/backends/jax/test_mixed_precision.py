"""jax backend, ``mixed_precision``: the recipe bound to the framework (apply, autocast, module kwargs, prepare, examples).
The exports and the bound dtypes (every backend) are in tests/conformance/test_backend_api.py."""


import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import unimp.backends.jax as ujax
from backends.jax.helpers import HALF, RECIPE, LinenMLP, _xent


@pytest.mark.parametrize("half", HALF)
def test_apply_casts_params_inputs_and_outputs(half):
    mp = ujax.MixedPrecision(RECIPE[half])
    seen = {}

    def fn(params, x, idx):
        seen["w"], seen["x"], seen["idx"] = params["w"].dtype, x.dtype, idx.dtype
        h = x @ params["w"]
        seen["h"] = h.dtype
        return {"logits": h, "idx": idx}

    out = mp.apply(fn)({"w": jnp.ones((3, 2))}, jnp.ones((4, 3)), jnp.arange(4))
    assert seen == {
        "w": jnp.dtype(half),
        "x": jnp.dtype(half),
        "idx": jnp.int32,
        "h": jnp.dtype(half),
    }
    assert out["logits"].dtype == jnp.float32 and out["idx"].dtype == jnp.int32


def test_apply_rejects_non_callable():
    with pytest.raises(TypeError, match="fn\\(params"):
        ujax.MixedPrecision().apply(3)


def test_autocast_is_a_noop_context():
    with ujax.MixedPrecision().autocast():
        assert (jnp.ones(2) @ jnp.ones(2)).dtype == jnp.float32


@pytest.mark.parametrize("half", HALF)
def test_module_kwargs(half):
    assert ujax.MixedPrecision(RECIPE[half]).module_kwargs() == {
        "dtype": jnp.dtype(half),
        "param_dtype": jnp.float32,
    }


class NnxMLP(nnx.Module):
    def __init__(self, rngs, **kw):
        self.l1 = nnx.Linear(8, 16, rngs=rngs, **kw)
        self.drop = nnx.Dropout(0.2)
        self.bn = nnx.BatchNorm(16, rngs=rngs, **kw)
        self.l2 = nnx.Linear(16, 10, rngs=rngs, **kw)

    def __call__(self, x, key):
        h = nnx.relu(self.l1(x))
        return self.l2(self.bn(self.drop(h, rngs=key)))


@pytest.mark.parametrize("half", HALF)
def test_linen_dtype_audit(half):
    # Dtypes only: jax.eval_shape traces without compiling or running anything.
    mp = ujax.MixedPrecision(RECIPE[half])
    model = LinenMLP(**mp.module_kwargs())
    x, y, key = jnp.ones((4, 8)), jnp.arange(4), jax.random.key(1)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(variables))  # + BN stats

    def forward(variables):
        return model.apply(
            variables,
            x,
            train=True,
            capture_intermediates=True,
            rngs={"dropout": key},
            mutable=["intermediates", "batch_stats"],
        )

    out, state = jax.eval_shape(forward, variables)
    inter = state["intermediates"]
    assert inter["Dense_0"]["__call__"][0].dtype == jnp.dtype(half)
    assert inter["BatchNorm_0"]["__call__"][0].dtype == jnp.dtype(half)
    assert all(s.dtype == jnp.float32 for s in jax.tree_util.tree_leaves(state["batch_stats"]))
    assert out.dtype == jnp.dtype(half)
    assert jax.eval_shape(mp.cast_to_output, out).dtype == jnp.float32

    def loss(params, variables):
        logits, _ = model.apply(
            {**variables, "params": params},
            x,
            train=True,
            rngs={"dropout": key},
            mutable=["batch_stats"],
        )
        return _xent(mp.cast_to_output(logits), y)

    grads = jax.eval_shape(jax.grad(loss), variables["params"], variables)
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))


@pytest.mark.parametrize("half", HALF)
def test_nnx_dtype_audit(half):
    mp = ujax.MixedPrecision(RECIPE[half])
    model = nnx.eval_shape(lambda: NnxMLP(nnx.Rngs(0), **mp.module_kwargs()))  # abstract
    x, y, key = jnp.ones((4, 8)), jnp.arange(4), jax.random.key(1)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))
    assert all(
        s.dtype == jnp.float32 for s in jax.tree_util.tree_leaves(nnx.state(model, nnx.BatchStat))
    )
    graphdef = nnx.graphdef(model)

    def run(p, r):
        m = nnx.merge(graphdef, p, r, copy=True)  # BatchNorm updates its stats in the trace
        return m.l1(x), m(x, key)

    hidden, out = jax.eval_shape(run, params, rest)
    assert hidden.dtype == jnp.dtype(half) and out.dtype == jnp.dtype(half)
    assert jax.eval_shape(mp.cast_to_output, out).dtype == jnp.float32

    def loss(p, r):
        m = nnx.merge(graphdef, p, r, copy=True)
        return _xent(mp.cast_to_output(m(x, key)), y)

    grads = jax.eval_shape(jax.grad(loss), params, rest)
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))


def test_prepare_casts_params_and_wraps_optimizer():
    mp = ujax.MixedPrecision("mixed_float16")
    params, opt = mp.prepare({"w": jnp.ones(2, jnp.float16), "n": jnp.int32(1)}, optax.sgd(0.1))
    assert params["w"].dtype == jnp.float32 and params["n"].dtype == jnp.int32
    ls = ujax.get_loss_scale(opt.init(params))
    assert isinstance(ls, ujax.LossScale) and ls.config == mp.loss_scale


@pytest.mark.slow
def test_example_runs(capsys):
    import pathlib
    import runpy

    path = pathlib.Path(__file__).parents[3] / "examples" / "jax_flax_optax.py"
    runpy.run_path(str(path), run_name="example")["main"](steps=2)
    out = capsys.readouterr().out
    assert "logits computed in float16, returned as float32" in out
    assert out.count("compilations 1") == 2
