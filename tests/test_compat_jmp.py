"""unimp.compat.jmp against jmp itself (installed with the "test" extra): the same API and the
same loss-scale sequence where jmp is safe, unimp's rule where it is not."""


import jax
import jax.numpy as jnp
import jmp as real
import numpy as np
import pytest

import unimp.compat.jmp as shim

pytestmark = pytest.mark.backend("jax")


def test_exports_jmps_public_names():
    assert set(real.__all__) <= set(shim.__all__)


@pytest.mark.parametrize("period, factor, floor", [(5, 2, 1.0), (3, 4, 0.25), (1, 2, 2.0**-10)])
@pytest.mark.parametrize("seed", [0, 1])
def test_dynamic_loss_scale_matches_jmp_step_for_step(period, factor, floor, seed):
    flags = np.random.default_rng(seed).random(400) > 0.15
    a = real.DynamicLossScale(jnp.float32(2.0**10), period=period, factor=factor,
                              min_loss_scale=jnp.float32(floor))
    b = shim.DynamicLossScale(jnp.float32(2.0**10), period=period, factor=factor, min_loss_scale=floor)
    for ok in flags:
        a, b = a.adjust(jnp.array(ok)), b.adjust(jnp.array(ok))
        assert (float(a.loss_scale), int(a.counter)) == (float(b.loss_scale), int(b.counter))


def test_positional_order_and_pytree_children_are_jmps():
    ls = shim.DynamicLossScale(jnp.float32(2.0**15), jnp.int32(0), 100, 4)
    assert (ls.period, ls.factor) == (100, 4)
    ref = real.DynamicLossScale(jnp.float32(2.0**15), jnp.int32(0), 100, 4)
    assert len(jax.tree_util.tree_leaves(ls)) == len(jax.tree_util.tree_leaves(ref)) == 2
    assert [x.dtype for x in jax.tree_util.tree_leaves(ls)] == [x.dtype for x in jax.tree_util.tree_leaves(ref)]


def test_floor_survives_jit_where_jmps_is_lost():
    def back_off(ls):
        return ls.adjust(jnp.array(False))

    start = dict(loss_scale=jnp.float32(2.0**-3), min_loss_scale=jnp.float32(2.0**-4))
    ours = jax.jit(back_off)(shim.DynamicLossScale(**start))
    theirs = jax.jit(back_off)(real.DynamicLossScale(**start))
    assert float(ours.loss_scale) == 2.0**-4 and float(ours.min_loss_scale) == 2.0**-4
    # jmp's flatten drops min_loss_scale: inside jit the floor is 1.0 and the scale jumps up
    assert float(theirs.loss_scale) == 1.0


def test_scale_is_float32_even_when_given_in_float16():
    ls = shim.DynamicLossScale(jnp.float16(2.0**15), period=1)
    assert ls.loss_scale.dtype == jnp.float32
    grown = ls.adjust(jnp.array(True))
    assert float(grown.loss_scale) == 2.0**16  # a float16 scale would be inf
    assert grown.scale(jnp.float16(2.0)).dtype == jnp.float32
    assert float(grown.scale(jnp.float16(2.0))) == 2.0**17


@pytest.mark.parametrize(
    "name",
    ["params=float32,compute=float16,output=float32", "c=f16", "p=f16,c=bf16", "half", "full", "f32"],
)
def test_policies_match_jmp(name):
    ours, theirs = shim.get_policy(name), real.get_policy(name)
    assert str(ours) == str(theirs)
    assert (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == (
        theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype
    )
    tree = {"w": jnp.ones(2), "n": jnp.arange(2), "s": 1.0}
    for method in ("cast_to_param", "cast_to_compute", "cast_to_output"):
        a, b = getattr(ours, method)(tree), getattr(theirs, method)(tree)
        assert jax.tree_util.tree_map(lambda x: jnp.asarray(x).dtype, a) == jax.tree_util.tree_map(
            lambda x: jnp.asarray(x).dtype, b
        )
    assert str(ours.with_output_dtype(jnp.float32)) == str(theirs.with_output_dtype(jnp.float32))


def test_helpers_match_jmp():
    assert shim.half_dtype() == real.half_dtype()
    x = {"a": jnp.ones(2, jnp.float32), "b": jnp.ones(2, jnp.bfloat16)}
    assert shim.cast_to_half(x)["a"].dtype == real.cast_to_half(x)["a"].dtype
    assert shim.cast_to_full(x)["b"].dtype == real.cast_to_full(x)["b"].dtype
    assert bool(shim.all_finite(x)) and not bool(shim.all_finite({"a": jnp.array([1.0, jnp.inf])}))
    picked = shim.select_tree(jnp.array(False), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})
    assert picked["a"].tolist() == [0.0, 0.0]
    assert shim.NoOpLossScale().scale(3.0) == 3.0 and shim.NoOpLossScale().loss_scale == 1
    static = shim.StaticLossScale(jnp.float32(128.0))
    assert float(static.scale(jnp.float32(2.0))) == 256.0 and float(static.unscale(jnp.float32(256.0))) == 2.0
    assert jax.jit(lambda s, x: s.scale(x), static_argnums=0)(static, jnp.float32(1.0)) == 128.0


def _jmp_script(jmp):
    """A jmp training loop as jmp's README writes it; only the module differs."""
    policy = jmp.get_policy("params=float32,compute=float16,output=float32")
    loss_scale = jmp.DynamicLossScale(jnp.asarray(2.0**15, jnp.float32), period=2)
    params = {"w": jnp.array([0.5, -0.25])}

    @jax.jit
    def train_step(params, loss_scale, x, y):
        def loss_fn(p):
            p, x_ = policy.cast_to_compute((p, x))
            out = policy.cast_to_output(x_ @ p["w"])
            return loss_scale.scale(jnp.mean((out - y) ** 2))

        grads = jax.grad(loss_fn)(params)
        grads = policy.cast_to_param(loss_scale.unscale(grads))
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        new = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
        return jmp.select_tree(finite, new, params), loss_scale

    x = jnp.array([[1.0, 2.0], [3.0, -1.0]])
    scales = []
    for i in range(5):
        y = jnp.array([1.0, 0.0]) * (jnp.inf if i == 2 else 1.0)
        params, loss_scale = train_step(params, loss_scale, x, y)
        scales.append(float(loss_scale.loss_scale))
    return params, scales


def test_a_jmp_script_runs_unchanged_with_the_same_results():
    ours, theirs = _jmp_script(shim), _jmp_script(real)
    # float16 gradients x 2**15 overflow twice, step 2 has an inf target, then two clean
    # steps grow the scale (period 2)
    assert ours[1] == theirs[1] == [2.0**14, 2.0**13, 2.0**12, 2.0**12, 2.0**13]
    np.testing.assert_array_equal(np.asarray(ours[0]["w"]), np.asarray(theirs[0]["w"]))


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="growth_factor"):
        shim.DynamicLossScale(jnp.float32(8.0), factor=1)
    with pytest.raises(ValueError, match="growth_interval"):
        shim.DynamicLossScale(jnp.float32(8.0), period=0)
    with pytest.raises(ValueError, match="bool"):
        shim.DynamicLossScale(jnp.float32(8.0)).adjust(jnp.float32(1.0))
    with pytest.raises(ValueError, match="scalar"):
        shim.DynamicLossScale(jnp.ones(2))


@pytest.mark.parametrize("value", [2.0**15, jnp.float32(2.0**15)])
def test_static_loss_scale_result_dtypes_match_jmp(value):
    x = jnp.float16(2.0)
    ours, theirs = shim.StaticLossScale(value), real.StaticLossScale(value)
    assert ours.scale(x).dtype == theirs.scale(x).dtype
    assert ours.unscale(x).dtype == theirs.unscale(x).dtype
    assert float(ours.unscale(ours.scale(jnp.float32(3.0)))) == 3.0
