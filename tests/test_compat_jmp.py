"""unimp.compat.jmp against jmp itself (installed with the "test" extra): the same API and the
same loss-scale sequence where jmp is safe, unimp's rule where it is not."""


import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import jmp as real
import numpy as np
import pytest

import unimp.compat.jmp as shim

pytestmark = pytest.mark.backend("jax")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# each test parametrized by module runs the same checks on jmp and on the shim: the shim
# passes where, and only where, jmp does
MODULES = [pytest.param(real, id="jmp"), pytest.param(shim, id="unimp")]


def _bits(x):
    """dtype and bytes of an array: equal means equal bit for bit."""
    a = np.asarray(x)
    return a.dtype, a.shape, a.tobytes()


def _tree_bits(tree):
    return [_bits(x) for x in jax.tree_util.tree_leaves(tree)]


def _values(dtype, seed=0):
    x = np.random.default_rng(seed).standard_normal(64) * 8
    return {"w": jnp.asarray(x, dtype), "b": jnp.asarray(x[:3], dtype)}


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
    with pytest.raises(ValueError, match="factor must be a finite number > 1"):
        shim.DynamicLossScale(jnp.float32(8.0), factor=1)
    with pytest.raises(ValueError, match=r"period must be >= 1, got 0\. .*default is 2000"):
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


# --- pytrees -----------------------------------------------------------------------------


@pytest.mark.parametrize("mod", MODULES)
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda m: m.NoOpLossScale(), id="noop"),
        pytest.param(lambda m: m.StaticLossScale(0), id="static-0"),
        pytest.param(lambda m: m.StaticLossScale(2.0**15), id="static-float"),
        pytest.param(lambda m: m.StaticLossScale(jnp.float32(4.0)), id="static-array"),
    ],
)
def test_noop_and_static_loss_scales_have_no_pytree_leaves(mod, make):
    ls = make(mod)
    assert jax.tree_util.tree_leaves(ls) == []
    assert jax.tree_util.tree_map(lambda x: x + 1, ls) == ls


@pytest.mark.parametrize("mod", MODULES)
def test_static_loss_scale_of_zero_is_accepted_as_in_jmp(mod):
    ls = mod.StaticLossScale(0)
    assert ls.loss_scale == 0
    x = _values(jnp.float16)
    assert _tree_bits(ls.scale(x)) == _tree_bits(jax.tree_util.tree_map(lambda v: v * 0, x))
    with pytest.raises(ZeroDivisionError):  # jmp: 1 / 0 of a Python number
        ls.unscale(jnp.float32(1.0))
    assert float(mod.StaticLossScale(jnp.float32(0.0)).unscale(jnp.float32(1.0))) == np.inf


@pytest.mark.parametrize("mod", MODULES)
def test_dynamic_loss_scale_leaves_are_loss_scale_then_counter(mod):
    scale, counter = jnp.float32(2.0**10), jnp.int32(7)
    ls = mod.DynamicLossScale(scale, counter, 100, 4)
    leaves = jax.tree_util.tree_leaves(ls)
    assert [_bits(x) for x in leaves] == [_bits(scale), _bits(counter)]
    assert jax.tree_util.tree_map(lambda x: x, ls) == ls
    doubled = jax.tree_util.tree_map(lambda x: x * 2, ls)
    assert (float(doubled.loss_scale), int(doubled.counter)) == (2.0**11, 14)
    assert (doubled.period, doubled.factor) == (100, 4)


def test_dynamic_loss_scale_key_paths_are_jmps():
    # what a checkpointer names the leaves by: a jmp checkpoint restores into the shim's state
    def paths(m):
        ls = m.DynamicLossScale(jnp.float32(8.0), jnp.int32(3))
        return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]

    assert paths(shim) == paths(real)


@pytest.mark.parametrize("mod", MODULES)
def test_period_and_factor_are_static_data(mod):
    def treedef(period, factor):
        return jax.tree_util.tree_structure(mod.DynamicLossScale(jnp.float32(8.0), period=period,
                                                                 factor=factor))

    assert treedef(10, 2) == treedef(10, 2)
    assert treedef(10, 2) != treedef(11, 2) and treedef(10, 2) != treedef(10, 4)


def test_floor_is_static_data_of_the_shim():
    def treedef(floor):
        return jax.tree_util.tree_structure(shim.DynamicLossScale(jnp.float32(8.0), min_loss_scale=floor))

    assert treedef(0.5) != treedef(1.0)  # jmp's treedef leaves the floor out (and loses it)


# --- the floor ---------------------------------------------------------------------------


@pytest.mark.parametrize("mod", MODULES)
@pytest.mark.parametrize("floor", [0.0, jnp.float32(0.0), 0.3125])
def test_min_loss_scale_zero_is_no_floor(mod, floor):
    ls = mod.DynamicLossScale(jnp.float32(10.0), jnp.int32(0), 20, 2, floor)
    expected = np.float32(10.0)
    for _ in range(100):  # down to 10 / 2**100, a normal float32
        ls = ls.adjust(jnp.array(False))
        expected = max(np.float32(floor), expected / np.float32(2))
        assert _bits(ls.loss_scale) == _bits(expected) and int(ls.counter) == 0
    assert ls.min_loss_scale == floor


def test_no_floor_stops_at_the_smallest_normal_float32_where_jmps_reaches_zero():
    ours = shim.DynamicLossScale(jnp.float32(1.0), min_loss_scale=0.0)
    theirs = real.DynamicLossScale(jnp.float32(1.0), min_loss_scale=jnp.float32(0.0))
    for _ in range(160):
        ours, theirs = ours.adjust(jnp.array(False)), theirs.adjust(jnp.array(False))
    assert float(ours.loss_scale) == 2.0**-126 and np.isfinite(float(ours.unscale(jnp.float32(1.0))))
    assert float(theirs.loss_scale) == 0.0  # 1 / scale is inf: every later step is skipped


# --- warnings and refusals, with jmp's classes and words ---------------------------------


@pytest.mark.parametrize("mod", MODULES)
@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(loss_scale=jnp.asarray(1, jnp.int32)), "loss_scale"),
        (dict(loss_scale=2**15), "loss_scale"),
        (dict(loss_scale=jnp.float32(1.0), min_loss_scale=jnp.asarray(1, jnp.int32)), "min_loss_scale"),
    ],
    ids=["int32-scale", "python-int-scale", "int32-floor"],
)
def test_integer_scales_warn_with_jmps_words(mod, kwargs, name):
    with pytest.warns(UserWarning, match=f"^Expected floating type for {name}, got int32"):
        mod.DynamicLossScale(**kwargs)


@pytest.mark.parametrize("mod", MODULES)
def test_float_scales_do_not_warn(mod):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ls = mod.DynamicLossScale(2.0**15)
        ls = mod.DynamicLossScale(jnp.float32(2.0**15), min_loss_scale=jnp.float32(0.5))
        jax.jit(lambda s: s.adjust(jnp.array(True)))(ls)
        mod.StaticLossScale(2)  # jmp warns for the dynamic scale only


def test_the_shim_warning_names_the_fix_and_holds_float32():
    with pytest.warns(UserWarning, match=r"jnp\.float32"):
        ls = shim.DynamicLossScale(2**15)
    assert ls.loss_scale.dtype == jnp.float32 and float(ls.loss_scale) == 2.0**15


@pytest.mark.parametrize("mod", MODULES)
@pytest.mark.parametrize(
    "pred", [jnp.ones([1]), jnp.ones([2], bool), jnp.float32(1.0), jnp.int32(1)],
    ids=["float-vector", "bool-vector", "float-scalar", "int-scalar"],
)
def test_select_tree_refuses_a_non_bool_scalar_as_jmp(mod, pred):
    with pytest.raises(AssertionError, match="expected boolean scalar"):
        mod.select_tree(pred, None, None)


@pytest.mark.parametrize("mod", MODULES)
def test_adjust_refuses_a_non_scalar_flag_as_jmp(mod):
    ls = mod.DynamicLossScale(jnp.float32(8.0), jnp.int32(3))
    with pytest.raises(AssertionError, match="Expected boolean scalar"):
        ls.adjust(jnp.ones([2], bool))
    assert (float(ls.loss_scale), int(ls.counter)) == (8.0, 3)


@pytest.mark.parametrize("mod", MODULES)
def test_adjust_refuses_a_float_flag_as_jmp(mod):
    with pytest.raises(TypeError):
        mod.DynamicLossScale(jnp.float32(8.0)).adjust(jnp.float32(1.0))


def test_shim_refusals_name_the_fix_and_are_value_errors():
    with pytest.raises(ValueError, match=r"all_finite\(tree\) or jnp\.all"):
        shim.select_tree(jnp.ones([2], bool), None, None)
    with pytest.raises(ValueError, match=r"all_finite\(grads\)"):
        shim.DynamicLossScale(jnp.float32(8.0)).adjust(jnp.ones([2], bool))
    with pytest.raises(ValueError, match="pass 0 for no floor"):
        shim.DynamicLossScale(jnp.float32(8.0), min_loss_scale=2.0**-130)
    with pytest.raises(ValueError, match=r"loss_scale must be in .* Pass a positive scale"):
        shim.StaticLossScale(-1.0)


def test_shim_refusals_are_kept_under_python_O():
    code = (
        "import jax.numpy as jnp, unimp.compat.jmp as jmp\n"
        "try:\n    jmp.select_tree(jnp.ones([2]), None, None)\nexcept AssertionError:\n"
        "    print('refused')\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-O", "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "refused", out.stderr


# --- values, bit for bit -----------------------------------------------------------------


@pytest.mark.parametrize(
    "tree",
    [
        None,
        {},
        {"a": jnp.array(jnp.inf)},
        {"a": jnp.ones([]), "b": jnp.array(jnp.nan)},
        {"a": jnp.ones(3, jnp.float16), "n": jnp.arange(3), "f": 2.0},
        {"a": jnp.array([1.0, -jnp.inf], jnp.float16)},
        {"a": float("inf"), "b": jnp.ones(2)},
        (jnp.ones(2, jnp.bfloat16), [jnp.zeros(1)]),
    ],
    ids=["none", "empty", "inf", "nan", "mixed", "f16-inf", "python-inf", "nested"],
)
def test_all_finite_matches_jmp(tree):
    assert _bits(shim.all_finite(tree)) == _bits(real.all_finite(tree))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32], ids=["f16", "f32"])
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda m: m.NoOpLossScale(), id="noop"),
        pytest.param(lambda m: m.StaticLossScale(2.0**15), id="static-float"),
        pytest.param(lambda m: m.StaticLossScale(3), id="static-int"),
        pytest.param(lambda m: m.StaticLossScale(jnp.float32(1000.0)), id="static-f32"),
        pytest.param(lambda m: m.StaticLossScale(jnp.float16(8.0)), id="static-f16"),
        pytest.param(lambda m: m.StaticLossScale(jnp.asarray(3.0)), id="static-weak"),
        pytest.param(lambda m: m.DynamicLossScale(jnp.float32(2.0**15)), id="dynamic"),
        pytest.param(lambda m: m.DynamicLossScale(jnp.float32(3.0)), id="dynamic-3"),
    ],
)
def test_scale_and_unscale_match_jmp_bit_for_bit(make, dtype):
    x = _values(dtype)
    ours, theirs = make(shim), make(real)
    assert _tree_bits(ours.scale(x)) == _tree_bits(theirs.scale(x))
    assert _tree_bits(ours.unscale(x)) == _tree_bits(theirs.unscale(x))
    jitted = jax.jit(lambda ls, t: (ls.scale(t), ls.unscale(t)))
    assert _tree_bits(jitted(ours, x)) == _tree_bits(jitted(theirs, x))


@pytest.mark.parametrize("pred", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32], ids=["f16", "f32"])
def test_select_tree_matches_jmp_bit_for_bit(pred, dtype):
    a, b = _values(dtype, 0), _values(dtype, 1)
    p = jnp.array(pred)
    assert _tree_bits(shim.select_tree(p, a, b)) == _tree_bits(real.select_tree(p, a, b))
    assert shim.select_tree(p, None, None) is None


@pytest.mark.parametrize("period, factor", [(3, 2), (1, 2), (2, 4)])
def test_adjust_under_jit_matches_jmp_bit_for_bit_and_compiles_once(period, factor):
    flags = np.random.default_rng(period).random(60) > 0.3
    traces = {"jmp": 0, "unimp": 0}

    def stepper(name):
        def step(ls, ok):
            traces[name] += 1
            return ls.adjust(ok)
        return jax.jit(step)

    steps = {"jmp": stepper("jmp"), "unimp": stepper("unimp")}
    # jmp's flatten loses a floor other than its default 1.0, so this compares with that one
    a = real.DynamicLossScale(jnp.float32(2.0**4), jnp.int32(0), period, factor)
    b = shim.DynamicLossScale(jnp.float32(2.0**4), jnp.int32(0), period, factor)
    for ok in flags:
        a, b = steps["jmp"](a, jnp.array(ok)), steps["unimp"](b, jnp.array(ok))
        assert _tree_bits(b) == _tree_bits(a)
    assert traces == {"jmp": 1, "unimp": 1}


def test_backoff_by_a_non_power_of_two_factor_is_within_ulps_of_jmps():
    # jmp divides by the factor, unimp's rule multiplies by 1 / factor: the same for 2, 4, ...
    a = real.DynamicLossScale(jnp.float32(2.0**15), factor=3)
    b = shim.DynamicLossScale(jnp.float32(2.0**15), factor=3)
    for _ in range(9):
        a, b = a.adjust(jnp.array(False)), b.adjust(jnp.array(False))
        np.testing.assert_allclose(float(b.loss_scale), float(a.loss_scale), rtol=8 * 2.0**-24)


@pytest.mark.parametrize(
    "name",
    ["bf16", "bfloat16", "f16", "half", "full", "f32", "c=f16", "o=bf16", "p=bf16",
     "params=float16,compute=float16", "p=f32,c=bf16,o=f32", "16", "float", "mixed_bfloat16",
     "x=f16", "c=f8"],
)
def test_get_policy_reads_names_by_jmps_grammar(name):
    # a bare dtype is all three dtypes in jmp ("bf16": params bfloat16 too), not unimp's
    # named policy of that name; names jmp refuses are refused
    try:
        want = str(real.get_policy(name))
    except ValueError:
        with pytest.raises(ValueError, match="jmp"):
            shim.get_policy(name)
        return
    assert str(shim.get_policy(name)) == want
