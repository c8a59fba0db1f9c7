"""The DeepSpeed, Megatron-LM and fairseq presets against plain transcriptions of those trainers'
rules (tests/trainer_scalers.py), step for step, with ``unimp.simulate``; the trainers' fields'
rules, their portable state_dict and bad input."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trainer_scalers import DeepSpeed, Fairseq, FloorStop, Megatron

from unimp.loss_scale import (
    DynamicLossScale,
    LossScaleError,
    LossScaleFloorWarning,
    LossScaleState,
    StaticLossScale,
    check_state,
    from_state_dict,
    simulate,
    state_dict,
)
from unimp.loss_scale.presets import fairseq_floor

_F32_MAX = float(np.finfo(np.float32).max)


def _compare(trainer, config, overflows):
    """Steps both; the scales agree on every step; where the trainer stops at its floor, unimp
    counts a floor hit on the same step (and check_state raises); returns the steps compared."""
    states = simulate(config, [not o for o in overflows])
    for i, (o, s) in enumerate(zip(overflows, states, strict=True)):
        try:
            expected = trainer.step(o)
        except FloorStop:
            assert int(s.floor_hits) == 1, f"step {i}: the trainer stopped, unimp did not"
            with pytest.raises(LossScaleError, match="at its floor"):
                check_state(config, s)
            return i
        if not math.isfinite(expected) or expected > _F32_MAX:
            # unimp's rule: a growth past float32's range keeps the old scale
            assert float(s.scale) == (float(states[i - 1].scale) if i else config.init_scale)
            return i
        assert float(s.scale) == expected, f"step {i}: unimp {float(s.scale)}, trainer {expected}"
        assert int(s.floor_hits) == 0
        check_state(config, s)
    return len(overflows)


def _events(p_max=0.7, max_size=80):
    return st.floats(0.0, p_max).flatmap(
        lambda p: st.lists(st.floats(0, 1).map(lambda u, p=p: u < p), max_size=max_size)
    )


# ---- each trainer, random sequences ------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(
    flags=_events(),
    window=st.integers(1, 5),
    hysteresis=st.integers(1, 4),
    consecutive=st.booleans(),
    init_power=st.integers(0, 6),
    before=st.booleans(),
)
def test_deepspeed_preset_matches_deepspeed(flags, window, hysteresis, consecutive, init_power, before):
    cfg = DynamicLossScale.preset(
        "deepspeed", init_scale=2.0**init_power, growth_interval=window, hysteresis=hysteresis,
        consecutive_hysteresis=consecutive, delayed_first_growth=not before,
    )
    trainer = DeepSpeed(2**init_power, window, 1, hysteresis, consecutive, before_0_17_1=before)
    _compare(trainer, cfg, flags)


@settings(max_examples=120, deadline=None)
@given(flags=_events(), window=st.integers(1, 5), hysteresis=st.integers(1, 4), init_power=st.integers(0, 6))
def test_megatron_preset_matches_megatron(flags, window, hysteresis, init_power):
    cfg = DynamicLossScale.preset(
        "megatron", init_scale=2.0**init_power, growth_interval=window, hysteresis=hysteresis
    )
    _compare(Megatron(2.0**init_power, 1.0, window, hysteresis), cfg, flags)


@settings(max_examples=150, deadline=None)
@given(
    flags=_events(),
    window=st.integers(1, 6),
    tolerance=st.sampled_from([0.0, 0.05, 0.1, 0.25, 0.3, 0.5, 0.75]),
    init_power=st.integers(0, 7),
    min_loss_scale=st.sampled_from([1e-4, 1.0, 0.5, 3.0]),
)
def test_fairseq_preset_matches_fairseq(flags, window, tolerance, init_power, min_loss_scale):
    init = 2.0**init_power
    if init <= min_loss_scale:
        return
    cfg = DynamicLossScale.preset(
        "fairseq", init_scale=init, growth_interval=window, overflow_tolerance=tolerance,
        min_scale=fairseq_floor(init, min_loss_scale),
    )
    _compare(Fairseq(init, window, tolerance, min_loss_scale), cfg, flags)


# ---- the trainers' real defaults and windows ---------------------------------------------------


@pytest.mark.parametrize(
    "name,trainer,steps",
    [
        ("deepspeed", lambda: DeepSpeed(), 2600),
        ("deepspeed-0.16", lambda: DeepSpeed(before_0_17_1=True), 2600),
        ("megatron", lambda: Megatron(), 2600),
        pytest.param("fairseq", lambda: Fairseq(), 16384 + 40, marks=pytest.mark.slow),
    ],
    ids=["deepspeed", "deepspeed-before-0.17.1", "megatron", "fairseq"],
)
@settings(max_examples=2, deadline=None)
@given(data=st.data())
def test_presets_match_over_the_real_window(name, trainer, steps, data):
    cfg = (
        DynamicLossScale.preset("deepspeed", delayed_first_growth=False)
        if name == "deepspeed-0.16"
        else DynamicLossScale.preset(name)
    )
    # a few overflows anywhere, so growths after the start and after an overflow both occur
    where = data.draw(st.lists(st.integers(0, steps - 1), max_size=6))
    overflows = [i in set(where) for i in range(steps)]
    assert _compare(trainer(), cfg, overflows) == steps


def test_deepspeed_grows_on_the_1001st_clean_step():
    scales = [float(s.scale) for s in simulate(DynamicLossScale.preset("deepspeed"), [True] * 2001)]
    assert scales[999] == 2.0**16 and scales[1000] == 2.0**17  # step 1000 is the 1001st
    assert scales[1999] == 2.0**17 and scales[2000] == 2.0**18  # then every 1000


def test_deepspeed_stops_at_the_same_overflow():
    # the first overflow spends the hysteresis (2), which only a growth refills; the next 16
    # halve 2**16 to the floor 1; the 18th finds the scale at the floor: DeepSpeed raises
    cfg = DynamicLossScale.preset("deepspeed")
    assert _compare(DeepSpeed(), cfg, [True] * 30) == 17


def test_fairseq_floor_is_2_pow_minus_13_and_stops_on_the_21st_backoff():
    cfg = DynamicLossScale.preset("fairseq")
    assert cfg.min_scale == 2.0**-13 and cfg.init_scale == 128.0
    assert _compare(Fairseq(), cfg, [True] * 40) == 20


# ---- rules of the new fields -------------------------------------------------------------------


def test_hysteresis_backs_off_on_the_second_overflow_and_refills_on_growth():
    cfg = DynamicLossScale(init_scale=64, growth_interval=2, hysteresis=2)
    out = simulate(cfg, [False, False, False, True, True, False])
    assert [float(s.scale) for s in out] == [64, 32, 16, 16, 32, 32]
    assert [int(s.hysteresis_used) for s in out] == [1, 1, 1, 1, 0, 1]


def test_consecutive_hysteresis_refills_on_every_clean_step():
    cfg = DynamicLossScale(init_scale=64, hysteresis=2, consecutive_hysteresis=True)
    out = simulate(cfg, [False, True, False, True, False, False])
    assert [float(s.scale) for s in out] == [64, 64, 64, 64, 64, 32]


def test_forward_overflow_leaves_the_new_fields_alone():
    cfg = DynamicLossScale(init_scale=64, hysteresis=3, overflow_tolerance=0.5, floor_action="warn")
    s = simulate(cfg, [False, True])[-1]
    s2 = simulate(cfg, [(True, False)], state=s)[-1]
    assert (s2.hysteresis_used, s2.overflows_since_rescale, s2.steps_since_rescale) == (
        s.hysteresis_used, s.overflows_since_rescale, s.steps_since_rescale
    )
    assert s2.scale == s.scale and s2.total_skips == s.total_skips + 1


def test_floor_action_warn_warns_once_per_hit():
    cfg = DynamicLossScale(init_scale=2, min_scale=1, floor_action="warn")
    s = simulate(cfg, [False, False])[-1]
    assert int(s.floor_hits) == 1
    with pytest.warns(LossScaleFloorWarning, match="floor hit 1"):
        check_state(cfg, s, step=1)
    keep = cfg.replace(floor_action="keep")
    assert int(simulate(keep, [False, False])[-1].floor_hits) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_state(keep, simulate(keep, [False] * 3)[-1])


def test_raise_names_the_step():
    cfg = DynamicLossScale(init_scale=1, min_scale=1, floor_action="raise")
    with pytest.raises(LossScaleError, match="reported by step 7"):
        check_state(cfg, simulate(cfg, [False])[-1], step=7)


# ---- portable state ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["deepspeed", "megatron", "fairseq"])
def test_state_dict_round_trips_the_trainers_fields(name):
    cfg = DynamicLossScale.preset(name, growth_interval=3, overflow_tolerance=0.25)
    s = simulate(cfg, [True, False, True, True, False])[-1]
    d = json.loads(json.dumps(state_dict(cfg, s)))
    assert d["format"] == "unimp.loss_scale/1"
    assert set(d["state"]) >= {"hysteresis_used", "overflows_since_rescale", "steps_since_rescale", "floor_hits"}
    assert from_state_dict(d) == (cfg, s)


def test_one_format_holds_every_field_and_left_out_ones_read_as_defaults():
    d = {
        "format": "unimp.loss_scale/1",
        "config": {"kind": "dynamic", "growth_interval": 3},
        "state": {"scale": 256.0, "counter": 1, "consecutive_skips": 0, "total_skips": 1},
    }
    cfg, s = from_state_dict(d)
    assert (cfg.hysteresis, cfg.overflow_tolerance, cfg.floor_action) == (1, 0.0, "keep")
    assert s == LossScaleState(256.0, 1, 0, 1, 0, 0, 0, 0)
    # written back in the one format, with every field of the config and of the state
    out = state_dict(cfg, s)
    assert out["format"] == "unimp.loss_scale/1"
    assert set(out["config"]) == {"kind", *(f.name for f in dataclasses.fields(DynamicLossScale))}
    assert out["state"] == {f.name: 0 for f in dataclasses.fields(LossScaleState)} | d["state"]


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(hysteresis=0), "hysteresis"),
        (dict(hysteresis=1.5), "hysteresis"),
        (dict(overflow_tolerance=1.0), "overflow_tolerance"),
        (dict(overflow_tolerance=-0.1), "overflow_tolerance"),
        (dict(overflow_tolerance=float("nan")), "overflow_tolerance"),
        (dict(floor_action="stop"), "floor_action"),
        (dict(consecutive_hysteresis="yes"), "consecutive_hysteresis"),
        (dict(delayed_first_growth=True, growth_interval=2**31 - 1), "growth_interval"),
    ],
)
def test_bad_new_fields_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"DynamicLossScale.{field}"):
        DynamicLossScale(**kwargs)


def test_preset_with_an_unknown_field_lists_the_fields():
    with pytest.raises(ValueError, match=r"preset\('deepspeed'\): unknown field\(s\) \['hysterisis'\].*hysteresis"):
        DynamicLossScale.preset("deepspeed", hysterisis=1)
    with pytest.raises(ValueError, match="DynamicLossScale.hysteresis must be >= 1"):
        DynamicLossScale.preset("deepspeed", hysteresis=0)


def test_a_preset_table_in_a_recipe_names_the_preset_string():
    from unimp.loss_scale import loss_scale_from_dict

    with pytest.raises(ValueError, match="'preset:deepspeed'"):
        loss_scale_from_dict({"preset": "deepspeed"})


@pytest.mark.parametrize(
    "field", ["overflows_since_rescale", "steps_since_rescale", "floor_hits", "hysteresis_used"]
)
@pytest.mark.parametrize(
    "cfg", [DynamicLossScale(), StaticLossScale(8.0)], ids=["plain-dynamic", "static"]
)
def test_state_counting_what_its_config_never_counts_is_refused(cfg, field):
    # torch and JAX held such a field and TensorFlow (no variable for it under a plain rule)
    # dropped it: one state_dict, two states
    d = state_dict(cfg)
    assert set(d["state"]) >= {"hysteresis_used", "overflows_since_rescale", "steps_since_rescale", "floor_hits"}
    d["state"][field] = 3
    with pytest.raises(ValueError, match=f"'{field}'"):
        from_state_dict(d)


def test_state_with_hysteresis_out_of_range_is_refused():
    cfg = DynamicLossScale(hysteresis=2)
    d = state_dict(cfg, LossScaleState(2.0**15, 0, 1, 1, hysteresis_used=1))
    d["state"]["hysteresis_used"] = 2
    with pytest.raises(ValueError, match="hysteresis_used"):
        from_state_dict(d)


@settings(max_examples=150, deadline=None)
@given(
    events=st.lists(st.sampled_from([True, False, (True, False)]), max_size=60),
    interval=st.integers(1, 4),
    hysteresis=st.integers(1, 3),
    consecutive=st.booleans(),
    tolerance=st.sampled_from([0.0, 0.2, 0.5]),
    action=st.sampled_from(["keep", "warn", "raise"]),
    delayed=st.booleans(),
)
def test_every_reachable_state_is_valid_and_round_trips(
    events, interval, hysteresis, consecutive, tolerance, action, delayed
):
    cfg = DynamicLossScale(
        init_scale=8.0, growth_interval=interval, min_scale=1.0, max_scale=2.0**10,
        hysteresis=hysteresis, consecutive_hysteresis=consecutive, overflow_tolerance=tolerance,
        floor_action=action, delayed_first_growth=delayed,
    )
    hits = 0
    for s in simulate(cfg, events):
        assert 0 <= int(s.hysteresis_used) < hysteresis and 0 <= int(s.counter) < cfg.growth_at
        assert int(s.floor_hits) >= hits and (action != "keep" or int(s.floor_hits) == 0)
        hits = int(s.floor_hits)
        assert from_state_dict(json.loads(json.dumps(state_dict(cfg, s)))) == (cfg, s)
