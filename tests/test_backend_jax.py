from conftest import require_backend

ujax = require_backend("jax")  # skips with a reason if not under test, FAILS if missing

import dataclasses  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training.dynamic_scale import DynamicScale  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import unimp  # noqa: E402
from unimp import loss_scale as core  # noqa: E402
from unimp.backends._base import COMMON_API, MixedPrecisionBase  # noqa: E402

try:  # jmp is the reference for one comparison only; it is in the "test" extra
    import jmp
except ImportError:  # pragma: no cover
    jmp = None

HALF = ["float16", "bfloat16"]
RECIPE = {"float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}
SEQ = 64  # fixed length of random step sequences: one compilation per config


def bits(x):
    """The raw bytes of an array, for bitwise comparisons (-0.0 != 0.0, NaN payloads)."""
    return np.asarray(x).tobytes()


def tree_bits(tree):
    return [bits(x) for x in jax.tree_util.tree_leaves(tree)]


# ------------------------------------------------------------------------------------------
# module surface
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", COMMON_API)
def test_exports_common_api(name):
    assert name in ujax.__all__
    assert hasattr(ujax, name)


def test_mixed_precision_subclasses_base_and_step_result_is_core():
    assert issubclass(ujax.MixedPrecision, MixedPrecisionBase)
    assert ujax.StepResult is unimp.StepResult
    assert unimp.mixed_precision("mixed_float16", backend="flax").backend == "jax"


@pytest.mark.parametrize(
    "name,expected", [("bf16", jnp.bfloat16), ("float16", jnp.float16), ("f32", jnp.float32)]
)
def test_to_dtype(name, expected):
    assert ujax.to_dtype(name) == jnp.dtype(expected)


def test_float64_without_x64_names_the_fix():
    with pytest.raises(ValueError, match="jax_enable_x64"):
        ujax.MixedPrecision("float64")


def test_device_info_and_version():
    info = ujax.device_info()
    assert len(info) == len(jax.devices())
    assert set(info[0]) == {"device", "kind", "float16", "bfloat16", "recommended"}
    unimp.get_recipe(info[0]["recommended"])  # a name the parser accepts
    assert ujax.framework_version() == jax.__version__


# ------------------------------------------------------------------------------------------
# casting
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("half", HALF)
def test_cast_to_compute_floats_only(half):
    mp = ujax.MixedPrecision(RECIPE[half])
    tree = {
        "w": jnp.ones(3, jnp.float32),
        "i": jnp.arange(3, dtype=jnp.int32),
        "b": jnp.array([True]),
        "np": np.ones(2, np.float32),
        "py_float": 1.5,
        "py_int": 3,
        "name": "dense",
    }
    out = mp.cast_to_compute(tree)
    assert out["w"].dtype == jnp.dtype(half)
    assert out["i"].dtype == jnp.int32
    assert out["b"].dtype == jnp.bool_
    assert isinstance(out["np"], np.ndarray) and out["np"].dtype == jnp.dtype(half)
    assert out["py_float"] == 1.5 and type(out["py_float"]) is float
    assert out["py_int"] == 3 and out["name"] == "dense"


def test_cast_right_value_float32_int32_to_float16():
    out = ujax.cast_tree({"a": jnp.ones(2, jnp.float32), "b": jnp.ones(2, jnp.int32)}, "float16")
    assert (out["a"].dtype, out["b"].dtype) == (jnp.float16, jnp.int32)


@pytest.mark.parametrize("half", HALF)
def test_cast_to_param_and_output(half):
    mp = ujax.MixedPrecision(RECIPE[half])
    x = {"h": jnp.ones(2, half), "n": jnp.int32(1)}
    assert mp.cast_to_param(x)["h"].dtype == jnp.float32
    assert mp.cast_to_output(x)["h"].dtype == jnp.float32
    assert mp.cast_to_output(x)["n"].dtype == jnp.int32


def test_cast_tree_bad_dtype():
    with pytest.raises(ValueError, match="expected one of"):
        ujax.cast_tree(jnp.ones(2), "int8")


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


# ------------------------------------------------------------------------------------------
# flax dtype audits (linen and nnx)
# ------------------------------------------------------------------------------------------


class LinenMLP(nn.Module):
    dtype: object = jnp.float32
    param_dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x, train=False):
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        x = nn.relu(nn.Dense(16, **kw)(x))
        x = nn.Dropout(0.2, deterministic=not train)(x)
        x = nn.BatchNorm(use_running_average=not train, **kw)(x)
        return nn.Dense(10, **kw)(x)


class NnxMLP(nnx.Module):
    def __init__(self, rngs, **kw):
        self.l1 = nnx.Linear(8, 16, rngs=rngs, **kw)
        self.drop = nnx.Dropout(0.2)
        self.bn = nnx.BatchNorm(16, rngs=rngs, **kw)
        self.l2 = nnx.Linear(16, 10, rngs=rngs, **kw)

    def __call__(self, x, key):
        h = nnx.relu(self.l1(x))
        return self.l2(self.bn(self.drop(h, rngs=key)))


def _xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


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


# ------------------------------------------------------------------------------------------
# loss-scale pytrees
# ------------------------------------------------------------------------------------------

CONFIGS = {
    "dynamic": core.DynamicLossScale(
        init_scale=4.0, growth_interval=3, min_scale=0.25, max_scale=64.0
    ),
    "static": core.StaticLossScale(128.0),
    "none": core.NoLossScale(),
}


def _advanced(kind):
    ls = ujax.loss_scale_from_config(CONFIGS[kind])
    for flag in (True, False, True, (True, False)):
        g, lf = flag if isinstance(flag, tuple) else (flag, True)
        ls = ls.adjust(jnp.array(g), jnp.array(lf))
    return ls


def _same(a, b):
    assert type(a) is type(b)
    assert a.config == b.config
    for f in dataclasses.fields(a):
        if f.name != "config":
            x, y = getattr(a, f.name), getattr(b, f.name)
            assert (x.dtype, bits(x)) == (y.dtype, bits(y)), f.name


ROUNDTRIPS = {
    "flatten": lambda ls: jax.tree_util.tree_unflatten(*reversed(jax.tree_util.tree_flatten(ls))),
    "jit": lambda ls: jax.jit(lambda s: s)(ls),
    "tree_map": lambda ls: jax.tree_util.tree_map(lambda x: x, ls),
    "scan": lambda ls: jax.lax.scan(lambda c, _: (c, None), ls, None, length=2)[0],
    "state_dict": lambda ls: type(ls).from_state_dict(ls.state_dict()),
    "state_dict_any": lambda ls: ujax.loss_scale_from_state_dict(ls.state_dict()),
}


@pytest.mark.parametrize("how", list(ROUNDTRIPS))
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_every_field_survives(kind, how):
    ls = _advanced(kind)
    _same(ROUNDTRIPS[how](ls), ls)


def test_pytree_children_come_from_dataclass_fields():
    ls = ujax.DynamicLossScale()
    names = [k[0].name for k, _ in jax.tree_util.tree_leaves_with_path(ls)]
    assert names == [f.name for f in dataclasses.fields(ls) if not f.metadata.get("static")]
    assert names == ["loss_scale", "counter", "consecutive_skips", "total_skips"]


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_loss_scale_hashes_and_compares_by_identity(kind):
    ls = ujax.loss_scale_from_config(CONFIGS[kind])
    assert ls == ls and ls != ujax.loss_scale_from_config(CONFIGS[kind])
    assert {ls: 1}[ls] == 1


def test_right_value_min_scale_survives_jit():
    ls = ujax.DynamicLossScale.from_config(core.DynamicLossScale(init_scale=4.0, min_scale=0.25))
    step = jax.jit(lambda s: s.adjust(jnp.array(False)))
    for _ in range(4):
        ls = step(ls)
    assert float(ls.loss_scale) == 0.25
    assert ls.min_loss_scale == 0.25


@pytest.mark.parametrize(
    "init", [np.float16(2**15), jnp.float16(2**15), jnp.bfloat16(2**15), np.int32(2**15), 2**15]
)
def test_right_value_state_is_float32_whatever_dtype(init):
    ls = ujax.DynamicLossScale(init, config=core.DynamicLossScale(growth_interval=1))
    assert ls.loss_scale.dtype == jnp.float32 and ls.counter.dtype == jnp.int32
    grown, backed = ls.adjust(True), ls.adjust(False)
    assert grown.loss_scale.dtype == jnp.float32 and float(grown.loss_scale) == 65536.0
    assert backed.loss_scale.dtype == jnp.float32 and float(backed.loss_scale) == 16384.0


def test_float16_init_without_config_becomes_init_scale():
    ls = ujax.DynamicLossScale(jnp.float16(2**15))
    assert ls.config.init_scale == 2.0**15 and ls.loss_scale.dtype == jnp.float32


def _scan_adjust(ls, grads, losses):
    def body(s, flags):
        s = s.adjust(flags[0], flags[1])
        return s, (s.loss_scale, s.counter, s.consecutive_skips, s.total_skips)

    return jax.lax.scan(body, ls, (grads, losses))[1]


_scan_adjust_jit = jax.jit(_scan_adjust)

PRESETS = ["torch", "keras", "tf_keras", "jmp", "flax", "apex"]


@pytest.mark.parametrize(
    "config",
    [
        core.DynamicLossScale(init_scale=4.0, growth_interval=2, min_scale=0.5, max_scale=32.0),
        core.DynamicLossScale(
            init_scale=2.0**-120, growth_interval=1, min_scale=None, max_scale=None
        ),
        core.DynamicLossScale(
            init_scale=2.0**126,
            growth_interval=1,
            growth_factor=3.0,
            min_scale=None,
            max_scale=None,
        ),
        core.DynamicLossScale(
            init_scale=1000.0, growth_interval=3, backoff_factor=0.3, growth_factor=1.7
        ),
        *(core.DynamicLossScale.preset(p, growth_interval=2) for p in PRESETS),
        core.StaticLossScale(8.0),
        core.NoLossScale(),
    ],
    ids=lambda c: f"{c.kind}-{getattr(c, 'init_scale', '')}-{getattr(c, 'max_scale', '')}",
)
@settings(max_examples=15, deadline=None)
@given(flags=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=SEQ, max_size=SEQ))
def test_matches_reference_bit_for_bit(config, flags):
    ref = core.simulate(config, flags)
    g = jnp.array([f[0] for f in flags])
    lf = jnp.array([f[1] for f in flags])
    scale, counter, consec, total = jax.device_get(
        _scan_adjust_jit(ujax.loss_scale_from_config(config), g, lf)
    )
    assert bits(scale) == bits(np.array([s.scale for s in ref], np.float32))
    assert counter.tolist() == [int(s.counter) for s in ref]
    assert consec.tolist() == [int(s.consecutive_skips) for s in ref]
    assert total.tolist() == [int(s.total_skips) for s in ref]


def _jmp_run(period, flags):
    def body(ls, finite):
        ls = ls.adjust(finite)
        return ls, (ls.loss_scale, ls.counter)

    return jax.lax.scan(body, jmp.DynamicLossScale(jnp.float32(2.0**15), period=period), flags)[1]


_jmp_run_jit = jax.jit(_jmp_run, static_argnums=0)


@pytest.mark.skipif(jmp is None, reason="jmp is not installed (pip install 'unimp[test]')")
@settings(max_examples=25, deadline=None)
@given(flags=st.lists(st.booleans(), min_size=SEQ, max_size=SEQ), period=st.integers(1, 5))
def test_matches_jmp_dynamic_loss_scale(flags, period):
    # jmp's default floor is 1.0 (the preset's), so its jit bug cannot show here.
    f = jnp.array(flags)
    scale, counter = _jmp_run_jit(period, f)
    ours = _scan_adjust_jit(
        ujax.DynamicLossScale.preset("jmp", growth_interval=period), f, jnp.ones(SEQ, bool)
    )
    assert bits(ours[0]) == bits(scale)
    assert ours[1].tolist() == counter.tolist()


def _flax_run(flax_interval, flags):
    """Drives flax's DynamicScale with gradients that are finite or inf per flag."""
    ds = DynamicScale(growth_interval=flax_interval)

    def body(ds, finite):
        x = jnp.where(finite, 1.0, jnp.inf)
        ds, *_ = ds.value_and_grad(lambda p: jnp.sum(p * x))(jnp.ones(2))
        return ds, ds.scale

    return jax.lax.scan(body, ds, flags)[1]


@settings(max_examples=20, deadline=None)
@given(flags=st.lists(st.booleans(), min_size=SEQ, max_size=SEQ), interval=st.integers(1, 4))
def test_matches_flax_dynamic_scale(flags, interval):
    # flax checks fin_steps == growth_interval before counting: its interval n is unimp's n + 1.
    theirs = _flax_run(interval, jnp.array(flags))
    ours = _scan_adjust_jit(
        ujax.DynamicLossScale.preset("flax", growth_interval=interval + 1),
        jnp.array(flags),
        jnp.ones(SEQ, bool),
    )[0]
    assert bits(ours) == bits(theirs)


def test_flax_preset_grows_on_step_2001_like_flax():
    flags = jnp.ones(2002, bool)
    theirs = np.asarray(_flax_run(2000, flags))
    ours = np.asarray(_scan_adjust(ujax.DynamicLossScale.preset("flax"), flags, flags)[0])
    assert theirs[1999] == theirs[1998] == 2.0**16 and theirs[2000] == 2.0**17  # flax: step 2001
    assert bits(ours) == bits(theirs)


@pytest.mark.parametrize("kind", ["static", "none"])
def test_static_and_noop_keep_scale_and_count_skips(kind):
    ls = ujax.loss_scale_from_config(CONFIGS[kind])
    for _ in range(3):
        ls = ls.adjust(jnp.array(False))
    assert float(ls.loss_scale) == CONFIGS[kind].initial_scale()
    assert (int(ls.consecutive_skips), int(ls.total_skips)) == (3, 3)


def test_forward_overflow_keeps_scale():
    ls = ujax.DynamicLossScale().adjust(jnp.array(False), jnp.array(False))
    assert float(ls.loss_scale) == 2.0**15 and int(ls.total_skips) == 1


def test_scale_unscale_dtypes():
    ls = ujax.DynamicLossScale(2.0**16)
    scaled = ls.scale({"loss": jnp.float16(1.0), "n": jnp.int32(2)})
    assert (
        scaled["loss"].dtype == jnp.float32 and float(scaled["loss"]) == 65536.0
    )  # no float16 inf
    assert scaled["n"].dtype == jnp.int32 and int(scaled["n"]) == 2
    assert float(ls.unscale(jnp.float32(65536.0 * 3))) == 3.0
    noop = ujax.NoOpLossScale()
    x = jnp.float16(3.0)
    assert noop.scale(x) is x and noop.unscale(x) is x and float(noop.loss_scale) == 1.0


def test_jmp_style_static_constructor():
    ls = ujax.StaticLossScale(128.0)
    assert ls.config == core.StaticLossScale(128.0) and float(ls.scale(jnp.float32(1))) == 128.0


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (
            lambda: ujax.DynamicLossScale(config=core.StaticLossScale(2.0)),
            TypeError,
            "loss_scale_from_config",
        ),
        (lambda: ujax.DynamicLossScale(jnp.ones(2)), ValueError, "scalar"),
        (lambda: ujax.DynamicLossScale(True), TypeError, "bool"),
        (
            lambda: ujax.DynamicLossScale(0.5, config=core.DynamicLossScale()),
            ValueError,
            "min_scale",
        ),
        (
            lambda: ujax.StaticLossScale(4.0, config=core.StaticLossScale(2.0)),
            ValueError,
            "config.scale",
        ),
        (lambda: ujax.NoOpLossScale(2.0), ValueError, "1.0"),
        (lambda: ujax.DynamicLossScale().adjust(jnp.ones(2, bool)), ValueError, "bool scalar"),
        (lambda: ujax.DynamicLossScale().adjust(jnp.float32(1)), ValueError, "bool scalar"),
        (
            lambda: ujax.StaticLossScale.from_state_dict(ujax.DynamicLossScale().state_dict()),
            ValueError,
            "DynamicLossScale.from_state_dict",
        ),
        (
            lambda: ujax.loss_scale_from_state_dict({"scale": 2.0, "_growth_tracker": 0}),
            ValueError,
            "GradScaler",
        ),
        (
            lambda: jax.jit(lambda s: s.state_dict())(ujax.DynamicLossScale()),
            TypeError,
            "outside jit",
        ),
        (lambda: ujax.loss_scale_from_config("sometimes"), ValueError, "dynamic"),
    ],
    ids=[
        "wrong-config",
        "non-scalar",
        "bool",
        "below-floor",
        "static-mismatch",
        "noop-not-1",
        "flag-shape",
        "flag-dtype",
        "wrong-kind-load",
        "torch-format",
        "state-dict-in-jit",
        "bad-spec",
    ],
)
def test_loss_scale_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_state_dict_from_another_backend_resumes():
    d = core.state_dict(core.DynamicLossScale.preset("torch"), core.LossScaleState(1024.0, 7, 2, 5))
    ls = ujax.loss_scale_from_state_dict(d)
    assert isinstance(ls, ujax.DynamicLossScale)
    assert (
        float(ls.loss_scale),
        int(ls.counter),
        int(ls.consecutive_skips),
        int(ls.total_skips),
    ) == (1024.0, 7, 2, 5)
    assert ls.state_dict() == d


def test_max_consecutive_skips_check():
    ls = ujax.DynamicLossScale.from_config(core.DynamicLossScale(max_consecutive_skips=2))
    for _ in range(3):
        ls = ls.adjust(False)
    with pytest.raises(unimp.LossScaleError, match="stuck"):
        ls.check()


# ------------------------------------------------------------------------------------------
# all_finite / select_tree
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tree,expected",
    [
        ({"a": jnp.ones(3), "b": jnp.zeros((2, 2), jnp.bfloat16)}, True),
        ({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.nan], jnp.float16)}, False),
        ([jnp.array([jnp.inf])], False),
        ({"i": jnp.arange(3), "f": jnp.ones(1)}, True),
        ({}, True),
        ((1.0, float("inf")), False),
    ],
    ids=["finite", "nan-half", "inf", "ints-ignored", "empty", "python-inf"],
)
def test_all_finite(tree, expected):
    out = ujax.all_finite(tree)
    assert out.dtype == jnp.bool_ and out.shape == () and bool(out) is expected


def test_all_finite_axis_name_agrees_across_replicas():
    x = jnp.array([[1.0, 2.0], [jnp.nan, 0.0], [3.0, 4.0]])
    local = jax.vmap(ujax.all_finite)(x)
    shared = jax.vmap(lambda r: ujax.all_finite(r, axis_name="i"), axis_name="i")(x)
    assert local.tolist() == [True, False, True]
    assert shared.tolist() == [False, False, False]


def test_select_tree_is_bitwise():
    a = {"x": jnp.array([-0.0, jnp.nan]), "n": jnp.int32(1)}
    b = {"x": jnp.array([1.0, 2.0]), "n": jnp.int32(2)}
    assert tree_bits(ujax.select_tree(jnp.array(True), a, b)) == tree_bits(a)
    assert tree_bits(jax.jit(ujax.select_tree)(jnp.array(False), a, b)) == tree_bits(b)


@pytest.mark.parametrize(
    "pred,a,b,match",
    [
        (jnp.array([True]), jnp.ones(1), jnp.ones(1), "bool scalar"),
        (jnp.float32(1), jnp.ones(1), jnp.ones(1), "bool scalar"),
        (True, {"a": jnp.ones(1)}, {"b": jnp.ones(1)}, "structure"),
        (True, jnp.ones(1), jnp.ones(1, jnp.float16), "differs"),
    ],
    ids=["shape", "dtype", "structure", "leaf-dtype"],
)
def test_select_tree_errors(pred, a, b, match):
    with pytest.raises(ValueError, match=match):
        ujax.select_tree(pred, a, b)


# ------------------------------------------------------------------------------------------
# optax
# ------------------------------------------------------------------------------------------

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
    assert int(ls.consecutive_skips) == CONSECUTIVE[step]
    assert int(ls.total_skips) == TOTAL[step]
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
    assert float(ls.loss_scale) == 2.0**15 and int(ls.total_skips) == 1
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
    assert (float(ls.loss_scale), int(ls.total_skips)) == (1.0, 1)
    params, state = history[3]  # the next window applies the mean gradient [2, 2]
    assert params.tolist() == [-1.0, 0.0]
    assert int(ujax.get_loss_scale(state).consecutive_skips) == 0


def test_upstream_optax_multisteps_keeps_nan_after_a_bad_window():
    # Why unimp ships MultiSteps: optax resets with 0 * acc, and 0 * nan is nan. If this starts
    # failing, optax fixed it and unimp.backends.jax.MultiSteps can become an alias.
    history = _multisteps_run(optax.MultiSteps, [[np.nan, 0.0], [1.0, 1.0], [1.0, 3.0], [3.0, 1.0]])
    assert bool(jnp.isnan(history[1][1].acc_grads).any())
    assert history[3][0].tolist() == [1.0, 2.0]  # the clean second window is lost too


# ------------------------------------------------------------------------------------------
# prepare / train_step
# ------------------------------------------------------------------------------------------


def test_prepare_casts_params_and_wraps_optimizer():
    mp = ujax.MixedPrecision("mixed_float16")
    params, opt = mp.prepare({"w": jnp.ones(2, jnp.float16), "n": jnp.int32(1)}, optax.sgd(0.1))
    assert params["w"].dtype == jnp.float32 and params["n"].dtype == jnp.int32
    ls = ujax.get_loss_scale(opt.init(params))
    assert isinstance(ls, ujax.DynamicLossScale) and ls.config == mp.loss_scale


def _dot_loss(params, batch):
    return jnp.dot(params, batch)


def _half_dot(params, batch):
    # float16 compute: a large input keeps the loss finite but overflows the scaled gradient.
    return jnp.dot(params.astype(jnp.float16), batch.astype(jnp.float16)).astype(jnp.float32)


def test_train_step_right_value_clipping_on_unscaled_grads():
    mp = ujax.MixedPrecision(
        unimp.Recipe("mixed_float16", core.DynamicLossScale(init_scale=2.0**16))
    )
    step = mp.train_step(_dot_loss, optax.sgd(1.0), jnp.zeros(2), max_grad_norm=1.0)
    r = step(jnp.array([3.0, 4.0]))
    assert r.scale == 65536.0 and r.grad_norm == 5.0 and r.applied
    assert step.params.tolist() == [-np.float32(0.6), -np.float32(0.8)]


def test_train_step_grad_norm_none_without_clipping():
    r = ujax.MixedPrecision("float32").train_step(_dot_loss, optax.sgd(1.0), jnp.zeros(2))(
        jnp.ones(2)
    )
    assert r.grad_norm is None and r.scale == 1.0 and r.loss == 0.0


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
    "chain-clip-adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    "inject-hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
}


def _affine_loss(params, batch):
    return jnp.sum(params["w"] * batch) + params["b"]


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
    assert step.jitted._cache_size() == 1


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


def test_train_step_forward_overflow_skips_without_backoff():
    step = ujax.MixedPrecision("mixed_float16").train_step(
        lambda p, b: jnp.sum(p) * b, optax.sgd(1.0), jnp.ones(2)
    )
    r = step(jnp.float32(jnp.inf))
    assert (r.applied, r.loss_finite, r.scale) == (False, False, 2.0**15)
    assert float(step.loss_scale.loss_scale) == 2.0**15 and r.total_skips == 1
    assert step.params.tolist() == [1.0, 1.0]


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


def test_train_step_state_dict_roundtrip_and_cross_backend_resume():
    step = ujax.MixedPrecision("mixed_float16").train_step(_half_dot, optax.sgd(1.0), jnp.ones(2))
    step(jnp.array([1000.0, 1.0]))
    saved = step.state_dict()
    assert saved["state"] == {
        "scale": 2.0**14,
        "counter": 0,
        "consecutive_skips": 1,
        "total_skips": 1,
    }
    d = core.state_dict(core.DynamicLossScale.preset("torch"), core.LossScaleState(512.0, 3, 0, 9))
    step.load_state_dict(d)
    assert step.state_dict() == d
    r = step(jnp.ones(2))
    assert r.scale == 512.0 and r.total_skips == 9


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
        ([{"x": jnp.ones((2, 3)), "y": jnp.zeros(2)}] * 2 + [{"x": jnp.ones((3, 3)), "y": jnp.zeros(3)}], "micro-batch 2 differs"),
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


# ------------------------------------------------------------------------------------------
# transformations, upstream evidence, the example
# ------------------------------------------------------------------------------------------


def test_adjust_under_vmap_matches_reference_per_row():
    flags = jnp.array([[True, False, True], [False, False, True]])
    cfg = core.DynamicLossScale(init_scale=8.0, growth_interval=1)
    ls = jax.vmap(lambda _: ujax.DynamicLossScale.from_config(cfg))(jnp.arange(2))

    def run(ls, row):
        for i in range(row.shape[0]):
            ls = ls.adjust(row[i])
        return ls

    out = jax.vmap(run)(ls, flags)
    expected = [float(core.simulate(cfg, row)[-1].scale) for row in flags.tolist()]
    assert out.loss_scale.tolist() == expected == [16.0, 4.0]


def test_shard_map_replicas_take_the_same_decision():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    P = jax.sharding.PartitionSpec
    n = len(jax.devices())
    grads = jnp.ones((n, 2)).at[0, 0].set(jnp.nan)  # one replica overflows

    def per_replica(g, ls):
        finite = ujax.all_finite(g, axis_name="d")
        return ls.adjust(finite).loss_scale[None], finite[None]

    fn = jax.shard_map(per_replica, mesh=mesh, in_specs=(P("d"), P()), out_specs=(P("d"), P("d")))
    scales, finite = fn(grads, ujax.DynamicLossScale(8.0))
    assert scales.tolist() == [4.0] * n and finite.tolist() == [False] * n


@pytest.mark.skipif(jmp is None, reason="jmp is not installed (pip install 'unimp[test]')")
def test_jmp_reference_bugs_that_unimp_avoids():
    # Evidence for the issue text: jmp drops min_loss_scale across jit and tree_map, and
    # crashes on a float16 scale; unimp keeps the floor and converts to float32.
    theirs = jmp.DynamicLossScale(jnp.float32(4.0), min_loss_scale=jnp.float32(0.25))
    assert float(jax.jit(lambda s: s)(theirs).min_loss_scale) == 1.0
    with pytest.raises(TypeError):
        jmp.DynamicLossScale(jnp.float16(2**15)).adjust(jnp.array(True))
    ours = ujax.DynamicLossScale(4.0, config=core.DynamicLossScale(init_scale=4.0, min_scale=0.25))
    assert jax.jit(lambda s: s)(ours).min_loss_scale == 0.25


@pytest.mark.slow
def test_example_runs(capsys):
    import pathlib
    import runpy

    path = pathlib.Path(__file__).parents[1] / "examples" / "jax_flax_optax.py"
    runpy.run_path(str(path), run_name="example")["main"](steps=2)
    out = capsys.readouterr().out
    assert "logits computed in float16, returned as float32" in out
    assert out.count("compilations 1") == 2


def test_integer_loss_is_refused_like_the_other_backends():
    step = ujax.MixedPrecision().train_step(lambda p, b: jnp.sum(b).astype(jnp.int32), optax.sgd(0.1), jnp.ones(2))
    with pytest.raises(TypeError, match="floating loss"):
        step(jnp.ones(2))
    assert step.params.tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"counter": 5000}, "counter"),
        ({"counter": -3}, "counter"),
        ({"counter": 1.7}, "counter"),
        ({"consecutive_skips": 5, "total_skips": 0}, "consecutive_skips"),
        ({"counter": 2**40}, "counter"),
    ],
    ids=["counter-above-interval", "negative", "fractional", "skips", "beyond-int32"],
)
def test_pytree_refuses_states_its_own_loader_would_refuse(kwargs, needle):
    # the same rules as loading a portable state_dict (the other backends' only way in)
    with pytest.raises(ValueError, match=needle):
        ujax.DynamicLossScale(8.0, **kwargs)
    ok = ujax.DynamicLossScale(8.0, counter=3)
    assert ujax.loss_scale_from_state_dict(ok.state_dict()).state == ok.state


@pytest.mark.parametrize(
    "make_opt,warns",
    [
        (lambda: optax.adam(1e-3), True),
        (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adagrad(1e-3)), True),
        (lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3, eps=1e-4), False),
        (lambda: optax.sgd(1e-3, momentum=0.9), False),
    ],
    ids=["adam", "chained-adagrad", "adam-eps-1e-4", "sgd-momentum"],
)
def test_pure_float16_second_moments_warn(make_opt, warns):
    import warnings

    mp = ujax.MixedPrecision(unimp.get_recipe("float16", loss_scale="none"))
    params = {"w": jnp.ones(3)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mp.train_step(lambda p, b: jnp.sum(p["w"] * b), make_opt(), params)
    said = [w for w in caught if issubclass(w.category, unimp.HalfOptimizerStateWarning)]
    assert len(said) == int(warns)
    # float32 optimizer state (a mixed recipe) is never a problem
    with warnings.catch_warnings():
        warnings.simplefilter("error", unimp.HalfOptimizerStateWarning)
        ujax.MixedPrecision("mixed_float16").train_step(lambda p, b: jnp.sum(p["w"] * b), make_opt(), params)


def test_device_commits_the_step_state_and_batches_there():
    mp = ujax.MixedPrecision("mixed_float16", device="cpu")
    assert mp.device == jax.devices("cpu")[0]
    step = mp.train_step(_affine_loss, optax.sgd(0.1), {"w": np.ones(2, np.float32), "b": np.float32(0.0)})
    step(np.ones(2, np.float32))  # a host batch is put on the device
    step(jnp.ones(2))
    leaves = jax.tree_util.tree_leaves((step.params, step.opt_state, step.loss_scale))
    assert all(x.committed and x.devices() == {mp.device} for x in leaves)
    assert step.traces == 1
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    with pytest.raises(ValueError, match="device= and mesh="):
        mp.train_step(_affine_loss, optax.sgd(0.1), {"w": jnp.ones(2)}, axis_name="data", mesh=mesh)
    with pytest.raises(ValueError, match="not a device unimp reads"):
        ujax.MixedPrecision("mixed_float16", device="abacus")


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
    with pytest.warns(unimp.HalfOptimizerStateWarning, match="epsilon is 0 in float16"):
        mp.train_step(lambda p, b: jnp.sum(p["w"] * b), two, params)  # the smallest eps counts
