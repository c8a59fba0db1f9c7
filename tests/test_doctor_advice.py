"""unimp doctor's fixes follow the run's config: what the header's loss-scale config and recipe
already have is never suggested, the next step is (or nothing); the header's recipe is read
the way Recipe.from_dict / get_recipe read it."""

from __future__ import annotations

import pytest

from unimp.cli import main
from unimp.doctor import diagnose
from unimp.doctor.advice import Advice
from unimp.loss_scale import DynamicLossScale, StaticLossScale, update
from unimp.steplog import StepLogWarning, StepLogWriter, read_steplog

F16 = DynamicLossScale(init_scale=2.0**15, growth_interval=2000, min_scale=1.0)


def make_log(path, n, overflow, cfg=F16, loss_scale="cfg", recipe=None, layer=None):
    """``n`` steps whose scale follows the reference rule for ``cfg``; ``overflow(step)`` says
    where the gradients are not finite (``layer`` named there). The header holds
    ``loss_scale`` (``cfg`` by default) and ``recipe`` as given."""
    state = cfg.initial_state()
    header = cfg if loss_scale == "cfg" else loss_scale
    with StepLogWriter(
        path, backend="torch", framework_version="x", loss_scale=header, recipe=recipe
    ) as w:
        for s in range(n):
            gf = not overflow(s)
            new = update(cfg, state, gf, True)
            w.write(
                {
                    "step": s,
                    "loss": 1.0,
                    "scale": float(state.scale),
                    "applied": gf,
                    "loss_finite": True,
                    "grads_finite": gf,
                    "grad_norm": 1.0 if gf else None,
                    "consecutive_skips": int(new.consecutive_skips),
                    "total_skips": int(new.total_skips),
                    "nonfinite": None
                    if gf or layer is None
                    else {"phase": "backward", "layer": layer, "tensor": f"{layer}.w"},
                }
            )
            state = new
    return read_steplog(path)


def finding(log, cls):
    (d,) = diagnose([log]).logs
    (f,) = [f for f in d.findings if f.cls == cls]
    return f


def fixes(f):
    return {x.id: x.text for x in f.fixes}


def burst(s):
    return 20 <= s < 24


def test_a_burst_under_the_deepspeed_preset_is_not_told_hysteresis_2(tmp_path):
    # the reviewer's ds_burst.jsonl: hysteresis is already 2; the next step is the backoff
    ds = DynamicLossScale.preset("deepspeed", growth_interval=50)
    f = finding(make_log(tmp_path / "ds.jsonl", 44, burst, cfg=ds), "overflow_burst")
    text = fixes(f)["hysteresis"]
    assert "hysteresis=2 (" not in text and "already has hysteresis=2" in text
    assert "backoff_factor nearer 1 (now 0.5; e.g. 0.8)" in text


def test_a_burst_under_the_default_config_is_told_both(tmp_path):
    f = finding(make_log(tmp_path / "d.jsonl", 44, burst), "overflow_burst")
    text = fixes(f)["hysteresis"]
    assert "backoff_factor nearer 1 (now 0.5; e.g. 0.8)" in text and ", or hysteresis=2 (" in text
    assert "already" not in text


def test_a_config_with_every_gentle_knob_turned_gets_no_gentler_backoff(tmp_path):
    cfg = DynamicLossScale(init_scale=2.0**15, backoff_factor=0.8, hysteresis=2)
    f = finding(make_log(tmp_path / "g.jsonl", 44, lambda s: 20 <= s < 30, cfg=cfg), "overflow_burst")
    assert list(fixes(f)) == ["bfloat16"]


def test_a_static_scale_is_not_told_to_back_off_more_gently(tmp_path):
    cfg = StaticLossScale(128.0)
    f = finding(make_log(tmp_path / "st.jsonl", 44, burst, cfg=cfg), "overflow_burst")
    assert list(fixes(f)) == ["dynamic_scale", "bfloat16"]  # the scale itself first, no gentler backoff


def test_an_unknown_config_gets_the_generic_advice(tmp_path):
    f = finding(make_log(tmp_path / "u.jsonl", 44, burst, loss_scale=None), "overflow_burst")
    assert "hysteresis=2 (" in fixes(f)["hysteresis"] and "now" not in fixes(f)["hysteresis"]


def test_a_slide_under_hysteresis_2_is_told_consecutive_hysteresis(tmp_path):
    # DeepSpeed's rule without consecutive_hysteresis refills the hysteresis only when the
    # scale grows: overflows with clean steps between them each back off; with it they do not
    cfg = DynamicLossScale(init_scale=2.0**15, hysteresis=2, min_scale=1.0)
    log = make_log(tmp_path / "sl.jsonl", 80, lambda s: s >= 10 and s % 2 == 0, cfg=cfg)
    f = finding(log, "scale_collapse")
    assert "consecutive_hysteresis=True" in fixes(f)["hysteresis"]
    cfg = cfg.replace(consecutive_hysteresis=True)  # the advice taken: no collapse
    log = make_log(tmp_path / "sl2.jsonl", 80, lambda s: s >= 10 and s % 2 == 0, cfg=cfg)
    (d,) = diagnose([log]).logs
    assert "scale_collapse" not in [f.cls for f in d.findings]
    # two overflows per clean step still collapse it; what it has is not suggested again
    log = make_log(tmp_path / "sl3.jsonl", 150, lambda s: s >= 10 and s % 3 != 0, cfg=cfg)
    text = fixes(finding(log, "scale_collapse"))["hysteresis"]
    assert "consecutive_hysteresis=True (" not in text
    assert "already has hysteresis=2, consecutive_hysteresis=True" in text


@pytest.mark.parametrize(
    "changes, stop",
    [
        ({}, "set max_consecutive_skips (e.g. 100)"),
        ({"max_consecutive_skips": 500}, "lower max_consecutive_skips (now 500; e.g. 100)"),
        ({"max_consecutive_skips": 50}, None),
        ({"floor_action": "raise"}, None),
    ],
    ids=["unset", "set-high", "set-low", "floor-raises"],
)
def test_stopping_at_the_floor_is_suggested_only_where_the_config_does_not(
    tmp_path, changes, stop
):
    cfg = F16.replace(**changes)
    f = finding(make_log(tmp_path / "f.jsonl", 60, lambda s: s >= 5, cfg=cfg), "scale_collapse")
    assert f.details["overflows_at_floor"] >= 10
    assert fixes(f).get("stop_early", "").split(" so ")[0] == (stop or "")


def test_a_bfloat16_run_is_not_told_to_use_bfloat16(tmp_path):
    path = tmp_path / "bf.jsonl"
    log = make_log(path, 44, lambda s: 20 <= s < 24 or s == 30, recipe="mixed_bfloat16", layer="l1")
    (d,) = diagnose([log]).logs
    assert d.findings and not any(x.id == "bfloat16" for f in d.findings for x in f.fixes)
    keep = [x for f in d.findings for x in f.fixes if x.id == "keep_float32"]
    assert keep and all("bfloat16 policy" in x.text and "or use" not in x.text for x in keep)


def test_a_float32_run_is_not_told_to_keep_a_layer_in_float32():
    advice = Advice(F16.to_dict(), {"policy": "float32", "loss_scale": {"kind": "none"}})
    assert advice.keep("l1") == [] and advice.bfloat16() == []


@pytest.mark.parametrize(
    "recipe", [{"policy": "mixed_float16"}, "mixed_float16"], ids=["dict-without-loss_scale", "name"]
)
def test_the_header_recipe_gives_the_floor(tmp_path, recipe):
    # the reviewer's rdict.jsonl / rstr.jsonl: the recipe's default loss scale (dynamic,
    # min_scale 1) is the config, so the collapse is told at its floor, not as 2**10 down
    log = make_log(tmp_path / "r.jsonl", 30, lambda s: s >= 3, loss_scale=None, recipe=recipe)
    f = finding(log, "scale_collapse")
    assert "it fell to 1 (its floor) at step 18" in f.summary and f.severity == "error"
    assert "2**10 down" not in f.summary


def test_an_unreadable_header_recipe_is_a_warning_line(tmp_path, capfd):
    path = tmp_path / "r.jsonl"
    with pytest.warns(StepLogWarning, match="the recipe"):
        make_log(path, 30, lambda s: s >= 3, loss_scale=None, recipe={"policy": "bogus"})
    assert main(["doctor", str(path)]) == 0
    out, err = capfd.readouterr()
    assert (
        f"unimp doctor: warning: {path}: line 1: the recipe {{'policy': 'bogus'}} is not readable"
        in err
    )
    assert "fell to 32 (2**10 down)" in out


@pytest.mark.parametrize(
    "old, new, match",
    [
        ('"grad_norm": 1.0', '"grad_norm": -2.0', "line 2: 'grad_norm' must be >= 0 or null"),
        ('"steps": 2,', '"steps": "two",', "line 4: the end line's 'steps' must be an int >= 0"),
        ('"steps": 2,', '"steps": -1,', "line 4: the end line's 'steps' must be an int >= 0"),
    ],
    ids=["negative-grad-norm", "end-steps-string", "end-steps-negative"],
)
def test_cli_doctor_refuses_impossible_values_with_exit_2(tmp_path, capfd, old, new, match):
    path = tmp_path / "bad.jsonl"
    make_log(path, 2, lambda s: False)
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    assert main(["doctor", str(path)]) == 2
    out, err = capfd.readouterr()
    assert out == "" and err == f"unimp doctor: error: {path}: {match}" + err.split(match)[1]
    assert err.count("\n") == 1 and "Traceback" not in err
