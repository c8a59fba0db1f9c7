"""The step log (unimp.steplog): writer, reader, the format's rules and every bad input."""

from __future__ import annotations

import ast
import gc
import io
import json
import math
import pathlib
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unimp
from unimp.loss_scale import DynamicLossScale, state_dict
from unimp.stats import StepStats, reference_stats
from unimp.step import STEP_FIELDS
from unimp.steplog import (
    STEP_KEYS,
    STEPLOG_FORMAT,
    StepLogWarning,
    StepLogWriter,
    read_steplog,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = pathlib.Path(__file__).resolve().parent / "data" / "steplogs"


def record(step: int, **over):
    rec = {
        "step": step,
        "loss": 0.5,
        "scale": 32768.0,
        "applied": True,
        "loss_finite": True,
        "grads_finite": True,
        "grad_norm": 1.25,
        "consecutive_skips": 0,
        "total_skips": 0,
    }
    rec.update(over)
    return rec


def write_log(path, n=3, close=True, **kw):
    w = StepLogWriter(path, backend="torch", framework_version="2.4.0", **kw)
    for i in range(n):
        w.write(record(i))
    if close:
        w.close()
    return w


def lines(path):
    return [json.loads(x) for x in pathlib.Path(path).read_text().splitlines()]


def read_quiet(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StepLogWarning)
        return read_steplog(path)


# ---------------------------------------------------------------- writing


def test_step_keys_follow_step_fields():
    assert STEP_KEYS[1:9] == STEP_FIELDS


def test_round_trip_with_header(tmp_path):
    cfg = DynamicLossScale(init_scale=2.0**15, min_scale=1.0)
    path = tmp_path / "run.jsonl"
    with StepLogWriter(
        path,
        backend="jax",
        framework_version="0.4.30",
        recipe=unimp.get_recipe("mixed_float16"),
        loss_scale=cfg,
        label="seed 0",
    ) as w:
        w.write(record(0, lr=1e-3, batch_finite=True))
        w.write(
            record(
                1,
                loss=np.float32(0.25),
                scale=np.float32(16384.0),
                applied=np.bool_(False),
                grads_finite=False,
                grad_norm=None,
                consecutive_skips=np.int32(1),
                total_skips=np.int64(1),
                nonfinite={"phase": "backward", "layer": "l1", "tensor": "l1/kernel"},
            )
        )
    log = read_steplog(path)
    assert log.ended and log.warnings == [] and log.end["steps"] == 2
    assert log.backend == "jax" and log.label == "seed 0"
    assert log.run["unimp"] == unimp.__version__ and log.run["framework_version"] == "0.4.30"
    assert log.run["recipe"] == unimp.get_recipe("mixed_float16").to_dict()
    assert log.loss_scale == cfg.to_dict()
    assert log.run["started"].endswith("+00:00")
    assert [list(r) for r in log.steps] == [["format", "kind", *STEP_KEYS]] * 2
    r0, r1 = log.steps
    assert r0["lr"] == 1e-3 and r0["batch_finite"] is True and r0["nonfinite"] is None
    assert r1 == {
        "format": STEPLOG_FORMAT,
        "kind": "step",
        **record(1, loss=0.25, scale=16384.0, applied=False, grads_finite=False, grad_norm=None),
        "consecutive_skips": 1,
        "total_skips": 1,
        "batch_finite": None,
        "lr": None,
        "nonfinite": {"phase": "backward", "layer": "l1", "tensor": "l1/kernel"},
        "params_finite": None,
        "stats": None,
    }
    assert all(x["format"] == STEPLOG_FORMAT for x in lines(path))


def test_loss_scale_from_a_state_dict_or_a_name(tmp_path):
    cfg = DynamicLossScale.preset("torch")
    w = StepLogWriter(io.StringIO(), backend="t", framework_version="1", loss_scale=state_dict(cfg))
    assert json.loads(w._sink.file.getvalue())["loss_scale"] == cfg.to_dict()
    buf = io.StringIO()
    StepLogWriter(buf, backend="t", framework_version="1", loss_scale="dynamic", recipe="bf16")
    head = json.loads(buf.getvalue())
    assert head["loss_scale"]["kind"] == "dynamic" and head["recipe"]["policy"]


def test_nonfinite_floats_are_written_as_null(tmp_path):
    path = tmp_path / "nan.jsonl"
    stats = StepStats(3, {"w": reference_stats([0.0, np.inf])}, {"l1": reference_stats([1.0])})
    with StepLogWriter(path, backend="torch", framework_version="2") as w:
        w.write(
            record(
                3, loss=float("nan"), loss_finite=False, grad_norm=math.inf, lr=np.nan, stats=stats,
                applied=False, consecutive_skips=1, total_skips=1,
            )
        )
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text

    def strict(name):
        raise AssertionError(f"{name} is not JSON")

    rows = [json.loads(x, parse_constant=strict) for x in text.splitlines()]
    step = rows[1]
    assert step["loss"] is None and step["grad_norm"] is None and step["lr"] is None
    grad = step["stats"]["gradients"]["w"]
    assert grad["amax"] is None and grad["counts"]["nonfinite"] == 1
    assert step["stats"]["activations"]["l1"]["min_nonzero"] == 1.0
    assert step["stats"]["gradients"]["w"]["headroom"]["float16"] is None  # -inf
    assert read_steplog(path).steps[0]["stats"]["step"] == 3


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"step": -1}, "'step' must be an int >= 0"),
        ({"step": True}, "'step' must be an int"),
        ({"step": 1.5}, "'step' must be an int"),
        ({"loss": "0.5"}, "'loss' must be a number or null"),
        ({"scale": None}, "'scale' must be a number"),
        ({"scale": math.inf}, "'scale' must be finite"),
        ({"scale": 0.0}, "'scale' must be > 0"),
        ({"applied": 1}, "'applied' must be true or false"),
        ({"batch_finite": "yes"}, "'batch_finite' must be true or false or null"),
        ({"consecutive_skips": -2}, "'consecutive_skips' must be an int >= 0"),
        ({"lr": [1e-3]}, "'lr' must be a number"),
        ({"nonfinite": {"phase": "up", "layer": "l1", "tensor": "w"}}, "nonfinite.phase"),
        ({"nonfinite": {"phase": "forward", "layer": "l1"}}, "'nonfinite' must be null or"),
        ({"nonfinite": {"phase": "forward", "layer": "", "tensor": "x"}}, "nonfinite.layer"),
        ({"stats": 3}, "'stats' must be null or StepStats"),
        ({"stats": {"gradients": [], "activations": {}}}, "'stats.gradients' must map names"),
        ({"stats": {"gradients": {}, "activations": {"l1": {"amax": 1}}}}, "'stats.activations'"),
        ({"grad_norm": -2.0}, r"'grad_norm' must be >= 0 or null"),
        ({"consecutive_skips": 5, "total_skips": 2}, r"'consecutive_skips' \(5\) must not exceed"),
        ({"loss_finite": False}, "'applied' is true but 'loss_finite' is false"),
        ({"grads_finite": False}, "'applied' is true but 'grads_finite' is false"),
        ({"extra": 1}, r"unknown key\(s\) \['extra'\]"),
        ({"kind": "run"}, "'format' and 'kind'"),
    ],
)
def test_write_rejects_a_bad_record_and_writes_nothing(bad, match):
    buf = io.StringIO()
    w = StepLogWriter(buf, backend="torch", framework_version="2", flush_every=1)
    with pytest.raises(ValueError, match=match):
        w.write({**record(0), **bad})
    assert len(buf.getvalue().splitlines()) == 1 and w.steps == 0


def test_write_rejects_a_missing_key_and_steps_out_of_order():
    w = StepLogWriter(io.StringIO(), backend="torch", framework_version="2")
    rec = record(0)
    del rec["grad_norm"]
    with pytest.raises(ValueError, match=r"missing key\(s\) \['grad_norm'\]"):
        w.write(rec)
    w.write(record(5))
    with pytest.raises(ValueError, match="step 5 after step 5: records go in step order"):
        w.write(record(5))
    w.write(record(9))  # gaps are allowed (a log resumed or thinned)
    assert w.steps == 2


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"backend": ""}, "backend must be a non-empty string"),
        ({"framework_version": 2}, "framework_version must be a string"),
        ({"label": 3}, "label must be None or a string"),
        ({"flush_every": 0}, "flush_every must be an int >= 1"),
        ({"flush_every": True}, "flush_every must be an int >= 1"),
        ({"recipe": 3.0}, "recipe must be None, a Recipe or a dict"),
        ({"loss_scale": {"kind": "dynamic", "bogus": 1}}, "unknown key"),
    ],
)
def test_a_bad_argument_leaves_an_existing_file_alone(tmp_path, kw, match):
    path = tmp_path / "old.jsonl"
    path.write_text("keep me\n")
    args = {"backend": "torch", "framework_version": "2", **kw}
    with pytest.raises(ValueError, match=match):
        StepLogWriter(path, **args)
    assert path.read_text() == "keep me\n"


def test_overwrite_is_the_default_and_can_be_refused(tmp_path):
    path = tmp_path / "run.jsonl"
    write_log(path, n=5)
    write_log(path, n=2)
    assert len(read_steplog(path).steps) == 2
    before = path.read_bytes()
    with pytest.raises(FileExistsError):
        StepLogWriter(path, backend="torch", framework_version="2", overwrite=False)
    assert path.read_bytes() == before
    with pytest.raises(OSError):
        StepLogWriter(tmp_path, backend="torch", framework_version="2")  # a folder


def test_records_are_buffered_and_flushed_every_k(tmp_path):
    path = tmp_path / "run.jsonl"
    w = StepLogWriter(path, backend="torch", framework_version="2", flush_every=3)
    assert len(lines(path)) == 1  # the header is written at once
    w.write(record(0))
    w.write(record(1))
    assert len(lines(path)) == 1
    w.write(record(2))
    assert len(lines(path)) == 4
    w.write(record(3))
    w.flush()
    assert len(lines(path)) == 5
    w.close()
    w.close()  # idempotent
    assert lines(path)[-1]["kind"] == "end" and lines(path)[-1]["steps"] == 4
    assert [x["kind"] for x in lines(path)].count("end") == 1
    with pytest.raises(ValueError, match="the step log is closed"):
        w.write(record(4))
    assert w.closed and "closed" in repr(w)


def test_the_with_block_closes_the_log_on_an_exception(tmp_path):
    path = tmp_path / "run.jsonl"
    with pytest.raises(RuntimeError):
        with StepLogWriter(path, backend="torch", framework_version="2", flush_every=100) as w:
            w.write(record(0))
            w.write(record(1))
            raise RuntimeError("boom")
    log = read_steplog(path)
    assert log.ended and len(log.steps) == 2


def test_a_dropped_writer_is_flushed(tmp_path):
    path = tmp_path / "run.jsonl"
    write_log(path, n=4, close=False, flush_every=100)
    gc.collect()
    log = read_quiet(path)
    assert len(log.steps) == 4 and not log.ended


@pytest.mark.parametrize("ending", ["return", "raise"])
def test_interpreter_exit_flushes_an_unclosed_log(tmp_path, ending):
    path = tmp_path / "run.jsonl"
    script = (
        "from unimp.steplog import StepLogWriter\n"
        f"w = StepLogWriter({str(path)!r}, backend='torch', framework_version='2', flush_every=1000)\n"
        "for i in range(7):\n"
        "    w.write({'step': i, 'loss': 1.0, 'scale': 2.0, 'applied': True, 'loss_finite': True,\n"
        "             'grads_finite': True, 'grad_norm': None, 'consecutive_skips': 0,\n"
        "             'total_skips': 0})\n"
        + ("raise SystemExit('crash')\n" if ending == "raise" else "")
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == (1 if ending == "raise" else 0), out.stderr
    with pytest.warns(StepLogWarning, match="no end line: the run was not closed"):
        log = read_steplog(path)
    assert [r["step"] for r in log.steps] == list(range(7)) and not log.ended


@pytest.mark.parametrize("binary", [False, True])
def test_a_file_object_is_flushed_never_closed(binary):
    buf = io.BytesIO() if binary else io.StringIO()
    with StepLogWriter(buf, backend="torch", framework_version="2") as w:
        w.write(record(0))
    assert not buf.closed
    text = buf.getvalue().decode() if binary else buf.getvalue()
    assert [json.loads(x)["kind"] for x in text.splitlines()] == ["run", "step", "end"]


# ---------------------------------------------------------------- reading: bad input


def test_missing_folder_and_empty_files_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.jsonl: no such file; pass a step log"):
        read_steplog(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="is a folder"):
        read_steplog(tmp_path)
    for text in ("", "\n  \n"):
        (tmp_path / "empty.jsonl").write_text(text)
        with pytest.raises(ValueError, match=r"empty\.jsonl: the file is empty, not a step log"):
            read_steplog(tmp_path / "empty.jsonl")


def test_an_unknown_version_or_foreign_file_is_an_error(tmp_path):
    path = tmp_path / "run.jsonl"
    write_log(path)
    path.write_text(path.read_text().replace(STEPLOG_FORMAT, "unimp.steplog/2"))
    with pytest.raises(
        ValueError,
        match=r"line 1 has format 'unimp.steplog/2'; this unimp reads 'unimp.steplog/1'.*upgrade unimp",
    ):
        read_steplog(path)
    path.write_text('{"loss": 1.0}\n')
    with pytest.raises(ValueError, match="line 1 is not a unimp step log line"):
        read_steplog(path)
    path.write_text("step,loss\n0,1.0\n")
    with pytest.raises(ValueError, match="line 1 is not a JSON object"):
        read_steplog(path)


def test_the_first_line_must_be_the_run_header(tmp_path):
    path = tmp_path / "run.jsonl"
    write_log(path)
    text = path.read_text().splitlines()
    path.write_text("\n".join(text[1:]) + "\n")
    with pytest.raises(ValueError, match="line 1 must be the run header.*got kind 'step'"):
        read_steplog(path)
    path.write_text(text[0][:30])  # the header itself cut off
    with pytest.raises(ValueError, match="line 1 is not a JSON object"):
        read_steplog(path)


def test_a_cut_off_last_line_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "run.jsonl"
    write_log(path, n=5, close=False)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 20])  # the last record loses its end
    with pytest.warns(StepLogWarning) as caught:
        log = read_steplog(path)
    messages = [str(w.message) for w in caught]
    assert any("line 6 is cut off" in m and "skipped" in m for m in messages)
    assert log.warnings == messages and len(log.steps) == 4 and not log.ended


def test_a_cut_in_a_multibyte_character_is_a_cut_off_line(tmp_path):
    path = tmp_path / "run.jsonl"
    w = StepLogWriter(path, backend="torch", framework_version="2", label="é")
    w.write(record(0))
    w.flush()
    path.write_bytes(path.read_bytes() + '{"format": "unimp.steplog/1", "label": "é'.encode()[:-1])
    log = read_quiet(path)
    assert len(log.steps) == 1 and any("line 3 is cut off" in m for m in log.warnings)


def test_a_malformed_line_in_the_middle_is_an_error_naming_it(tmp_path):
    path = tmp_path / "run.jsonl"
    write_log(path, n=5)
    rows = path.read_text().splitlines()
    rows[3] = rows[3][:25]
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(
        ValueError, match=r"run\.jsonl: line 4 is not a JSON object \(.*\).*fix or delete the line"
    ):
        read_steplog(path)
    rows = path.read_text().splitlines()
    rows[3] = json.dumps({**json.loads(rows[2]), "step": 2, "applied": "yes"})
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError, match="line 4: 'applied' must be true or false"):
        read_steplog(path)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda rows: rows[:2] + rows[1:], "line 3: step 0 after step 0; steps go in order"),
        (lambda rows: rows + [rows[1]], "line 6 follows the end line"),
        (lambda rows: rows[:2] + [rows[0]] + rows[2:], "line 3 is a second run header"),
        (lambda rows: rows[:2] + ["[1, 2]"] + rows[2:], "line 3 is not a JSON object"),
    ],
)
def test_structure_errors_name_the_line(tmp_path, edit, match):
    path = tmp_path / "run.jsonl"
    write_log(path, n=3)
    path.write_text("\n".join(edit(path.read_text().splitlines())) + "\n")
    with pytest.raises(ValueError, match=match):
        read_steplog(path)


def test_readable_oddities_are_warnings(tmp_path):
    path = tmp_path / "run.jsonl"
    write_log(path, n=3)
    rows = path.read_text().splitlines()
    rows[1] = rows[1].replace('"loss": 0.5', '"loss": NaN')
    rows.insert(2, json.dumps({"format": STEPLOG_FORMAT, "kind": "note", "text": "hi"}))
    rows.insert(3, "")
    rows[-1] = rows[-1].replace('"steps": 3', '"steps": 4')
    path.write_text("\n".join(rows) + "\n")
    log = read_quiet(path)
    assert log.ended and len(log.steps) == 3 and log.steps[0]["loss"] is None
    text = " | ".join(log.warnings)
    assert "line 3 has kind 'note', unknown to this unimp; skipped" in text
    assert "line 2 holds NaN or Infinity" in text
    assert "the end line counts 4 steps, the log 3" in text


def test_the_loss_scale_config_is_checked_and_taken_from_the_recipe(tmp_path):
    path = tmp_path / "run.jsonl"
    StepLogWriter(path, backend="torch", framework_version="2", recipe="mixed_float16").close()
    assert read_steplog(path).loss_scale == unimp.get_recipe("mixed_float16").loss_scale.to_dict()
    head, *rest = path.read_text().splitlines()
    bad = {**json.loads(head), "recipe": None, "loss_scale": {"kind": "dynamic", "min_scale": "x"}}
    path.write_text("\n".join([json.dumps(bad), *rest]) + "\n")
    with pytest.warns(StepLogWarning, match="line 1: the loss-scale config is not readable"):
        assert read_steplog(path).loss_scale is None


def header_with(path, **changes):
    """Rewrites the header of the log at ``path`` with ``changes``."""
    head, *rest = pathlib.Path(path).read_text().splitlines()
    pathlib.Path(path).write_text("\n".join([json.dumps({**json.loads(head), **changes}), *rest]))


@pytest.mark.parametrize(
    "recipe",
    [{"policy": "mixed_float16"}, "mixed_float16", " Mixed_Float16 "],
    ids=["dict-without-loss_scale", "name", "name-spelled-loosely"],
)
def test_a_header_recipe_is_read_as_from_dict_or_get_recipe(tmp_path, recipe):
    # a recipe dict may leave loss_scale out (Recipe.from_dict: the policy's default, dynamic
    # with min_scale 1 for float16); a name is what get_recipe reads
    path = tmp_path / "run.jsonl"
    write_log(path, n=1)
    header_with(path, recipe=recipe, loss_scale=None)
    log = read_steplog(path)
    assert log.warnings == [] and log.recipe == unimp.get_recipe("mixed_float16").to_dict()
    assert log.loss_scale["kind"] == "dynamic" and log.loss_scale["min_scale"] == 1.0


def test_the_header_loss_scale_comes_before_the_recipes(tmp_path):
    path = tmp_path / "run.jsonl"
    write_log(path, n=1)
    header_with(path, recipe="mixed_float16", loss_scale="preset:deepspeed")
    log = read_steplog(path)
    assert log.loss_scale["hysteresis"] == 2
    assert log.recipe == unimp.get_recipe("mixed_float16").to_dict()


@pytest.mark.parametrize(
    "recipe, why",
    [
        ({"policy": "bogus"}, "unknown policy 'bogus'"),
        ("bogus", "unknown policy 'bogus'"),
        ({"policy": "mixed_float16", "loss_scale": {"kind": "dynamic", "min_scale": "x"}}, "min_scale"),
        ("recipe.toml", "a recipe file's name"),
        (3, "a recipe is a dict or a name, got int"),
    ],
    ids=["dict-bad-policy", "bad-name", "bad-loss_scale", "file-name", "number"],
)
def test_an_unreadable_header_recipe_is_a_warning_naming_it(tmp_path, recipe, why):
    path = tmp_path / "run.jsonl"
    write_log(path, n=1)
    header_with(path, recipe=recipe, loss_scale=None)
    with pytest.warns(StepLogWarning, match=f"line 1: the recipe {re.escape(repr(recipe))} is not"):
        log = read_steplog(path)
    assert log.recipe is None and log.loss_scale is None and why in log.warnings[0]


@pytest.mark.parametrize(
    "where, why",
    [
        ({"loss_scale": {"kind": "static", "scale": 10**400}}, "loss-scale config"),
        ({"loss_scale": 10**400}, "loss-scale config"),
        ({"loss_scale": {"kind": "dynamic", "init_scale": -(10**400)}}, "loss-scale config"),
        ({"recipe": {"policy": "mixed_float16", "loss_scale": {"kind": "dynamic", "max_scale": 10**400}}},
         "recipe"),
    ],
    ids=["static-scale", "bare-number", "init_scale", "recipe-max_scale"],
)
def test_a_header_number_past_float_range_is_a_warning_naming_the_line(tmp_path, where, why):
    # a JSON integer of 401 digits: float() raises OverflowError, read as an unreadable config
    path = tmp_path / "run.jsonl"
    write_log(path, n=1)
    header_with(path, **{"recipe": None, "loss_scale": None, **where})
    with pytest.warns(StepLogWarning, match=f"line 1: the {why}"):
        log = read_steplog(path)
    assert log.loss_scale is None and "an integer of 401 digits" in log.warnings[0]


@pytest.mark.parametrize("key", ["loss", "scale", "grad_norm", "lr"])
@pytest.mark.parametrize("sign", ["", "-"])
def test_a_step_number_past_float_range_is_an_error_naming_the_line(tmp_path, key, sign):
    path = tmp_path / "run.jsonl"
    write_log(path, n=2)
    rows = path.read_text().splitlines()
    rows[2] = re.sub(f'"{key}": [^,]+', f'"{key}": {sign}1{"0" * 400}', rows[2])
    path.write_text("\n".join(rows) + "\n")
    match = f"{re.escape(str(path))}: line 3: '{key}' must be a number within float64 range"
    with pytest.raises(ValueError, match=match):
        read_steplog(path)


@pytest.mark.parametrize("last", [False, True], ids=["middle", "last"])
def test_a_line_nested_past_the_recursion_limit_is_an_error_not_a_cut_off(tmp_path, last):
    path = tmp_path / "run.jsonl"
    write_log(path, n=2, close=not last)
    rows = path.read_text().splitlines()
    rows.insert(len(rows) if last else 2, "[" * 100_000 + "]" * 100_000)
    path.write_text("\n".join(rows) + "\n")
    n = len(rows) if last else 3
    with pytest.raises(ValueError, match=f"line {n} is not a readable JSON object \\(nested too"):
        read_quiet(path)


@pytest.mark.parametrize("label", [{"a": 1}, ["a"], 5, True], ids=str)
def test_a_label_that_is_not_a_string_is_an_error_naming_the_line(tmp_path, label):
    path = tmp_path / "run.jsonl"
    write_log(path, n=1)
    header_with(path, label=label)
    with pytest.raises(ValueError, match=r"line 1: the run header's 'label' must be a string or null"):
        read_steplog(path)


@pytest.mark.parametrize("steps", ["two", -1, 1.0, True, None], ids=str)
def test_an_end_line_whose_count_is_not_a_count_is_an_error(tmp_path, steps):
    path = tmp_path / "run.jsonl"
    write_log(path, n=1)
    rows = path.read_text().splitlines()
    rows[-1] = json.dumps({**json.loads(rows[-1]), "steps": steps})
    path.write_text("\n".join(rows) + "\n")
    match = f"{re.escape(str(path))}: line 3: the end line's 'steps' must be an int >= 0"
    with pytest.raises(ValueError, match=match):
        read_steplog(path)


@pytest.mark.parametrize(
    "change, match",
    [
        ('"grad_norm": -2.0', "'grad_norm' must be >= 0 or null"),
        ('"consecutive_skips": 5', r"'consecutive_skips' \(5\) must not exceed 'total_skips' \(0\)"),
        ('"loss_finite": false', "'applied' is true but 'loss_finite' is false"),
    ],
    ids=["negative-grad-norm", "skips-in-a-row-above-all", "applied-non-finite-loss"],
)
def test_a_record_no_train_step_produces_is_an_error_naming_the_line(tmp_path, change, match):
    path = tmp_path / "run.jsonl"
    write_log(path, n=2)
    rows = path.read_text().splitlines()
    key = change.split(":")[0]
    rows[2] = re.sub(key + r": [^,]+", change, rows[2])
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: line 3: {match}"):
        read_steplog(path)


def test_a_nan_grad_norm_is_possible_and_read_as_null(tmp_path):
    path = tmp_path / "run.jsonl"
    write_log(path, n=1)
    path.write_text(path.read_text().replace('"grad_norm": 1.25', '"grad_norm": NaN'))
    log = read_quiet(path)
    assert log.steps[0]["grad_norm"] is None and "holds NaN or Infinity" in log.warnings[0]


def test_a_header_only_log_reads_with_no_steps(tmp_path):
    path = tmp_path / "run.jsonl"
    write_log(path, n=0, close=False)
    log = read_quiet(path)
    assert log.steps == [] and not log.ended and log.run["backend"] == "torch"


def test_the_frozen_v1_log_still_reads():
    """A log written by the first version of the writer: the reader must keep reading it."""
    log = read_steplog(DATA / "v1_lr_collapse.jsonl")
    assert log.ended and log.backend == "torch" and len(log.steps) == 40
    assert log.loss_scale["kind"] == "dynamic" and log.loss_scale["min_scale"] == 1.0


# ---------------------------------------------------------------- pandas


def test_pandas_reads_a_log(tmp_path):
    pd = pytest.importorskip("pandas", reason="pandas is optional; the format is plain JSON Lines")
    path = tmp_path / "run.jsonl"
    with StepLogWriter(path, backend="torch", framework_version="2") as w:
        w.write(record(0, lr=1e-3))
        w.write(record(1, loss=float("nan"), loss_finite=False, applied=False))
    frame = pd.read_json(path, lines=True)
    assert list(frame["kind"]) == ["run", "step", "step", "end"]
    steps = frame[frame["kind"] == "step"]
    assert list(steps["step"]) == [0, 1] and steps["loss"].isna().tolist() == [False, True]
    assert read_steplog(path).to_frame()["scale"].tolist() == [32768.0, 32768.0]


# ---------------------------------------------------------------- a property, and the layout


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
any_float = st.one_of(st.none(), st.floats(width=32))
records = st.lists(
    st.fixed_dictionaries(
        {
            "loss": any_float,
            "scale": finite.filter(lambda x: x > 0),
            "applied": st.booleans(),
            "loss_finite": st.booleans(),
            "grads_finite": st.booleans(),
            "grad_norm": any_float,
            "consecutive_skips": st.integers(0, 2**31 - 1),
            "total_skips": st.integers(0, 2**31 - 1),
            "batch_finite": st.one_of(st.none(), st.booleans()),
            "lr": any_float,
        }
    ).map(
        lambda r: {  # what a train step can produce: see test_write_rejects_a_bad_record
            **r,
            "loss_finite": r["loss_finite"] or r["applied"],
            "grads_finite": r["grads_finite"] or r["applied"],
            "grad_norm": None if r["grad_norm"] is None else abs(r["grad_norm"]),
            "consecutive_skips": min(r["consecutive_skips"], r["total_skips"]),
        }
    ),
    max_size=12,
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(recs=records, flush_every=st.integers(1, 5))
def test_any_record_round_trips(tmp_path, recs, flush_every):
    path = tmp_path / "prop.jsonl"
    with StepLogWriter(path, backend="x", framework_version="0", flush_every=flush_every) as w:
        for i, r in enumerate(recs):
            w.write({"step": 2 * i, **r})
    log = read_steplog(path)

    def norm(x):
        return None if x is None or not math.isfinite(x) else x

    assert len(log.steps) == len(recs) and log.ended and log.warnings == []
    for got, r in zip(log.steps, recs, strict=True):
        for k in ("loss", "grad_norm", "lr"):
            assert got[k] == norm(r[k])
        for k in ("scale", "applied", "loss_finite", "consecutive_skips", "batch_finite"):
            assert got[k] == r[k]


@pytest.mark.parametrize(
    "rel",
    [
        *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "unimp" / "steplog").glob("*.py")),
        *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "unimp" / "doctor").glob("*.py")),
    ],
)
def test_no_framework_import(rel):
    tree = ast.parse((ROOT / rel).read_text())
    top = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    top |= {
        n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
    }
    assert not top & {"torch", "tensorflow", "keras", "jax", "jaxlib", "flax", "optax"}


def test_importing_the_step_log_and_the_doctor_imports_no_framework():
    code = (
        "import sys, unimp.steplog, unimp.doctor\n"
        "print(sorted(m for m in ('torch', 'tensorflow', 'jax', 'keras', 'pandas') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_doctests():
    import doctest

    import unimp.steplog.writer

    result = doctest.testmod(unimp.steplog.writer, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_train_step_log_options_as_stats_every_takes_them():
    # log_every refused the NumPy ints stats_every takes; log="" failed later, in open()
    import numpy as np

    from unimp.steprecorder import check_log_every

    assert check_log_every(None, np.int64(5)) == 5 and type(check_log_every(None, np.int64(5))) is int
    with pytest.raises(ValueError, match="log must be None, a file path"):
        check_log_every("", 5)


def test_a_log_in_use_is_not_opened_a_second_time_and_nothing_is_lost(tmp_path):
    from unimp.steplog import StepLogBusyError

    path = tmp_path / "shared.jsonl"
    record = {"loss": 1.0, "scale": 1.0, "applied": True, "loss_finite": True,
              "grads_finite": True, "grad_norm": None, "consecutive_skips": 0, "total_skips": 0}
    first = StepLogWriter(path, backend="jax", framework_version="0", flush_every=1)
    first.write({"step": 0, **record})
    with pytest.raises(StepLogBusyError, match="is being written by another run; give each run its own file"):
        StepLogWriter(path, backend="torch", framework_version="0")
    # another process: the same refusal, the file as it was
    child = subprocess.run(
        [sys.executable, "-c", "import sys; from unimp.steplog import StepLogWriter\n"
         "try:\n    StepLogWriter(sys.argv[1], backend='tensorflow', framework_version='0')\n"
         "except OSError as e:\n    print(type(e).__name__)", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.stdout.strip() == "StepLogBusyError", child.stderr
    first.write({"step": 1, **record})
    first.close()
    log = read_steplog(path)
    assert log.run["backend"] == "jax" and [r["step"] for r in log.steps] == [0, 1] and log.ended
    StepLogWriter(path, backend="torch", framework_version="0").close()  # closed: free again
    assert read_steplog(path).run["backend"] == "torch"
