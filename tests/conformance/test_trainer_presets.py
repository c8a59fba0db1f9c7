"""The large-scale trainers' rules (hysteresis, overflow tolerance, floor action, DeepSpeed's growth
timing) run on every backend's device-side update exactly as the reference, the format-2 state
round-trips through every backend, and a loaded state's config is adopted."""

from __future__ import annotations

import kits
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from unimp import DynamicLossScale, LossScaleError, get_recipe, simulate, state_dict, update
from unimp.loss_scale import LossScaleState

INF = float("inf")

PRESET_CONFIGS = {
    "deepspeed": DynamicLossScale.preset("deepspeed", init_scale=8.0, growth_interval=2),
    "deepspeed-consecutive": DynamicLossScale.preset(
        "deepspeed", init_scale=8.0, growth_interval=1, hysteresis=3, consecutive_hysteresis=True
    ),
    "megatron": DynamicLossScale.preset("megatron", init_scale=8.0, growth_interval=2, hysteresis=3),
    "fairseq": DynamicLossScale.preset("fairseq", init_scale=8.0, growth_interval=2, overflow_tolerance=0.25),
    "warn-at-floor": DynamicLossScale(init_scale=4.0, growth_interval=3, min_scale=1.0, floor_action="warn"),
}
EVENTS = {"clean": (True, True), "inf-grad": (False, True), "inf-loss": (True, False)}
_BATCHES = {"clean": kits.batch(0), "inf-grad": kits.batch(0, poison=INF), "inf-loss": kits.batch(0, x_scale=INF)}
_runs: dict[tuple[str, str], kits.Run] = {}


def _run(backend: str, name: str) -> kits.Run:
    if (backend, name) not in _runs:
        recipe = get_recipe("mixed_float16", loss_scale=PRESET_CONFIGS[name])
        _runs[backend, name] = kits.build(backend, recipe, lr=0.0)
    return _runs[backend, name]


@pytest.mark.parametrize("config_name", list(PRESET_CONFIGS))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=st.lists(st.sampled_from(list(EVENTS)), min_size=1, max_size=20))
def test_device_update_matches_reference(backend, config_name, events):
    cfg = PRESET_CONFIGS[config_name]
    flags = [EVENTS[ev] for ev in events]
    assume(all(float(s.scale) <= 2.0**16 for s in simulate(cfg, flags)))  # the clean batch stays clean
    run = _run(backend, config_name)
    run.load_state_dict(state_dict(cfg))
    expected = cfg.initial_state()
    for ev in events:
        result = run.step(_BATCHES[ev])
        expected = update(cfg, expected, *EVENTS[ev])
        assert run.loss_scale_state() == expected, (backend, config_name, events)
        if int(expected.floor_hits) and cfg.floor_action == "raise":
            with pytest.raises(LossScaleError, match="at its floor"):
                result.applied  # noqa: B018 - the first read checks the state
            return
        if int(expected.floor_hits):
            with pytest.warns(UserWarning, match="at its floor"):
                result.applied  # noqa: B018
            return
        assert result.applied == all(EVENTS[ev])


def test_deepspeed_stops_on_the_step_deepspeed_stops(backend):
    # init 2, floor 1, hysteresis 2: overflow 1 spends the hysteresis, 2 halves to 1, 3 hits it
    cfg = DynamicLossScale.preset("deepspeed", init_scale=2.0)
    run = kits.build(backend, get_recipe("mixed_float16", loss_scale=cfg), lr=0.0)
    first, second = run.step(_BATCHES["inf-grad"]), run.step(_BATCHES["inf-grad"])
    assert (first.scale, second.scale) == (2.0, 2.0)
    third = run.step(_BATCHES["inf-grad"])
    with pytest.raises(LossScaleError, match="floor hit 1, reported by step 2"):
        third.scale  # noqa: B018


def test_format_2_state_round_trips_through_the_backend(backend):
    cfg = DynamicLossScale.preset("fairseq", init_scale=64.0, growth_interval=3, overflow_tolerance=0.4)
    saved = LossScaleState(32.0, 1, 1, 3, 0, 1, 2, 0)
    run = kits.build(backend, get_recipe("mixed_float16", loss_scale=cfg), lr=0.0)
    run.load_state_dict(state_dict(cfg, saved))
    assert run.state_dict() == state_dict(cfg, saved)  # every backend writes the same dict
    run.step(_BATCHES["inf-grad"])  # 2 overflows / 3 steps since the rescale >= 0.4: back off
    assert run.state_dict() == state_dict(cfg, update(cfg, saved, False))
    assert float(run.loss_scale_state().scale) == 16.0


def test_a_state_saved_with_hysteresis_brings_its_config(backend):
    # the documented adoption rule: load_state_dict takes the saved config, hysteresis included
    run = kits.build(backend, get_recipe("mixed_float16", loss_scale=DynamicLossScale(growth_interval=3)), lr=0.0)
    run.step(_BATCHES["clean"])
    saved_cfg = DynamicLossScale.preset("megatron", init_scale=2.0**10, growth_interval=3)
    saved = simulate(saved_cfg, [False])[-1]  # one overflow absorbed by the hysteresis
    run.load_state_dict(state_dict(saved_cfg, saved))
    assert [run.step(_BATCHES["inf-grad"]).scale for _ in range(2)] == [2.0**10, 2.0**9]
    assert run.state_dict()["config"] == saved_cfg.to_dict()


def test_a_floor_hit_warns_at_one_result_read_in_every_backend(backend):
    # floor_hits counts every hit since the start: reading each step's result must warn once
    # per new hit (the run's FloorWatch), not again at every later read, as Keras's
    # LossScaleCheck does under model.fit
    import warnings

    from unimp.loss_scale import LossScaleFloorWarning

    cfg = DynamicLossScale(init_scale=2.0, growth_interval=3, min_scale=1.0, floor_action="warn")
    run = kits.build(backend, get_recipe("mixed_float16", loss_scale=cfg), lr=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for ev in ["inf-grad", "inf-grad", "inf-grad", "clean", "clean", "inf-grad"]:
            run.step(_BATCHES[ev]).applied  # noqa: B018 - the first read checks the state
    hits = [str(w.message) for w in caught if issubclass(w.category, LossScaleFloorWarning)]
    # 2 -> 1 on the first overflow; the second, third and sixth hit the floor
    assert [h.split("(floor hit ")[1].split(",")[0] for h in hits] == ["1", "2", "3"]
