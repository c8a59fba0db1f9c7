"""unimp doctor on synthetic step logs: each planted fault gives its class, step and layer."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unimp.cli import main
from unimp.doctor import CLASSES, FIXES, LR_JUMP, diagnose
from unimp.loss_scale import DynamicLossScale, StaticLossScale, update
from unimp.stats import StepStats, reference_stats
from unimp.steplog import StepLogWriter, read_steplog

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = pathlib.Path(__file__).resolve().parent / "data" / "steplogs"
CFG = DynamicLossScale(init_scale=2.0**15, growth_interval=2000, min_scale=1.0)


def nonfinite(layer, phase="backward", tensor=None):
    return {"phase": phase, "layer": layer, "tensor": tensor or f"{layer}.weight"}


def make_log(
    path, n, fault=lambda step, scale: {}, cfg=CFG, header_cfg=True, backend="torch", lr=1e-3,
    loss=1.0,
):
    """A log of ``n`` steps whose scale follows the reference rule; ``fault(step, scale)``
    returns what goes wrong at a step: ``grads_finite``/``loss_finite``/``batch_finite``
    False, an ``lr``, a ``nonfinite`` or ``stats``."""
    state = cfg.initial_state()
    with StepLogWriter(
        path, backend=backend, framework_version="x", loss_scale=cfg if header_cfg else None
    ) as w:
        for s in range(n):
            f = fault(s, float(state.scale))
            lf = f.get("loss_finite", True) and f.get("batch_finite", True) is not False
            gf = f.get("grads_finite", True) and lf
            new = update(cfg, state, gf, lf)
            w.write(
                {
                    "step": s,
                    "loss": loss if lf else None,
                    "scale": float(state.scale),
                    "applied": gf,
                    "loss_finite": lf,
                    "grads_finite": gf,
                    "grad_norm": 1.0 if gf else None,
                    "consecutive_skips": int(new.consecutive_skips),
                    "total_skips": int(new.total_skips),
                    "batch_finite": f.get("batch_finite", True),
                    "lr": f.get("lr", lr),
                    "nonfinite": f.get("nonfinite"),
                    "stats": f.get("stats"),
                }
            )
            state = new
    return read_steplog(path)


def classes(d):
    return [f.cls for f in d.findings]


def one(d, cls, spike=None):
    got = [
        f for f in d.findings if f.cls == cls and (spike is None or f.details.get("spike") is spike)
    ]
    assert len(got) == 1, classes(d)
    return got[0]


def fix_ids(f):
    return [x.id for x in f.fixes]


# ---------------------------------------------------------------- one log, one fault each


def test_a_clean_run_has_nothing_wrong(tmp_path):
    d = diagnose([make_log(tmp_path / "clean.jsonl", 300)])
    (log,) = d.logs
    assert classes(log) == ["nothing_wrong"] and log.ok and d.ok and d.fixes == []
    assert log.findings[0].step is None and "nothing wrong" in d.render()


def test_isolated_overflows_after_growth_are_normal(tmp_path):
    log = make_log(tmp_path / "iso.jsonl", 10_000, lambda s, scale: {"grads_finite": scale < 2**16})
    (d,) = diagnose([log]).logs
    f = one(d, "isolated_overflow")
    assert classes(d) == ["isolated_overflow"] and d.ok
    assert f.severity == "info" and f.fixes == [] and f.details["spike"] is False
    assert f.steps == [2000, 4001, 6002, 8003] and "normal, nothing to fix" in f.summary


def test_a_burst(tmp_path):
    log = make_log(tmp_path / "b.jsonl", 300, lambda s, _: {"grads_finite": not 150 <= s < 155})
    (d,) = diagnose([log]).logs
    f = one(d, "overflow_burst")
    assert classes(d) == ["overflow_burst"] and f.severity == "warning"
    assert f.steps == list(range(150, 155)) and fix_ids(f) == ["hysteresis", "bfloat16"]
    assert "from 32768 to 2048" in f.summary


def test_a_short_run_of_two_is_not_a_burst(tmp_path):
    log = make_log(tmp_path / "b.jsonl", 300, lambda s, _: {"grads_finite": s not in (150, 151)})
    (d,) = diagnose([log]).logs
    assert classes(d) == ["isolated_overflow"] and one(d, "isolated_overflow").details["spike"]


def test_the_initial_calibration_is_a_normal_burst(tmp_path):
    torch = DynamicLossScale.preset("torch")
    log = make_log(
        tmp_path / "c.jsonl", 300, lambda s, scale: {"grads_finite": scale <= 2**11}, cfg=torch
    )
    (d,) = diagnose([log]).logs
    f = one(d, "overflow_burst")
    assert classes(d) == ["overflow_burst"] and d.ok and f.severity == "info"
    assert f.steps == [0, 1, 2, 3, 4] and fix_ids(f) == ["initial_scale"]
    assert "init_scale=2048" in f.fixes[0].text


def test_an_lr_raised_100x_collapses_the_scale(tmp_path):
    n = 100

    def fault(s, _):
        if s < n:
            return {}
        return {
            "lr": 0.1,
            **({"grads_finite": False, "nonfinite": nonfinite("out")} if s > n else {}),
        }

    d = diagnose([make_log(tmp_path / "lr.jsonl", 200, fault)])
    (log,) = d.logs
    assert classes(log) == ["lr_change_before_overflow", "scale_collapse", "recurring_layer"]
    lr, col = one(log, "lr_change_before_overflow"), one(log, "scale_collapse")
    assert (
        lr.step == n
        and lr.steps == [n, n + 1]
        and lr.details["lr_to"] / lr.details["lr_from"] == pytest.approx(100)
    )
    assert col.step == n + 1 and col.severity == "error"
    assert col.details["floor_step"] == n + 16 and col.details["scale_to"] == 1.0
    assert col.details["overflows_at_floor"] == 199 - (n + 16) + 1
    assert col.details["bits_per_step"] == pytest.approx(1.0)
    assert "15 overflows in 15 steps" in col.summary and "never grew again" in col.summary
    assert fix_ids(col)[:3] == ["lower_lr", "bfloat16", "hysteresis"]
    assert [x["id"] for x in d.fixes][:3] == ["lower_lr", "bfloat16", "hysteresis"]
    assert "rose 100x at step 100" in d.fixes[0]["text"]
    assert "symptom of the learning-rate rise" in one(log, "recurring_layer").summary


def test_an_lr_change_at_the_first_overflow_step_counts(tmp_path):
    fault = lambda s, _: {"lr": 1.0, "grads_finite": False} if s >= 50 else {}  # noqa: E731
    (d,) = diagnose([make_log(tmp_path / "lr.jsonl", 100, fault)]).logs
    assert one(d, "lr_change_before_overflow").steps == [50]


def test_an_lr_rise_is_tied_to_the_episodes_after_it(tmp_path):
    def fault(s, _):
        out = {"lr": 1e-2 if s >= 200 else 1e-3}
        return {**out, "grads_finite": False} if 50 <= s < 54 or 205 <= s < 209 else out

    (d,) = diagnose([make_log(tmp_path / "two.jsonl", 300, fault)]).logs
    lr = one(d, "lr_change_before_overflow")
    first, second = [f for f in d.findings if f.cls == "overflow_burst"]
    assert lr.steps == [200, 205] and "the overflow burst started at step 205" in lr.summary
    assert (first.step, fix_ids(first)) == (50, ["hysteresis", "bfloat16"])
    assert (second.step, fix_ids(second)) == (205, ["lower_lr", "hysteresis", "bfloat16"])


def test_an_lr_rise_before_a_later_spike_is_found_behind_an_earlier_one(tmp_path):
    # a 10x rise at step 290 and spikes at 50 and 300: the rise was reported only when the
    # spike at 300 was the only one (the spikes were one episode, checked from step 50)
    def fault(s, _):
        out = {"lr": 1e-2 if s >= 290 else 1e-3}
        return {**out, "grads_finite": False} if s in (50, 300) else out

    (d,) = diagnose([make_log(tmp_path / "late.jsonl", 400, fault)]).logs
    lr = one(d, "lr_change_before_overflow")
    assert lr.steps == [290, 300] and "rose 10x at step 290" in lr.summary
    assert "the gradient overflows started at step 300" in lr.summary
    spike = one(d, "isolated_overflow", spike=True)
    assert spike.steps == [50, 300] and fix_ids(spike)[0] == "lower_lr"


def test_megatrons_calibration_under_hysteresis_ends_where_the_scale_settles(tmp_path):
    # Megatron-LM's preset (2**32, hysteresis 2) on gradients whose size varies: one clean step
    # at 524288, then an overflow there: the end of the same descent, not a spike (it read as
    # "settled at 524288" plus a spike) (issue 35 item 4)
    from unimp import DynamicLossScale

    size = lambda s: 0.1 * (1.0 + 0.9 * ((s * 7919) % 13) / 13)  # noqa: E731
    fault = lambda s, scale: {"grads_finite": scale * size(s) < 65504}  # noqa: E731
    log = make_log(tmp_path / "m.jsonl", 200, fault, cfg=DynamicLossScale.preset("megatron"))
    assert [r["step"] for r in log.steps if not r["grads_finite"]][-2:] == [13, 15]
    (d,) = diagnose([log]).logs
    burst = one(d, "overflow_burst")
    assert classes(d) == ["overflow_burst"] and burst.severity == "info"
    assert "settled at 262144" in burst.summary and burst.steps[-1] == 15


def test_a_spike_says_how_long_the_scale_held(tmp_path):
    fault = lambda s, _: {"grads_finite": s not in (40, 90)}  # noqa: E731
    (d,) = diagnose([make_log(tmp_path / "h.jsonl", 100, fault)]).logs
    f = one(d, "isolated_overflow", spike=True)
    assert f.steps == [40, 90] and "the scale 32768 had held for 40 steps" in f.summary


def test_a_gradual_warmup_is_not_an_lr_change(tmp_path):
    def fault(s, _):
        out = {"lr": 1e-3 * s / 60 if s < 60 else 1e-3}
        return {**out, "grads_finite": False} if 60 <= s < 64 else out

    (d,) = diagnose([make_log(tmp_path / "w.jsonl", 100, fault)]).logs
    assert classes(d) == ["overflow_burst"]
    assert LR_JUMP > 2  # a linear warmup from 0 rises 2x from its step 1 to its step 2


def test_an_inf_gradient_in_one_layer_once(tmp_path):
    fault = lambda s, _: {"grads_finite": False, "nonfinite": nonfinite("l1")} if s == 50 else {}  # noqa: E731
    d = diagnose([make_log(tmp_path / "inf.jsonl", 200, fault)])
    (log,) = d.logs
    f = one(log, "isolated_overflow", spike=True)
    assert classes(log) == ["isolated_overflow"] and not log.ok
    assert (f.step, f.layer, f.tensor, f.phase) == (50, "l1", "l1.weight", "backward")
    assert "had held for 50 steps" in f.summary and fix_ids(f) == ["check_layer"]


def test_an_inf_gradient_in_one_layer_from_a_step_on(tmp_path):
    fault = lambda s, _: {"grads_finite": False, "nonfinite": nonfinite("l1")} if s >= 50 else {}  # noqa: E731
    (d,) = diagnose([make_log(tmp_path / "inf.jsonl", 100, fault)]).logs
    assert classes(d) == ["recurring_layer", "scale_collapse"]
    rec, col = d.findings
    assert (rec.step, rec.layer) == (50, "l1") and col.layer == "l1" and col.step == 50
    assert fix_ids(rec) == ["keep_float32", "bfloat16"] and fix_ids(col)[0] == "keep_float32"
    assert "keep layer l1 in float32" in rec.fixes[0].text


def test_a_nan_batch(tmp_path):
    def fault(s, _):
        return (
            {"batch_finite": False, "nonfinite": nonfinite("l1", "forward", "l1")}
            if s == 70
            else {}
        )

    (d,) = diagnose([make_log(tmp_path / "nan.jsonl", 200, fault)]).logs
    f = one(d, "nonfinite_input")
    assert classes(d) == ["nonfinite_input"] and f.step == 70 and f.severity == "error"
    assert fix_ids(f) == ["check_data"] and "check the data at step 70" in f.fixes[0].text


def test_bad_data_ranks_first(tmp_path):
    def fault(s, _):
        if s == 30:
            return {"batch_finite": False}
        return {"grads_finite": False, "nonfinite": nonfinite("l1")} if s in (60, 61, 62) else {}

    (d,) = diagnose([make_log(tmp_path / "nan.jsonl", 100, fault)]).logs
    assert classes(d) == ["nonfinite_input", "recurring_layer", "overflow_burst"]


def test_forward_overflows_in_one_layer(tmp_path):
    def fault(s, _):
        if s >= 30 and s % 3 == 0:
            return {"loss_finite": False, "nonfinite": nonfinite("l2", "forward", "l2")}
        return {}

    d = diagnose([make_log(tmp_path / "fwd.jsonl", 120, fault)])
    (log,) = d.logs
    f = one(log, "forward_overflow")
    assert classes(log) == ["recurring_layer", "forward_overflow"]
    assert (f.step, f.layer, f.phase, f.severity) == (30, "l2", "forward", "error")
    assert f.steps == list(range(30, 120, 3)) and "loss scaling cannot fix" in f.summary
    assert fix_ids(f) == ["keep_float32", "bfloat16"] and f.fixes[0].layer == "l2"
    assert [(x["id"], x["layer"]) for x in d.fixes] == [("keep_float32", "l2"), ("bfloat16", None)]


def test_the_layer_is_read_from_the_statistics_when_the_record_does_not_name_it(tmp_path):
    acts = {
        "l1": reference_stats([1.0]),
        "l2": reference_stats([float("inf")]),
        "l3": reference_stats([float("nan")]),
    }
    stats = StepStats(0, {"l1.w": reference_stats([1.0])}, acts)
    grads = StepStats(
        0,
        {
            "l1.w": reference_stats([1.0]),
            "l2/kernel": reference_stats([float("inf")]),
            "l3.w": reference_stats([1.0]),
        },
        {},
    )

    def fault(s, _):
        if s in (10, 11):
            return {"loss_finite": False, "stats": stats}
        return {"grads_finite": False, "stats": grads} if s == 40 else {}

    (d,) = diagnose([make_log(tmp_path / "s.jsonl", 60, fault)]).logs
    assert one(d, "forward_overflow").layer == "l2"
    spike = one(d, "isolated_overflow", spike=True)
    assert (spike.layer, spike.tensor, spike.phase) == ("l2", "l2/kernel", "backward")
    assert one(d, "recurring_layer").steps == [10, 11, 40]


def test_a_scale_pinned_at_its_cap(tmp_path):
    cfg = DynamicLossScale(init_scale=2.0**10, growth_interval=10, max_scale=2.0**11)
    (d,) = diagnose([make_log(tmp_path / "cap.jsonl", 60, cfg=cfg)]).logs
    f = one(d, "scale_at_cap")
    assert classes(d) == ["scale_at_cap"] and f.severity == "info" and f.step == 10
    assert f.details["steps_at_cap"] == 50 and f.fixes == []
    tiny = StepStats(0, {"w": reference_stats([2.0**-40] * 5 + [1.0] * 95, scale=2.0**11)}, {})
    (d,) = diagnose(
        [make_log(tmp_path / "cap2.jsonl", 60, lambda s, _: {"stats": tiny}, cfg=cfg)]
    ).logs
    f = one(d, "scale_at_cap")
    assert (
        f.severity == "warning"
        and fix_ids(f) == ["raise_max_scale"]
        and f.details["max_flush"] == 0.05
    )


def test_a_collapse_without_a_floor_uses_the_1024x_rule(tmp_path):
    torch = DynamicLossScale.preset("torch")  # min_scale None: the floor is 2**-126
    (d,) = diagnose(
        [make_log(tmp_path / "t.jsonl", 300, lambda s, _: {"grads_finite": s < 100}, cfg=torch)]
    ).logs
    f = one(d, "scale_collapse")
    assert f.step == 100 and f.steps == list(range(100, 300)) and "min_scale=None" in f.summary
    assert "stop_early" in fix_ids(f)
    log = make_log(
        tmp_path / "n.jsonl",
        130,
        lambda s, _: {"grads_finite": s < 100},
        cfg=torch,
        header_cfg=False,
    )
    (d,) = diagnose([log]).logs
    f = one(d, "scale_collapse")
    assert f.step == 100 and f.details["floor"] is None and f.details["scale_to"] == 2.0**6
    assert f.severity == "warning" and "2**10 down" in f.summary


def test_a_slow_slide_is_one_collapse(tmp_path):
    (d,) = diagnose(
        [
            make_log(
                tmp_path / "s.jsonl", 3000, lambda s, _: {"grads_finite": s % 150 != 0 or s == 0}
            )
        ]
    ).logs
    f = one(d, "scale_collapse")
    assert classes(d) == ["scale_collapse"] and f.step == 150 and len(f.steps) == 19
    assert f.details["floor_step"] == 2251


def test_a_collapse_that_recovers_ends_where_the_scale_grows(tmp_path):
    cfg = DynamicLossScale(init_scale=2.0**15, growth_interval=20, min_scale=1.0)
    fault = lambda s, _: {"grads_finite": not 10 <= s < 40} if s < 100 else {}  # noqa: E731
    (d,) = diagnose([make_log(tmp_path / "r.jsonl", 100, fault, cfg=cfg)]).logs
    f = one(d, "scale_collapse")
    assert f.steps == list(range(10, 40)) and f.details["grew_again_step"] == 60


def test_a_static_scale_has_no_collapse(tmp_path):
    cfg = StaticLossScale(128.0)
    (d,) = diagnose(
        [make_log(tmp_path / "st.jsonl", 50, lambda s, _: {"grads_finite": s < 20}, cfg=cfg)]
    ).logs
    assert classes(d) == ["overflow_burst"]


def test_a_log_with_no_step(tmp_path):
    path = tmp_path / "h.jsonl"
    StepLogWriter(path, backend="jax", framework_version="0").close()
    d = diagnose([read_steplog(path)])
    assert d.logs[0].findings == [] and "nothing to diagnose" in d.render()


# ---------------------------------------------------------------- several logs


def lr_fault(start):
    def fault(s, _):
        if s < 100:
            return {}
        return {
            "lr": 0.1,
            **({"grads_finite": False, "nonfinite": nonfinite("l3")} if s >= start else {}),
        }

    return fault


def test_logs_of_one_run_that_agree(tmp_path):
    a = make_log(tmp_path / "torch.jsonl", 200, lr_fault(101), backend="torch")
    b = make_log(tmp_path / "jax.jsonl", 200, lr_fault(101), backend="jax")
    d = diagnose([a, b])
    c = d.comparison
    assert c["logs"] == ["torch", "jax"] and c["agree"]
    assert {r["class"] for r in c["rows"]} == {
        "recurring_layer",
        "lr_change_before_overflow",
        "scale_collapse",
    }
    assert "across the logs (torch, jax): they agree" in d.render()
    assert "same: scale_collapse at step 101 in l3" in d.render()


def test_logs_that_differ_say_where(tmp_path):
    a = make_log(tmp_path / "torch.jsonl", 200, lr_fault(101), backend="torch")
    b = make_log(tmp_path / "jax.jsonl", 200, lr_fault(103), backend="jax")
    c = make_log(tmp_path / "tf.jsonl", 200, backend="tensorflow")
    d = diagnose([a, b, c])
    assert not d.comparison["agree"]
    rows = {r["class"]: r for r in d.comparison["rows"]}
    assert rows["scale_collapse"]["per_log"] == {
        "torch": {"step": 101, "layer": "l3"},
        "jax": {"step": 103, "layer": "l3"},
        "tensorflow": None,
    }
    assert (
        "differ: scale_collapse: torch step 101 in l3; jax step 103 in l3; tensorflow none"
        in d.render()
    )
    assert rows["nothing_wrong"]["per_log"]["tensorflow"] == {"step": None, "layer": None}


def test_layer_paths_agree_across_spellings(tmp_path):
    def fault(layer):
        return lambda s, _: (
            {"grads_finite": False, "nonfinite": nonfinite(layer)} if s == 20 else {}
        )

    a = make_log(tmp_path / "a.jsonl", 40, fault("l1"), backend="torch")
    b = make_log(tmp_path / "b.jsonl", 40, fault("model/l1"), backend="tensorflow")
    c = make_log(tmp_path / "c.jsonl", 40, fault("l2"), backend="jax")
    assert diagnose([a, b]).comparison["agree"]
    assert not diagnose([a, b, c]).comparison["agree"]


def test_normal_overflows_agree_by_presence(tmp_path):
    a = make_log(
        tmp_path / "a.jsonl", 4100, lambda s, scale: {"grads_finite": scale < 2**16 or bool(s % 2)}
    )
    b = make_log(tmp_path / "b.jsonl", 4100, lambda s, scale: {"grads_finite": scale < 2**16})
    assert (
        one(diagnose([a]).logs[0], "isolated_overflow").steps
        != one(diagnose([b]).logs[0], "isolated_overflow").steps
    )
    assert diagnose([a, b]).comparison["agree"]


def test_two_logs_of_one_backend_are_named_apart(tmp_path):
    a = make_log(tmp_path / "a.jsonl", 5)
    b = make_log(tmp_path / "b.jsonl", 5)
    assert diagnose([a, b]).comparison["logs"] == ["torch (a.jsonl)", "torch (b.jsonl)"]
    assert diagnose([a, a]).comparison["logs"] == ["torch (a.jsonl) #1", "torch (a.jsonl) #2"]
    with pytest.raises(ValueError, match="no step log to diagnose"):
        diagnose([])


# ---------------------------------------------------------------- JSON and the command line


def test_the_json_form(tmp_path):
    d = diagnose([read_steplog(DATA / "v1_lr_collapse.jsonl")])
    out = json.loads(json.dumps(d.to_dict()))
    assert out["format"] == "unimp.doctor/1" and out["ok"] is False and out["comparison"] is None
    log = out["logs"][0]
    assert log["name"] == "lr raised 100x at step 20" and log["ended"] and log["steps"] == 40
    got = [(f["class"], f["step"], f["layer"]) for f in log["findings"]]
    assert got == [
        ("lr_change_before_overflow", 20, None),
        ("scale_collapse", 21, "out"),
        ("recurring_layer", 21, "out"),
    ]
    for f in log["findings"]:
        assert f["class"] in CLASSES and f["count"] == len(f["steps"])
        assert all(x["id"] in FIXES for x in f["fixes"])
    assert out["fixes"][0]["id"] == "lower_lr" and out["fixes"][0]["for"] == [
        "lr_change_before_overflow",
        "scale_collapse",
    ]


def test_cli_doctor_text_and_json(tmp_path, capfd):
    path = str(DATA / "v1_lr_collapse.jsonl")
    assert main(["doctor", path]) == 0
    out, err = capfd.readouterr()
    assert (
        "scale_collapse at step 21 in out" in out
        and "fixes, most likely first:" in out
        and err == ""
    )
    clean = make_log(tmp_path / "clean.jsonl", 10)
    assert main(["doctor", path, clean.path, "--json"]) == 0
    data = json.loads(capfd.readouterr().out)
    assert [d["name"] for d in data["logs"]] == ["lr raised 100x at step 20", "torch"]
    assert data["comparison"]["agree"] is False


def test_cli_doctor_warns_and_diagnoses_a_cut_off_log(tmp_path, capfd):
    log = make_log(tmp_path / "cut.jsonl", 50, lambda s, _: {"grads_finite": s < 30})
    data = pathlib.Path(log.path).read_bytes().splitlines(keepends=True)
    pathlib.Path(log.path).write_bytes(b"".join(data[:-2]) + data[-2][:40])  # no end, last cut
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the command prints its warnings, it does not warn
        assert main(["doctor", log.path]) == 0
    out, err = capfd.readouterr()
    lines = err.splitlines()
    assert len(lines) == 2 and all(x.startswith("unimp doctor: warning: ") for x in lines)
    assert "line 51 is cut off" in lines[0] and "no end line" in lines[1]
    assert "scale_collapse at step 30" in out and "NOT closed" in out


_HEAD = '{"format": "unimp.steplog/1", "kind": "run", "backend": "torch"}\n'


def _step_line(**raw: str) -> str:
    """A step record line of step 0, its values in ``raw`` written as they are (JSON text)."""
    vals = {"step": "0", "loss": "0.5", "scale": "1024.0", "applied": "true"}
    vals |= {"loss_finite": "true", "grads_finite": "true", "grad_norm": "null", "lr": "0.1"}
    vals |= {"consecutive_skips": "0", "total_skips": "0", **raw}
    body = ", ".join(f'"{k}": {v}' for k, v in vals.items())
    return f'{{"format": "unimp.steplog/1", "kind": "step", {body}}}\n'


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "no such file"),
        ("", "the file is empty"),
        ('{"format": "unimp.steplog/9", "kind": "run", "backend": "torch"}\n', "upgrade unimp"),
        (
            '{"format": "unimp.steplog/1", "kind": "run", "backend": "torch"}\n{oops\n{"a": 1}\n',
            "line 2 is not a JSON object",
        ),
        (_HEAD + _step_line(loss="1" + "0" * 400), "line 2: 'loss' must be a number within float64"),
        (_HEAD + _step_line(scale="1" + "0" * 400), "line 2: 'scale' must be a number within"),
        (_HEAD + _step_line(lr="1" + "0" * 400), "line 2: 'lr' must be a number within float64"),
        # Python >= 3.11 refuses > 4300 digits while parsing, 3.10 reads them: both name line 2
        (_HEAD + _step_line(loss="1" + "0" * 5000), "line 2"),
        (_HEAD + "[" * 100_000 + "]" * 100_000 + "\n", "line 2 is not a readable JSON object"),
        (_HEAD.replace('"torch"', '"torch", "label": {"a": 1}'), "line 1: the run header's 'label'"),
        (_HEAD.replace('"torch"', '"torch", "label": 5'), "'label' must be a string or null"),
    ],
    ids=[
        *("missing", "empty", "unknown-version", "malformed-middle", "huge-int-loss"),
        *("huge-int-scale", "huge-int-lr", "int-past-4300-digits", "deep-nesting"),
        *("label-dict", "label-int"),
    ],
)
def test_cli_doctor_bad_input_is_one_line_and_exit_2(tmp_path, capfd, content, match):
    path = tmp_path / "run.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(["doctor", str(path)]) == 2
    out, err = capfd.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"unimp doctor: error: {path}")
    assert match in err and "Traceback" not in err


def test_cli_doctor_console_exit_codes(tmp_path):
    run = [sys.executable, "-m", "unimp.cli", "doctor"]
    out = subprocess.run(
        [*run, str(tmp_path / "none.jsonl")], capture_output=True, text=True, cwd=ROOT
    )
    assert (
        out.returncode == 2
        and out.stderr.startswith("unimp doctor: error: ")
        and "Traceback" not in out.stderr
    )
    out = subprocess.run(run, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and "the following arguments are required: LOG" in out.stderr


# ---------------------------------------------------------------- robustness


flags = st.lists(
    st.tuples(
        st.booleans(),
        st.booleans(),
        st.sampled_from([True, True, True, False, None]),
        st.sampled_from([1e-3, 1e-3, 0.5]),
    ),
    min_size=1,
    max_size=80,
)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=flags, floor=st.sampled_from([1.0, None]), interval=st.sampled_from([1, 3, 2000]))
def test_any_log_is_diagnosed_without_error(tmp_path, steps, floor, interval):
    cfg = DynamicLossScale(
        init_scale=2.0**8, growth_interval=interval, min_scale=floor, max_scale=2.0**10
    )
    layers = ["l1", "l2"]

    def fault(s, _):
        gf, lf, bf, lr = steps[s]
        return {
            "grads_finite": gf,
            "loss_finite": lf,
            "batch_finite": bf,
            "lr": lr,
            "nonfinite": None if gf and lf else nonfinite(layers[s % 2]),
        }

    d = diagnose([make_log(tmp_path / "p.jsonl", len(steps), fault, cfg=cfg)])
    (log,) = d.logs
    assert log.findings and json.dumps(d.to_dict()) and d.render()
    for f in log.findings:
        assert f.cls in CLASSES and all(x.id in FIXES for x in f.fixes)
        assert f.steps == sorted(set(f.steps)) and all(0 <= s < len(steps) for s in f.steps)
    ranks = [(f.severity == "info") for f in log.findings]
    assert ranks == sorted(ranks)


def test_doctests():
    import doctest

    import unimp.doctor

    result = doctest.testmod(unimp.doctor, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_logs_that_are_not_one_run_are_said_to_be(tmp_path, capsys):
    a = make_log(tmp_path / "a.jsonl", 20, backend="torch")
    b = make_log(tmp_path / "b.jsonl", 20, backend="jax", loss=1.02)  # within 5 %: one run
    assert diagnose([a, b]).comparison["mismatch"] == []
    c = make_log(tmp_path / "c.jsonl", 12, backend="tensorflow", loss=2.0)
    d = make_log(tmp_path / "d.jsonl", 20, backend="jax", cfg=CFG.replace(growth_interval=7))
    mismatch = diagnose([a, c, d]).comparison["mismatch"]
    assert mismatch == [
        "tensorflow has 12 steps, torch 20",
        "step 0's loss is 2 in tensorflow and 1 in torch (other weights or another batch)",
        "jax and torch have different loss-scale configs",
    ]
    assert main(["doctor", str(tmp_path / "a.jsonl"), str(tmp_path / "c.jsonl")]) == 0
    assert "warning: these logs may not be one run: tensorflow has 12 steps" in capsys.readouterr().out


def test_hysteresis_fix_names_the_field_that_exists():
    # the text called a gentler backoff_factor "what DeepSpeed calls hysteresis"; DeepSpeed's
    # hysteresis (DynamicLossScale(hysteresis=)) is the number of overflows per backoff
    from unimp.doctor.advice import _HYST

    assert "hysteresis=2" in _HYST and "calls it hysteresis" not in _HYST


def test_a_burst_at_a_static_scale_says_it_never_backs_off_and_names_the_scale(tmp_path):
    # the fresh-user trial: `--loss-scale static:1e9` read "the scale fell from 1e+09 to 1e+09"
    # and suggested only float32 layers and bfloat16, never the scale itself
    cfg = StaticLossScale(1e9)
    log = make_log(tmp_path / "static.jsonl", 40, lambda s, sc: {"grads_finite": not 20 <= s < 30}, cfg=cfg)
    (d,) = diagnose([log]).logs
    f = one(d, "overflow_burst")
    assert f.summary.startswith("10 gradient overflows in a row from step 20: at the static loss scale 1e+09, which never backs off")
    assert fix_ids(f)[0] == "dynamic_scale" and "below 1e+09" in f.fixes[0].text
