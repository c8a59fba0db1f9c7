"""unimp.fp8: configs, presets against transcriptions of each implementation's source and
against Keras's and flax's real CPU runs, the quantize-dequantize rule, the portable state."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import fp8_transcriptions as tr
from unimp import fp8

INF, NAN = math.inf, math.nan

amax_values = st.one_of(
    st.sampled_from([0.0, INF, NAN, 1e-38, 1e-30, 448.0, 3e38]),
    st.floats(min_value=2.0**-20, max_value=2.0**20, width=32),
)
sequences = st.lists(amax_values, min_size=1, max_size=24)
lengths = st.integers(min_value=1, max_value=5)


def used_scales(config, amaxes, role="forward"):
    return [s for s, _, _ in fp8.simulate(config, amaxes, role)]


def same_bits(a, b):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return a.shape == b.shape and bool(np.all(a.view(np.uint32) == b.view(np.uint32)))


@settings(max_examples=60, deadline=None)
@given(sequences, lengths, st.integers(0, 3))
def test_keras_preset_matches_transcription(amaxes, L, margin):
    cfg = fp8.fp8_preset("keras", amax_history_len=L, margin=margin)
    assert same_bits(used_scales(cfg, amaxes), tr.run_keras(amaxes, L, margin=margin))


@settings(max_examples=60, deadline=None)
@given(sequences, lengths)
def test_flax_preset_matches_transcription(amaxes, L):
    cfg = fp8.fp8_preset("flax", amax_history_len=L)
    assert same_bits(used_scales(cfg, amaxes, "backward"), tr.run_flax(amaxes, L, fmax=57344.0))


@settings(max_examples=60, deadline=None)
@given(sequences, lengths, st.integers(0, 3), st.sampled_from(["max", "most_recent"]))
def test_transformer_engine_delayed_preset_matches_transcription(amaxes, L, margin, algo):
    cfg = fp8.fp8_preset("transformer_engine", amax_history_len=L, margin=margin, amax_compute_algo=algo)
    assert same_bits(used_scales(cfg, amaxes), tr.run_te_delayed(amaxes, L, margin=margin, algo=algo))


@settings(max_examples=60, deadline=None)
@given(sequences, st.booleans())
def test_current_presets_match_transcriptions(amaxes, pow2):
    te = fp8.fp8_preset("transformer_engine_current", power_of_2_scales=pow2)
    assert same_bits(used_scales(te, amaxes), tr.run_te_current(amaxes, pow2=pow2))
    ao = fp8.fp8_preset("torchao", power_of_2_scales=pow2)
    assert same_bits(used_scales(ao, amaxes), tr.run_torchao(amaxes, pow2=pow2))


def test_timing_and_edge_cases_literally():
    # L = 2; a zero at step 2 and an inf at step 3: the four timings and edge rules.
    amaxes = [4.0, 0.0, INF, 8.0, 2.0, 2.0]
    got = {n: [float(s) for s in used_scales(fp8.fp8_preset(n, **kw), amaxes)] for n, kw in [
        ("keras", {"amax_history_len": 2}), ("flax", {"amax_history_len": 2}),
        ("transformer_engine", {"amax_history_len": 2}), ("unimp_delayed", {"amax_history_len": 2}),
        ("transformer_engine_current", {}), ("torchao", {})]}
    k = float(np.float32(1) / (np.float32(1) / np.float32(112)))  # 1/(1/112): one ulp below 112
    assert k == 111.99999237060547
    assert got["keras"] == [1.0, 1.0, k, k, k, k]  # two steps late; inf keeps the scale
    assert got["flax"] == [1.0, k, k, k, k, 55.999996185302734]  # one step late, 1/(1/56)
    assert got["transformer_engine"] == [1.0, 112.0, 112.0, 112.0, 112.0, 56.0]  # inf: L steps
    assert got["unimp_delayed"] == [1.0, 112.0, 112.0, 112.0, 112.0, 56.0]  # inf keeps, exactly
    assert got["transformer_engine_current"] == [112.0, 1.0, 1.0, 56.0, 224.0, 224.0]
    assert got["torchao"] == [112.0, float(np.float32(448 / 1e-12)), 0.0, 56.0, 224.0, 224.0]
    # a NaN: TE's fmaxf skips it, unimp (like Keras and flax) keeps the scale while it is in the window
    te, ours = (fp8.fp8_preset(n, amax_history_len=2) for n in ("transformer_engine", "unimp_delayed"))
    assert [float(s) for s in used_scales(te, [4.0, NAN, 2.0, 2.0])] == [1.0, 112.0, 112.0, 224.0]
    assert [float(s) for s in used_scales(ours, [4.0, NAN, 2.0, 2.0])] == [1.0, 112.0, 112.0, 112.0]
    # a zero: TE does not record the step (the window does not advance), unimp records it
    assert [float(s) for s in used_scales(te, [4.0, 8.0, 0.0, 1.0])] == [1.0, 112.0, 56.0, 56.0]
    assert [float(s) for s in used_scales(ours, [4.0, 8.0, 0.0, 1.0])] == [1.0, 112.0, 56.0, 56.0]
    assert [float(s) for s in used_scales(te, [4.0, 8.0, 0.0, 1.0, 1.0])][-1] == 56.0
    assert [float(s) for s in used_scales(ours, [4.0, 8.0, 0.0, 1.0, 1.0])][-1] == 448.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"fp8_format": "E5M2"}, "fp8_format"), ({"amax_history_len": 0}, "amax_history_len"),
     ({"amax_compute_algo": "mean"}, "amax_compute_algo"), ({"margin": -1}, "margin"),
     ({"margin": 128}, "margin"), ({"margin": 1024}, "margin"),
     ({"rule": "deepspeed"}, "rule"), ({"amax_history_len": 16.5}, "amax_history_len"),
     ({"amax_history_len": 2**31}, "amax_history_len"), ({"amax_history_len": True}, "amax_history_len")],
)
def test_delayed_bad_input_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"DelayedScaling.{field}"):
        fp8.DelayedScaling(**kwargs)


def test_integer_fields_follow_the_loss_scale_rule():
    # the same rule as DynamicLossScale.growth_interval: a float with an integral value is that int
    assert fp8.DelayedScaling(amax_history_len=16.0, margin=2.0) == fp8.DelayedScaling(amax_history_len=16, margin=2)
    assert type(fp8.DelayedScaling(amax_history_len=16.0).amax_history_len) is int


@pytest.mark.parametrize("np_type", [np.float32, np.float64, np.int32, np.int64])
def test_config_fields_take_numpy_scalars_as_python_numbers(np_type):
    # margin=np.float32(1.0) was refused while margin=1.0 was taken
    got = fp8.DelayedScaling(margin=np_type(1), amax_history_len=np_type(16))
    assert got == fp8.DelayedScaling(margin=1, amax_history_len=16)
    assert (type(got.margin), type(got.amax_history_len)) == (int, int)
    assert fp8.CurrentScaling(power_of_2_scales=np.bool_(True)).power_of_2_scales is True
    with pytest.raises(ValueError, match="DelayedScaling.margin must be an integer"):
        fp8.DelayedScaling(margin=np_type(1) + np.float32(0.5))


def test_bad_input_lists_valid_values():
    with pytest.raises(ValueError, match=r"\['HYBRID', 'E4M3'\]"):
        fp8.CurrentScaling(fp8_format="e4m3")
    with pytest.raises(ValueError, match="Did you mean 'keras'"):
        fp8.fp8_preset("kera")
    with pytest.raises(ValueError, match="'max' with rule='keras'"):
        fp8.fp8_preset("keras", amax_compute_algo="most_recent")
    with pytest.raises(ValueError, match="power_of_2_scales"):
        fp8.CurrentScaling(power_of_2_scales="yes")


def test_formats():
    assert fp8.FP8_MAX == {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
    cfg = fp8.DelayedScaling()
    assert (cfg.dtype("forward"), cfg.dtype("backward")) == ("float8_e4m3fn", "float8_e5m2")
    assert fp8.DelayedScaling(fp8_format="E4M3").fp8_max("backward") == 448.0
    for name, m in fp8.FP8_MAX.items():
        assert float(ml_dtypes.finfo(getattr(ml_dtypes, name)).max) == m


def test_qdq_saturates_and_rounds_to_nearest_even():
    x = np.array([1.3, 500.0, -1e6, 272.0, 0.0, NAN, 1.0625], np.float32)
    got = fp8.quantize_dequantize(x, 1.0, 1.0, "float8_e4m3fn")
    # 272 is halfway between 256 and 288: even mantissa wins; 1.0625 halfway 1 / 1.125 -> 1.
    np.testing.assert_array_equal(got, np.array([1.25, 448, -448, 256, 0, NAN, 1.0], np.float32))
    got = fp8.quantize_dequantize(np.float32([1e6, 3.0]), 2.0, 0.5, "float8_e5m2")
    np.testing.assert_array_equal(got, np.float32([28672.0, 3.0]))


def test_portable_state_dict_roundtrip_through_json():
    cfg = fp8.fp8_preset("transformer_engine", amax_history_len=3)
    states = {"dense/input": fp8.simulate(cfg, [4.0, INF, NAN])[-1][2], "dense/kernel": fp8.FP8State.initial(cfg)}
    d = json.loads(json.dumps(fp8.state_dict(cfg, states)))
    assert d["format"] == "unimp.fp8/1"
    assert sorted(d["tensors"]["dense/input"]) == ["amax_history", "scale", "scale_inv"]
    cfg2, states2 = fp8.from_state_dict(d)
    assert cfg2 == cfg
    for k in states:
        for f in ("scale", "scale_inv", "amax_history"):
            assert same_bits(getattr(states2[k], f), getattr(states[k], f))


@pytest.mark.parametrize(
    ("edit", "match"),
    [({"format": "unimp.loss_scale/1"}, "'format' must be 'unimp.fp8/1'"),
     ({"extra": 1}, "exactly the keys"),
     ({"config": {"kind": "delayed", "amax_history_len": 0}}, "amax_history_len"),
     ({"tensors": {"a": {"scale": 1.0, "scale_inv": 1.0, "amax_history": [0.0]}}}, r"tensors\['a'\].*amax_history"),
     ({"tensors": {"a": {"scale": 1.0, "amax_history": [0.0] * 4}}}, "missing"),
     ({"tensors": {"a": {"scale": 0.0, "scale_inv": 1.0, "amax_history": [0.0] * 4}}}, "'scale' must be one finite number > 0"),
     ({"tensors": {"a": {"scale": -1.0, "scale_inv": 1.0, "amax_history": [0.0] * 4}}}, "'scale' must be one finite number > 0"),
     ({"tensors": {"a": {"scale": "1", "scale_inv": 1.0, "amax_history": [0.0] * 4}}}, "'scale' must be real numbers"),
     ({"tensors": {"a": {"scale": 1.0, "scale_inv": 1.0, "amax_history": [0.0, -2.0, 0.0, 0.0]}}}, ">= 0"),
     ({"tensors": {"a": {"scale": 2.0**127, "scale_inv": 2.0**-127, "amax_history": [0.0] * 4}}}, "above 2\\*\\*126"),
     ({"tensors": {"a": {"scale": 1.0, "scale_inv": 5.0, "amax_history": [0.0] * 4}}}, "'scale_inv' must be 1 / scale"),],
)
def test_from_state_dict_refuses_bad_input(edit, match):
    cfg = fp8.DelayedScaling(amax_history_len=4)
    d = {**fp8.state_dict(cfg, {"a": fp8.FP8State.initial(cfg)}), **edit}
    with pytest.raises(ValueError, match=match):
        fp8.from_state_dict(d)


def test_loaded_scale_checks_follow_the_rule():
    big = fp8.FP8State(np.float32(2.0**127), np.float32(2.0**-127), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="above 2\\*\\*126"):
        fp8.check_state(big)
    # the presets reproduce uncapped rules: Transformer Engine caps at float32's max, Keras and
    # flax not at all (fmax / amax of an amax near 2.6e-36 is 2**127; scale_inv is subnormal)
    for name in ("transformer_engine", "keras", "flax"):
        assert float(fp8.check_state(big, fp8.DelayedScaling.preset(name, amax_history_len=4)).scale) == 2.0**127
    # Keras's and flax's update overflows to (inf, 0) for a smaller amax; nobody else's does
    gone = fp8.FP8State(np.float32(INF), np.float32(0.0), np.zeros(4, np.float32))
    for name in ("keras", "flax"):
        fp8.check_state(gone, fp8.DelayedScaling.preset(name, amax_history_len=4))
    for name in ("unimp_delayed", "transformer_engine"):
        with pytest.raises(ValueError, match="'scale' must be one finite number > 0"):
            fp8.check_state(gone, fp8.fp8_preset(name, amax_history_len=4))
    # Keras and flax's double reciprocal drifts by an ulp: still one state
    s = np.float32(3.0)
    drift = np.nextafter(np.float32(1) / s, np.float32(1))
    fp8.check_state(fp8.FP8State(s, drift, np.zeros(4, np.float32)))


def test_unimp_rules_cap_the_scale_so_its_inverse_stays_normal():
    assert float(fp8.simulate(fp8.CurrentScaling(), [1e-37])[0][0]) == 2.0**126
    assert float(fp8.simulate(fp8.DelayedScaling(amax_history_len=1), [1e-37, 1.0])[1][0]) == 2.0**126
    te = fp8.fp8_preset("transformer_engine_current")
    assert float(fp8.simulate(te, [1e-37])[0][0]) == float(np.finfo(np.float32).max)


@pytest.mark.parametrize("name", list(fp8.PRESETS))
def test_every_state_a_preset_reaches_passes_the_load_check(name):
    # check_state refuses bad loads; it must accept whatever the rules themselves produce
    # a history of 1 makes the window the latest amax, so the tiny ones drive the scale up
    # (2**-126 and 1e-36: fmax / amax beyond 2**126 and beyond float32 for Keras and flax)
    long = fp8.fp8_preset(name)
    configs = [long, fp8.fp8_preset(name, amax_history_len=1)] if isinstance(long, fp8.DelayedScaling) else [long]
    for cfg in configs:
        for role in fp8.ROLES:
            s = fp8.FP8State.initial(cfg)
            for a in [1.0, 0.0, INF, NAN, 1e-40, 3e38, 1e-45, 5.0, 2.0**-126, 1e-36, 2.6e-36, 1e-37, 1.0]:
                s = fp8.step(cfg, s, a, role)[1]
                fp8.check_state(s, cfg)


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [("keras", {"bogus": 1}, r"cannot set \['bogus'\]"),
     ("torchao", {"amax_history_len": 16}, "keeps no history"),  # a TypeError from __init__ before
     ("unimp_current", {"rule": "torchao"}, r"cannot set \['rule'\]")],  # silently became torchao
)
def test_preset_overrides_are_fields_the_preset_leaves_open(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fp8.fp8_preset(name, **kwargs)


def test_quantize_dequantize_refuses_an_unknown_dtype_listing_the_dtypes():
    with pytest.raises(ValueError, match=r"dtype must be one of \['float8_e4m3fn', 'float8_e5m2'\], "
                                         r"got 'float8_e4m3'. Did you mean 'float8_e4m3fn'\?"):
        fp8.quantize_dequantize(np.ones(2, np.float32), 1.0, 1.0, "float8_e4m3")


@pytest.mark.parametrize(
    ("amaxes", "error", "match"),
    [([1.0, "abc"], TypeError, r"amaxes\[1\] must be a number .* got str 'abc'"),
     ([None], TypeError, r"amaxes\[0\] must be a number .* got NoneType None"),
     ([2.0, 3.0, -1.0], ValueError, r"amaxes\[2\] is negative \(-1.0\)"),
     ([True], TypeError, r"amaxes\[0\] must be a number")],
    ids=["str", "none", "negative", "bool"],
)
def test_simulate_refuses_an_entry_that_is_not_an_amax_naming_its_position(amaxes, error, match):
    with pytest.raises(error, match=match):
        fp8.simulate(fp8.DelayedScaling(amax_history_len=2), amaxes)


def test_simulate_takes_numpy_scalars_inf_and_nan():
    out = fp8.simulate(fp8.DelayedScaling(amax_history_len=2), np.array([4.0, np.inf, np.nan], np.float32))
    assert [float(s) for s, _, _ in out] == [1.0, 112.0, 112.0]


@pytest.mark.parametrize(
    ("name", "scale", "scale_inv"),
    [("unimp_delayed", 1.0, 1e-40), ("keras", 1.0, 1e-40), ("flax", 2.0, 2e-39),
     ("unimp_current", 4.0, 1e-42),
     ("transformer_engine", 3e38, 1e-45), ("transformer_engine", 3e38, 2e-39),
     ("transformer_engine_current", 3e38, 1e-45),
     ("torchao", 1.0, NAN), ("torchao", NAN, 5.0), ("torchao", 0.0, 5.0), ("torchao", -0.0, INF),
     ("torchao", INF, 0.0), ("torchao", 2.0, INF)],
)
def test_check_state_refuses_a_scale_inv_the_preset_cannot_make_naming_the_preset(name, scale, scale_inv):
    # a small scale_inv was not compared with 1 / scale; torchao took any pair not < 0
    cfg = fp8.fp8_preset(name)
    state = fp8.FP8State(np.float32(scale), np.float32(scale_inv), np.zeros(cfg.amax_history_len, np.float32))
    with pytest.raises(ValueError, match=f"'{name}' preset.*fp8.state_dict"):
        fp8.check_state(state, cfg)


@pytest.mark.parametrize(
    ("name", "scale"),
    [("transformer_engine", 3e38), ("transformer_engine", float(np.finfo(np.float32).max)),
     ("transformer_engine_current", 2.0**127), ("torchao", 0.0), ("torchao", NAN), ("torchao", 4.48e14)],
)
def test_check_state_takes_the_pairs_the_preset_makes(name, scale):
    # scale_inv is the update's float32(1 / scale), subnormal under Transformer Engine's cap
    cfg = fp8.fp8_preset(name)
    with np.errstate(divide="ignore"):
        inv = np.float32(1) / np.float32(scale)
    got = fp8.check_state(fp8.FP8State(np.float32(scale), inv, np.zeros(cfg.amax_history_len, np.float32)), cfg)
    assert same_bits(got.scale_inv, inv)
