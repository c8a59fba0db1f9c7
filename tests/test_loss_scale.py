import dataclasses
import json
import math

import numpy as np
import pytest
from conftest import edited_state_dict
from hypothesis import given, settings
from hypothesis import strategies as st

import unimp
from unimp import (
    DynamicLossScale,
    LossScaleError,
    NoLossScale,
    StaticLossScale,
    from_state_dict,
    simulate,
    state_dict,
    update,
)
from unimp.loss_scale import (
    EXTRA_FIELDS,
    LossScaleState,
    check_state,
    loss_scale_from_dict,
    skip_counts,
    update_arrays,
)

# ---- right values from the core issue ---------------------------------------------------------


def test_growth_stops_at_2_pow_127_and_never_inf():
    cfg = DynamicLossScale(init_scale=2**16, growth_factor=2, growth_interval=1, max_scale=None)
    states = simulate(cfg, [True] * 200)
    scales = [float(s.scale) for s in states]
    growths = sum(1 for a, b in zip([2.0**16] + scales, scales, strict=False) if b > a)
    assert growths == 111
    assert scales[110] == 2.0**127
    assert all(s == 2.0**127 for s in scales[110:])
    assert all(math.isfinite(s) for s in scales)
    assert states[-1].scale.dtype == np.float32


@pytest.mark.parametrize("min_scale,expected", [(1.0, 1.0), (2**-5, 0.03125)])
def test_forty_overflows_floor(min_scale, expected):
    cfg = DynamicLossScale(init_scale=2**16, min_scale=min_scale)
    final = simulate(cfg, [False] * 40)[-1]
    assert float(final.scale) == expected
    assert int(final.total_skips) == 40 and int(final.consecutive_skips) == 40


@pytest.mark.parametrize("grads_finite,expected", [(True, 65536.0), (False, 16384.0)])
def test_float16_init(grads_finite, expected):
    cfg = DynamicLossScale(init_scale=np.float16(2**15), growth_interval=1)
    s = update(cfg, cfg.initial_state(), grads_finite)
    assert float(s.scale) == expected
    assert s.scale.dtype == np.float32


def test_bfloat16_init():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes ships with jax and tensorflow")
    cfg = DynamicLossScale(init_scale=ml_dtypes.bfloat16(2**15))
    assert cfg.initial_state().scale == np.float32(32768.0)


# ---- rules -----------------------------------------------------------------------------------


def test_grows_on_growth_interval_th_finite_step():
    cfg = DynamicLossScale(init_scale=8, growth_interval=3)
    scales = [float(s.scale) for s in simulate(cfg, [True] * 7)]
    assert scales == [8, 8, 16, 16, 16, 32, 32]


def test_overflow_restarts_counter():
    cfg = DynamicLossScale(init_scale=8, growth_interval=2, min_scale=1)
    states = simulate(cfg, [True, False, True, True])
    assert [float(s.scale) for s in states] == [8, 4, 4, 8]
    assert [int(s.counter) for s in states] == [1, 0, 1, 0]


def test_max_scale_clamps():
    cfg = DynamicLossScale(init_scale=3, growth_factor=2, growth_interval=1, max_scale=10)
    assert [float(s.scale) for s in simulate(cfg, [True] * 3)] == [6, 10, 10]


def test_no_floor_stops_at_smallest_normal():
    cfg = DynamicLossScale(init_scale=1, min_scale=None)
    final = simulate(cfg, [False] * 300)[-1]
    assert float(final.scale) == 2.0**-126
    assert math.isfinite(1.0 / float(final.scale))


def test_forward_overflow_keeps_scale_and_counter():
    cfg = DynamicLossScale(init_scale=1024, growth_interval=3)
    states = simulate(cfg, [True, (False, False), (True, False), True, True])
    assert [float(s.scale) for s in states] == [1024, 1024, 1024, 1024, 2048]
    assert [int(s.counter) for s in states] == [1, 1, 1, 2, 0]
    assert [int(s.consecutive_skips) for s in states] == [0, 1, 2, 0, 0]
    assert [int(s.total_skips) for s in states] == [0, 1, 2, 2, 2]


@pytest.mark.parametrize("cfg", [NoLossScale(), StaticLossScale(128.0)], ids=["none", "static"])
def test_fixed_scales_skip_and_count(cfg):
    states = simulate(cfg, [True, False, False, True, (True, False)])
    assert {float(s.scale) for s in states} == {cfg.initial_scale()}
    assert [int(s.consecutive_skips) for s in states] == [0, 1, 2, 0, 1]
    assert [int(s.total_skips) for s in states] == [0, 1, 2, 2, 3]
    assert {int(s.counter) for s in states} == {0}


def test_non_power_of_two_factors_use_float32_arithmetic():
    cfg = DynamicLossScale(
        init_scale=1000.0, growth_factor=1.5, backoff_factor=0.7, growth_interval=1, min_scale=1
    )
    s = update(cfg, cfg.initial_state(), False)
    assert s.scale == np.float32(1000.0) * np.float32(0.7)
    s = update(cfg, s, True)
    assert s.scale == np.float32(np.float32(1000.0) * np.float32(0.7)) * np.float32(1.5)


# ---- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"backoff_factor": -0.5}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"growth_interval": True}, "growth_interval"),
        ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0}, "min_scale"),
        ({"init_scale": 0.5, "min_scale": 1.0}, "init_scale"),
        ({"init_scale": 2.0**30}, "init_scale"),
        ({"init_scale": float("inf")}, "init_scale"),
        ({"init_scale": float("nan")}, "init_scale"),
        ({"growth_factor": float("inf")}, "growth_factor"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"max_scale": float("inf")}, "max_scale"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips"),
        ({"init_scale": "big"}, "init_scale"),
        ({"init_scale": "65536"}, "init_scale must be a number, got the string '65536'"),
        ({"overflow_tolerance": "0.1"}, "overflow_tolerance must be a number, got the string"),
    ],
)
def test_invalid_dynamic_config_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DynamicLossScale(**kwargs)


def test_state_counters_follow_the_configs_integer_rule():
    d = {"scale": 2.0, "counter": 5.0, "consecutive_skips": 0, "total_skips": 1}
    assert int(LossScaleState.from_dict(d).counter) == 5  # an integral float, as configs take it
    with pytest.raises(ValueError, match="'counter' must be an int in"):
        LossScaleState.from_dict({**d, "counter": 5.5})


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "x", "128"])
def test_invalid_static(bad):
    with pytest.raises(ValueError, match="scale"):
        StaticLossScale(bad)


def test_configs_frozen_and_hashable():
    cfg = DynamicLossScale()
    with pytest.raises(AttributeError):
        cfg.init_scale = 1.0  # type: ignore[misc]
    assert hash(cfg) == hash(DynamicLossScale())
    assert cfg.replace(growth_interval=5).growth_interval == 5
    with pytest.raises(ValueError, match="growth_interval"):
        cfg.replace(growth_interval=0)


# ---- presets ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,init,interval,min_scale,max_scale",
    [
        ("torch", 2.0**16, 2000, None, None),
        ("keras", 2.0**15, 2000, None, None),
        ("tf_keras", 2.0**15, 2000, 1.0, None),
        ("jmp", 2.0**15, 2000, 1.0, None),
        ("flax", 2.0**16, 2001, None, float(np.finfo(np.float32).max)),
        ("apex", 2.0**16, 2000, None, 2.0**24),
    ],
)
def test_presets(name, init, interval, min_scale, max_scale):
    p = DynamicLossScale.preset(name)
    assert (p.init_scale, p.growth_interval, p.min_scale, p.max_scale) == (
        init,
        interval,
        min_scale,
        max_scale,
    )
    assert (p.growth_factor, p.backoff_factor) == (2.0, 0.5)


def test_preset_overrides_and_unknown():
    assert DynamicLossScale.preset("torch", growth_interval=10).growth_interval == 10
    assert DynamicLossScale.preset("tf.keras") == DynamicLossScale.preset("tf_keras")
    with pytest.raises(ValueError, match="Did you mean 'keras'"):
        DynamicLossScale.preset("kera")


# ---- state_dict ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        NoLossScale(),
        StaticLossScale(64),
        DynamicLossScale(),
        DynamicLossScale.preset("flax"),
        DynamicLossScale(min_scale=None, max_scale=None, max_consecutive_skips=3),
    ],
    ids=["none", "static", "dynamic", "flax", "no-bounds"],
)
def test_state_dict_round_trip_before_first_step(cfg):
    d = state_dict(cfg)
    d2 = json.loads(json.dumps(d))
    assert d2["format"] == "unimp.loss_scale/1"
    cfg2, s2 = from_state_dict(d2)
    assert cfg2 == cfg and s2 == cfg.initial_state()


def test_state_dict_round_trip_mid_run():
    cfg = DynamicLossScale(init_scale=1024, growth_interval=2)
    s = simulate(cfg, [True, False, True])[-1]
    cfg2, s2 = from_state_dict(json.loads(json.dumps(state_dict(cfg, s))))
    assert (cfg2, s2) == (cfg, s)
    assert update(cfg2, s2, True) == update(cfg, s, True)


def _sd(**changes):
    return edited_state_dict(DynamicLossScale(growth_interval=4), **changes)


@pytest.mark.parametrize(
    "d,needle",
    [
        ([], "dict"),
        ({}, "format"),
        ({"scale": 65536.0, "_growth_tracker": 3}, "GradScaler"),
        (_sd(format="unimp.loss_scale/99"), "format"),
        (_sd(extra=1), "extra"),
        (_sd(state=KeyError), "state"),
        (_sd(config__kind="adaptive"), "kind"),
        (_sd(config__growth_factor=0.5), "growth_factor"),
        (_sd(config__bogus=1), "bogus"),
        (_sd(state__counter=4), "counter"),
        (_sd(state__counter=-1), "counter"),
        (_sd(state__counter=1.5), "counter"),
        (_sd(state__scale="x"), "scale"),
        (_sd(state__scale=float("inf")), "scale"),
        (_sd(state__scale=2.0**30), "scale"),
        (_sd(state__total_skips=KeyError), "total_skips"),
        (_sd(state__consecutive_skips=5), "consecutive_skips"),
    ],
)
def test_corrupt_or_foreign_state_dict(d, needle):
    with pytest.raises(ValueError, match=needle):
        from_state_dict(d)


def test_loss_scale_from_dict_forms():
    assert loss_scale_from_dict(None) == NoLossScale()
    assert loss_scale_from_dict("dynamic") == DynamicLossScale()
    assert loss_scale_from_dict("none") == NoLossScale()
    assert loss_scale_from_dict(128) == StaticLossScale(128)
    assert loss_scale_from_dict("preset:torch") == DynamicLossScale.preset("torch")
    with pytest.raises(ValueError, match="'none', 'dynamic'"):
        loss_scale_from_dict("sometimes")


# ---- max_consecutive_skips -------------------------------------------------------------------


def test_max_consecutive_skips_raises_with_reason():
    cfg = DynamicLossScale(max_consecutive_skips=3)
    states = simulate(cfg, [False] * 4)
    for s in states[:3]:
        check_state(cfg, s)
    with pytest.raises(LossScaleError, match="stuck.*4 skipped steps in a row"):
        check_state(cfg, states[3])


# ---- properties ------------------------------------------------------------------------------

configs = st.builds(
    DynamicLossScale,
    init_scale=st.sampled_from([1.0, 3.0, 2.0**10, 2.0**15, 2.0**16]),
    growth_factor=st.sampled_from([1.5, 2.0, 3.0, 4.0]),
    backoff_factor=st.sampled_from([0.25, 0.5, 0.7, 0.9]),
    growth_interval=st.integers(1, 6),
    min_scale=st.sampled_from([None, 1.0, 0.5]),
    max_scale=st.sampled_from([None, 2.0**16, 2.0**20]),
)
events = st.lists(st.one_of(st.booleans(), st.tuples(st.booleans(), st.booleans())), max_size=120)


@settings(max_examples=300, deadline=None)
@given(configs, events)
def test_reference_invariants(cfg, flags):
    s = cfg.initial_state()
    hi = cfg.max_scale if cfg.max_scale is not None else float(np.finfo(np.float32).max)
    skips = run = 0
    states = []
    for flag in flags:
        g, lf = flag if isinstance(flag, tuple) else (flag, True)
        s = update(cfg, s, g, lf)
        states.append(s)
        applied = g and lf
        skips += not applied
        run = 0 if applied else run + 1
        assert s.scale.dtype == np.float32 and s.counter.dtype == np.int32
        assert math.isfinite(float(s.scale)) and cfg.floor <= float(s.scale) <= hi
        assert 0 <= int(s.counter) < cfg.growth_interval
        assert int(s.total_skips) == skips and int(s.consecutive_skips) == run
    assert simulate(cfg, flags) == states


def _spec(cfg, scale, counter, consecutive, total, g, lf):
    """The rule as first written: one nested select per output, in NumPy float32/int32.
    ``update_arrays`` is written for fewer kernels; it must agree with this bit for bit."""
    f32, i32 = np.float32, np.int32
    applied = g and lf
    consecutive = i32(0) if applied else i32(consecutive + 1)
    total = i32(total) if applied else i32(total + 1)
    if not cfg.dynamic:
        return f32(scale), i32(counter), consecutive, total
    with np.errstate(over="ignore"):
        grown = f32(scale) * f32(cfg.growth_factor)
    if cfg.max_scale is not None:
        grown = min(grown, f32(cfg.max_scale))
    grown = grown if np.isfinite(grown) else f32(scale)
    backed = max(f32(scale) * f32(cfg.backoff_factor), f32(cfg.floor))
    grow = counter + 1 >= cfg.growth_interval
    if applied:
        return (grown if grow else f32(scale)), i32(0 if grow else counter + 1), consecutive, total
    if lf:
        return backed, i32(0), consecutive, total
    return f32(scale), i32(counter), consecutive, total


spec_configs = st.one_of(
    configs,
    st.builds(DynamicLossScale, init_scale=st.just(2.0**100), growth_factor=st.sampled_from([2.0, 1e30]),
              growth_interval=st.integers(1, 3), max_scale=st.sampled_from([None, 3.0e38])),
    st.builds(StaticLossScale, st.sampled_from([1.0, 128.0])),
    st.just(NoLossScale()),
)


@settings(max_examples=500, deadline=None)
@given(spec_configs, st.data())
def test_update_arrays_matches_the_nested_select_spec(cfg, data):
    # any valid state, not only those reachable from init: scale in [floor, max], counter < interval
    if cfg.dynamic:
        hi = cfg.max_scale if cfg.max_scale is not None else float(np.finfo(np.float32).max)
        scale = np.float32(data.draw(st.floats(cfg.floor, hi, width=32)))
        counter = data.draw(st.integers(0, cfg.growth_interval - 1))
    else:
        scale, counter = np.float32(cfg.initial_scale()), 0
    consecutive, total = data.draw(st.integers(0, 1000)), data.draw(st.integers(0, 2000))
    g, lf = data.draw(st.booleans()), data.draw(st.booleans())
    state = LossScaleState(scale, np.int32(counter), np.int32(consecutive), np.int32(total))
    new = update(cfg, state, g, lf)
    got = (new.scale, new.counter, new.consecutive_skips, new.total_skips)
    want = _spec(cfg, scale, counter, consecutive, total, g, lf)
    assert [np.asarray(x).tobytes() for x in got] == [np.asarray(x).tobytes() for x in want]
    assert [np.asarray(x).dtype for x in got] == [np.asarray(x).dtype for x in want]


# ---- found by trying to break it -------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: StaticLossScale(1e-40),
        lambda: DynamicLossScale(init_scale=1.0, min_scale=1e-45),
        # TF and XLA flush a subnormal factor to 0: backed off to the floor there, not in NumPy
        lambda: DynamicLossScale(backoff_factor=1e-38, min_scale=None),
    ],
    ids=["static-subnormal", "min-subnormal", "backoff-subnormal"],
)
def test_subnormal_scales_are_refused(make):
    # 1/scale would be inf in float32 and a "clean" step would write -inf into the weights
    with pytest.raises(ValueError, match="2\\*\\*-126"):
        make()


@pytest.mark.parametrize("field", ["counter", "total_skips"])
def test_counters_beyond_int32_are_a_value_error(field):
    d = state_dict(DynamicLossScale(growth_interval=2**31 - 1))
    d["state"][field] = 2**31
    with pytest.raises(ValueError, match=field):
        from_state_dict(d)


def test_stuck_message_while_still_backing_off():
    cfg = DynamicLossScale(init_scale=2**24, max_consecutive_skips=2)
    with pytest.raises(LossScaleError, match="still backing off"):
        check_state(cfg, simulate(cfg, [False] * 3)[-1])


@pytest.mark.parametrize(
    "flags, where",
    [([1, "x"], r"flags\[1\]"), ([True, 2], r"flags\[1\]"), ([None], r"flags\[0\]"),
     ([(True, "no")], r"flags\[0\]\[1\]"), ([0.5], r"flags\[0\]")],
)
def test_simulate_refuses_flags_that_are_not_bools(flags, where):
    # bool("x") is True: a string used to be read as a clean step
    with pytest.raises(ValueError, match=where + " must be a bool"):
        unimp.simulate(unimp.DynamicLossScale(), flags)


def test_simulate_takes_bools_and_0_1():
    import numpy as np

    cfg = unimp.DynamicLossScale(init_scale=8.0, growth_interval=1)
    scales = [float(s.scale) for s in unimp.simulate(cfg, [1, 0, np.bool_(True), (True, False)])]
    assert scales == [16.0, 8.0, 16.0, 16.0]


@pytest.mark.parametrize(
    "cfg, unchanged",
    [
        (NoLossScale(), ("scale", "counter", *EXTRA_FIELDS)),
        (StaticLossScale(128.0), ("scale", "counter", *EXTRA_FIELDS)),
        (DynamicLossScale(), EXTRA_FIELDS),
        (DynamicLossScale(hysteresis=2), ("overflows_since_rescale", "steps_since_rescale", "floor_hits")),
        (DynamicLossScale(floor_action="warn"), ("hysteresis_used", "overflows_since_rescale", "steps_since_rescale")),
        (DynamicLossScale(overflow_tolerance=0.25), ("hysteresis_used", "floor_hits")),
        (DynamicLossScale.preset("deepspeed"), ("overflows_since_rescale", "steps_since_rescale")),
    ],
    ids=["none", "static", "dynamic", "hysteresis", "floor-warn", "tolerance", "deepspeed"],
)
@pytest.mark.parametrize("g, lf", [(True, True), (False, True), (True, False), (False, False)])
def test_unchanged_fields_come_back_as_the_same_arrays(cfg, unchanged, g, lf):
    # a compiled step returns these from its caller instead of copying them (JAX, TensorFlow)
    from unimp.loss_scale.rule import _NumpyOps

    assert unimp.loss_scale.unchanged_fields(cfg) == unchanged
    names = [f.name for f in dataclasses.fields(LossScaleState)]
    # one decision: the fields a rule counts are the others, in the state's order
    assert unimp.loss_scale.fields_in_use(cfg) == tuple(n for n in names if n not in unchanged)
    held = [np.float32(4.0), *(np.int32(i) for i in range(1, 4))]
    extra = tuple(np.int32(i) for i in range(5, 9))
    args = (_NumpyOps, cfg, *held, np.bool_(g), np.bool_(lf))
    out = update_arrays(*args, extra=extra)
    same = {n for n, old, new in zip(names, (*held, *extra), out, strict=True) if new is old}
    assert set(unchanged) <= same
    # the caller's own applied flag gives the same bits
    fused = update_arrays(*args, extra=extra, applied=np.bool_(g and lf))
    assert [np.asarray(x).tobytes() for x in fused] == [np.asarray(x).tobytes() for x in out]


@given(
    st.integers(0, 2**20), st.integers(0, 2**20), st.booleans(), st.booleans(),
)  # fmt: skip
def test_skip_counts_are_update_arrays_counters(consecutive, extra, grads_finite, loss_finite):
    """The arithmetic form of the skip counters (torch's fused update and its report) is the
    rule's own: equal to update_arrays' for any state and either flag."""
    total = consecutive + extra  # a valid state: consecutive <= total
    after = unimp.loss_scale.update(
        DynamicLossScale(), LossScaleState(8.0, 0, consecutive, total), grads_finite, loss_finite
    )
    skipped = int(not (grads_finite and loss_finite))
    assert skip_counts(consecutive, total, skipped) == (after.consecutive_skips, after.total_skips)


@pytest.mark.parametrize(
    "counter,error",
    [(1.7, ValueError), ("3", TypeError), (True, ValueError), (2**40, ValueError), (float("nan"), ValueError),
     (-(2**31) - 1, ValueError), (np.ones(2), TypeError)],
)  # fmt: skip
def test_a_host_state_refuses_what_is_no_count(counter, error):
    """A host counter is an integer in int32's range (5.0 reads as 5); 1.7 was truncated to 1
    and a string read as a number (the breaker's finding)."""
    assert LossScaleState(2.0, 5.0, 0, 0).counter == 5
    with pytest.raises(error, match="LossScaleState.counter"):
        LossScaleState(2.0, counter, 0, 0)


def test_the_clis_static_spelling_is_taken_by_the_python_api_too():
    # `unimp compare --loss-scale static:128` and get_recipe(loss_scale="static:128"): one spelling
    from unimp import get_recipe
    from unimp.loss_scale import StaticLossScale, loss_scale_from_dict

    assert loss_scale_from_dict("static:128") == loss_scale_from_dict("128") == StaticLossScale(128.0)
    assert get_recipe("mixed_float16", loss_scale="static:128").loss_scale == StaticLossScale(128.0)
    with pytest.raises(ValueError, match="'static:<number>'"):
        loss_scale_from_dict("static:lots")
