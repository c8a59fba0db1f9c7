"""jax backend, ``scaling``: the loss-scale state and its update against the reference and the framework's own scaler."""


import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.training.dynamic_scale import DynamicScale
from hypothesis import given, settings
from hypothesis import strategies as st

import unimp
import unimp.backends.jax as ujax
from backends.jax.helpers import bits
from unimp import loss_scale as core

try:  # jmp is the reference for one comparison only; it is in the "test" extra
    import jmp
except ImportError:  # pragma: no cover
    jmp = None


SEQ = 64  # fixed length of random step sequences: one compilation per config


CONFIGS = {
    "dynamic": core.DynamicLossScale(
        init_scale=4.0, growth_interval=3, min_scale=0.25, max_scale=64.0
    ),
    "static": core.StaticLossScale(128.0),
    "none": core.NoLossScale(),
}


def _advanced(kind):
    ls = ujax.LossScale(CONFIGS[kind])
    for flag in (True, False, True, (True, False)):
        g, lf = flag if isinstance(flag, tuple) else (flag, True)
        ls = ls.adjust(jnp.array(g), jnp.array(lf))
    return ls


def _same(a, b):
    assert type(a) is type(b) and type(a.state) is type(b.state)
    assert a.config == b.config
    for f in dataclasses.fields(a.state):
        x, y = getattr(a.state, f.name), getattr(b.state, f.name)
        assert (x.dtype, bits(x)) == (y.dtype, bits(y)), f.name


ROUNDTRIPS = {
    "flatten": lambda ls: jax.tree_util.tree_unflatten(*reversed(jax.tree_util.tree_flatten(ls))),
    "jit": lambda ls: jax.jit(lambda s: s)(ls),
    "tree_map": lambda ls: jax.tree_util.tree_map(lambda x: x, ls),
    "scan": lambda ls: jax.lax.scan(lambda c, _: (c, None), ls, None, length=2)[0],
    "state_dict": lambda ls: type(ls).from_state_dict(ls.state_dict()),
    "state_dict_any": lambda ls: ujax.LossScale.from_state_dict(ls.state_dict()),
}


@pytest.mark.parametrize("how", list(ROUNDTRIPS))
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_every_field_survives(kind, how):
    ls = _advanced(kind)
    _same(ROUNDTRIPS[how](ls), ls)


def test_pytree_children_come_from_dataclass_fields():
    # the loss scale's one child is the core's state record, whose children are its fields
    ls = ujax.LossScale(core.DynamicLossScale())
    paths = [k for k, _ in jax.tree_util.tree_leaves_with_path(ls)]
    assert {k[0].name for k in paths} == {
        f.name for f in dataclasses.fields(ls) if not f.metadata.get("static")
    } == {"state"}
    names = [k[1].name for k in paths]
    assert names == [f.name for f in dataclasses.fields(core.LossScaleState)]
    assert names == ["scale", "counter", "consecutive_skips", "total_skips", *core.EXTRA_FIELDS]
    assert [k[0].name for k, _ in jax.tree_util.tree_leaves_with_path(ls.state)] == names


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_loss_scale_hashes_and_compares_by_identity(kind):
    ls = ujax.LossScale(CONFIGS[kind])
    assert ls == ls and ls != ujax.LossScale(CONFIGS[kind])
    assert {ls: 1}[ls] == 1


def test_right_value_min_scale_survives_jit():
    ls = ujax.LossScale.from_config(core.DynamicLossScale(init_scale=4.0, min_scale=0.25))
    step = jax.jit(lambda s: s.adjust(jnp.array(False)))
    for _ in range(4):
        ls = step(ls)
    assert float(ls.loss_scale) == 0.25
    assert ls.config.floor == 0.25


@pytest.mark.parametrize(
    "init", [np.float16(2**15), jnp.float16(2**15), jnp.bfloat16(2**15), np.int32(2**15), 2**15]
)
def test_right_value_state_is_float32_whatever_dtype(init):
    # a NumPy or Python value is cast by the core's record, a jax array by the loss scale
    ls = ujax.LossScale(core.DynamicLossScale(growth_interval=1), core.LossScaleState(init, 0, 0, 0))
    assert ls.loss_scale.dtype == jnp.float32 and ls.state.counter.dtype == jnp.int32
    grown, backed = ls.adjust(True), ls.adjust(False)
    assert grown.loss_scale.dtype == jnp.float32 and float(grown.loss_scale) == 65536.0
    assert backed.loss_scale.dtype == jnp.float32 and float(backed.loss_scale) == 16384.0


def test_core_record_holds_jax_arrays_and_tracers_as_given():
    # generic over arrays: host values are cast as ever, a jax array or tracer is never read
    x = jnp.float16(3.0)
    assert core.LossScaleState(x, 0, 0, 0).scale is x
    seen = []
    jax.jit(lambda s: seen.append(core.LossScaleState(s, s, s, s).counter) or s)(jnp.int32(2))
    assert isinstance(seen[0], jax.core.Tracer)
    host = core.LossScaleState(np.float64(2.0), 1.0, jnp.int32(0), 0)
    assert (type(host.scale), type(host.counter), type(host.total_skips)) == (np.float32, np.int32, np.int32)
    assert isinstance(host.consecutive_skips, jax.Array)


def test_float16_init_scale_becomes_float32():
    ls = ujax.LossScale(core.DynamicLossScale(init_scale=jnp.float16(2**15)))
    assert ls.config.init_scale == 2.0**15 and ls.loss_scale.dtype == jnp.float32


def _scan_adjust(ls, grads, losses):
    def body(s, flags):
        s = s.adjust(flags[0], flags[1])
        return s, (s.loss_scale, s.state.counter, s.state.consecutive_skips, s.state.total_skips)

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
        _scan_adjust_jit(ujax.LossScale(config), g, lf)
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
        ujax.LossScale.preset("jmp", growth_interval=period), f, jnp.ones(SEQ, bool)
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
        ujax.LossScale.preset("flax", growth_interval=interval + 1),
        jnp.array(flags),
        jnp.ones(SEQ, bool),
    )[0]
    assert bits(ours) == bits(theirs)


def test_flax_preset_grows_on_step_2001_like_flax():
    flags = jnp.ones(2002, bool)
    theirs = np.asarray(_flax_run(2000, flags))
    ours = np.asarray(_scan_adjust(ujax.LossScale.preset("flax"), flags, flags)[0])
    assert theirs[1999] == theirs[1998] == 2.0**16 and theirs[2000] == 2.0**17  # flax: step 2001
    assert bits(ours) == bits(theirs)


@pytest.mark.parametrize("kind", ["static", "none"])
def test_static_and_noop_keep_scale_and_count_skips(kind):
    ls = ujax.LossScale(CONFIGS[kind])
    for _ in range(3):
        ls = ls.adjust(jnp.array(False))
    assert float(ls.loss_scale) == CONFIGS[kind].initial_scale()
    assert (int(ls.state.consecutive_skips), int(ls.state.total_skips)) == (3, 3)


def test_forward_overflow_keeps_scale():
    ls = ujax.LossScale(core.DynamicLossScale()).adjust(jnp.array(False), jnp.array(False))
    assert float(ls.loss_scale) == 2.0**15 and int(ls.state.total_skips) == 1


def test_scale_unscale_dtypes():
    ls = ujax.LossScale(core.DynamicLossScale(init_scale=2.0**16))
    scaled = ls.scale({"loss": jnp.float16(1.0), "n": jnp.int32(2)})
    assert (
        scaled["loss"].dtype == jnp.float32 and float(scaled["loss"]) == 65536.0
    )  # no float16 inf
    assert scaled["n"].dtype == jnp.int32 and int(scaled["n"]) == 2
    assert float(ls.unscale(jnp.float32(65536.0 * 3))) == 3.0
    noop = ujax.LossScale(core.NoLossScale())
    x = jnp.float16(3.0)
    assert noop.scale(x) is x and noop.unscale(x) is x and float(noop.loss_scale) == 1.0


def test_static_loss_scale_from_a_number():
    ls = ujax.LossScale.from_config(128.0)
    assert ls.config == core.StaticLossScale(128.0) and float(ls.scale(jnp.float32(1))) == 128.0


def _state(scale, **counts):
    return core.LossScaleState(scale, **{"counter": 0, "consecutive_skips": 0, "total_skips": 0, **counts})


DYNAMIC = core.DynamicLossScale()


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: ujax.LossScale(2.0), TypeError, "from_config"),
        (lambda: ujax.LossScale(DYNAMIC, _state(jnp.ones(2))), ValueError, "scalar"),
        (lambda: ujax.LossScale(DYNAMIC, _state(jnp.asarray(True))), TypeError, "bool"),
        (lambda: ujax.LossScale(DYNAMIC, _state(0.5)), ValueError, "min_scale"),
        (lambda: ujax.LossScale(DYNAMIC, _state(jnp.float32(0.5))), ValueError, "min_scale"),
        (
            lambda: ujax.LossScale(core.StaticLossScale(2.0), _state(4.0)),
            ValueError,
            r"equal the static scale \(2.0\)",
        ),
        (lambda: ujax.LossScale(core.NoLossScale(), _state(2.0)), ValueError, "1.0"),
        (lambda: ujax.LossScale(DYNAMIC).adjust(jnp.ones(2, bool)), ValueError, "bool scalar"),
        (lambda: ujax.LossScale(DYNAMIC).adjust(jnp.float32(1)), ValueError, "bool scalar"),
        (
            lambda: ujax.LossScale.from_state_dict(
                ujax.LossScale(core.NoLossScale()).state_dict(), current=DYNAMIC
            ),
            ValueError,
            "without loss scaling",
        ),
        (
            lambda: ujax.LossScale.from_state_dict({"scale": 2.0, "_growth_tracker": 0}),
            ValueError,
            "GradScaler",
        ),
        (
            lambda: jax.jit(lambda s: s.state_dict())(ujax.LossScale(DYNAMIC)),
            TypeError,
            "outside jit",
        ),
        (lambda: ujax.LossScale.from_config("sometimes"), ValueError, "dynamic"),
        (lambda: ujax.LossScale(DYNAMIC, {"scale": 2.0}), TypeError, "LossScaleState"),
    ],
    ids=[
        "not-a-config",
        "non-scalar",
        "bool",
        "below-floor",
        "below-floor-device",
        "static-mismatch",
        "noop-not-1",
        "flag-shape",
        "flag-dtype",
        "unscaled-state-for-a-scaled-run",
        "torch-format",
        "state-dict-in-jit",
        "bad-spec",
        "state-not-a-record",
    ],
)
def test_loss_scale_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_state_dict_from_another_backend_resumes():
    d = core.state_dict(core.DynamicLossScale.preset("torch"), core.LossScaleState(1024.0, 7, 2, 5))
    ls = ujax.LossScale.from_state_dict(d)
    assert isinstance(ls, ujax.LossScale) and ls.config == core.DynamicLossScale.preset("torch")
    assert (
        float(ls.loss_scale),
        int(ls.state.counter),
        int(ls.state.consecutive_skips),
        int(ls.state.total_skips),
    ) == (1024.0, 7, 2, 5)
    assert ls.state_dict() == d


def test_max_consecutive_skips_check():
    ls = ujax.LossScale(core.DynamicLossScale(max_consecutive_skips=2))
    for _ in range(3):
        ls = ls.adjust(False)
    with pytest.raises(unimp.LossScaleError, match="stuck"):
        ls.check()


def test_adjust_under_vmap_matches_reference_per_row():
    flags = jnp.array([[True, False, True], [False, False, True]])
    cfg = core.DynamicLossScale(init_scale=8.0, growth_interval=1)
    ls = jax.vmap(lambda _: ujax.LossScale(cfg))(jnp.arange(2))

    def run(ls, row):
        for i in range(row.shape[0]):
            ls = ls.adjust(row[i])
        return ls

    out = jax.vmap(run)(ls, flags)
    expected = [float(core.simulate(cfg, row)[-1].scale) for row in flags.tolist()]
    assert out.loss_scale.tolist() == expected == [16.0, 4.0]


@pytest.mark.skipif(jmp is None, reason="jmp is not installed (pip install 'unimp[test]')")
def test_jmp_reference_bugs_that_unimp_avoids():
    # Evidence for the issue text: jmp drops min_loss_scale across jit and tree_map, and
    # crashes on a float16 scale; unimp keeps the floor and converts to float32.
    theirs = jmp.DynamicLossScale(jnp.float32(4.0), min_loss_scale=jnp.float32(0.25))
    assert float(jax.jit(lambda s: s)(theirs).min_loss_scale) == 1.0
    with pytest.raises(TypeError):
        jmp.DynamicLossScale(jnp.float16(2**15)).adjust(jnp.array(True))
    ours = ujax.LossScale(core.DynamicLossScale(init_scale=4.0, min_scale=0.25))
    assert jax.jit(lambda s: s)(ours).config.floor == 0.25


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
    # the same rules as loading a portable state_dict (the other backends' only way in): a
    # record of host values is checked by them; a fractional or too long counter cannot reach
    # a record as such (the core casts it to int32), so its wire form is the way in
    cfg = core.DynamicLossScale()
    wire = {"scale": 8.0, "counter": 0, "consecutive_skips": 0, "total_skips": 0, **kwargs}
    with pytest.raises(ValueError, match=needle):
        ujax.LossScale.from_state_dict({"format": core.STATE_FORMAT, "config": cfg.to_dict(), "state": wire})
    if all(float(v).is_integer() and abs(v) < 2**31 for v in kwargs.values()):
        with pytest.raises(ValueError, match=needle):
            ujax.LossScale(cfg, core.LossScaleState(**wire))
    ok = ujax.LossScale(cfg, _state(8.0, counter=3))
    assert ujax.LossScale.from_state_dict(ok.state_dict()).state == ok.state


def test_jmp_positional_order_is_refused_not_misread():
    # jmp's positional order is (loss_scale, counter, period, factor, min_loss_scale): the loss
    # scale takes a config first, so jmp's arguments are refused, and the message names the
    # shim and the translation
    with pytest.raises(TypeError, match="positional"):
        ujax.LossScale(jnp.float32(2**15), jnp.int32(0), 100, 4)
    with pytest.raises(TypeError, match=r"compat\.jmp\.DynamicLossScale.*growth_interval=period"):
        ujax.LossScale(jnp.float32(2**15), jnp.int32(0))
    with pytest.raises(TypeError, match="loss-scale config"):
        ujax.LossScale(jnp.float32(8.0))
    # the translation in the message runs
    ls = ujax.LossScale(
        unimp.DynamicLossScale.preset("jmp", growth_interval=100, growth_factor=4.0),
        unimp.LossScaleState(jnp.float32(2**15), jnp.int32(0), 0, 0),
    )
    cfg = ls.config
    assert (cfg.growth_interval, cfg.growth_factor, float(ls.loss_scale)) == (100, 4.0, 2.0**15)
    # pytree round trips (unflatten) and from_config keep the config
    back = jax.tree_util.tree_unflatten(*reversed(jax.tree_util.tree_flatten(ls)))
    assert back.config.growth_interval == 100
    assert ujax.LossScale.from_config(ls.config).config.growth_interval == 100
