import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BACKENDS

import unimp
from unimp.cli import main


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert capsys.readouterr().out.strip() == f"unimp {unimp.__version__}"


def test_info_json_lists_every_backend(capsys):
    assert main(["info", "--json", "--no-devices"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [b["backend"] for b in data["backends"]][:3] == ["torch", "tensorflow", "jax"]
    for b in data["backends"]:
        assert b["installed"] == (b["backend"] in unimp.available_backends())
        assert b["install"].startswith('pip install "unimp[')


def test_info_says_which_engine_backend_keras_binds(capsys, monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "keras", raising=False)  # read as Keras would, unimported
    for engine, binds in (("jax", "unimp.keras"), ("tensorflow", "unimp.backends.tensorflow")):
        monkeypatch.setenv("KERAS_BACKEND", engine)
        assert main(["info", "--json", "--no-devices"]) == 0
        keras_row = json.loads(capsys.readouterr().out)["keras"]
        assert keras_row["engine"] == engine and keras_row["binds"] == binds
        assert main(["info", "--no-devices"]) == 0
        assert f'on {engine} (KERAS_BACKEND or keras.json): backend="keras" binds {binds}' in capsys.readouterr().out


def test_info_says_float8_is_emulated_one_line_per_framework(capsys):
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    f8 = [line.strip() for line in lines if "float8 matmuls" in line]
    assert len(f8) == len(unimp.available_backends())
    for line in f8:
        assert line.startswith("float8 matmuls: emulated by default (")
        assert "(native=True) is opt-in" in line  # each framework names its native path
        assert "small layers gain nothing" in line and "about 1.5x" in line


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "unimp.cli", "info", "--no-devices"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("unimp ")


def test_no_command_is_usage_error(capsys):
    assert main([]) == 2


NATIVE = re.compile(r"(\.cc:\d+\]|absl::InitializeLog|oneDNN|cuda drivers|To enable the following instructions)")


@pytest.mark.parametrize(
    "argv",
    [
        ["info"],
        ["explain", "mixed_float16", "--scalers"],
        ["compare", "--epochs", "1", "--backends", BACKENDS[0]],
    ],
    ids=["info", "explain", "compare"],
)
def test_cli_output_holds_only_unimps_lines(argv, tmp_path):
    # TF_CPP_MIN_LOG_LEVEL=0 makes TensorFlow log its start-up lines to descriptor 2 here (absl
    # writes some before it reads the variable at all, the case users hit with level 3)
    if "compare" in argv:
        argv = [*argv, "--out", str(tmp_path / "out")]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0"}
    out = subprocess.run(
        [sys.executable, "-m", "unimp.cli", *argv], capture_output=True, text=True, env=env,
        timeout=600, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    noise = [line for line in (out.stdout + out.stderr).splitlines() if NATIVE.search(line)]
    assert noise == []


def test_native_filter_keeps_other_native_lines(capfd):
    from unimp import cli

    with cli._native_stderr_filtered():
        os.write(2, b"W0000 00:00:1796056733.775412    8509 cpu_feature_guard.cc:227] noise\n")
        os.write(2, b"To enable the following instructions: AVX2 FMA\n")
        sys.stderr.write("unimp's own line\n")  # Python's stderr is not caught
        os.write(2, b"Traceback (most recent call last): a native crash report\n")
    err = capfd.readouterr().err
    assert err == "unimp's own line\nTraceback (most recent call last): a native crash report\n"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["compare", "--epochs", "1e3"], "argument --epochs: invalid int value: '1e3'"),
        (["bogus"], "invalid choice: 'bogus'"),
        (["explain", "/nonexistent/r.toml"], "does not exist; give a recipe name"),
    ],
)
def test_argument_errors_are_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        code = main(argv)
        raise SystemExit(code)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "usage:" not in err


def test_a_closed_pipe_is_a_quiet_exit():
    # `unimp explain O2 --scalers | head -1`: the reader leaves early
    # (`true` leaves before unimp writes anything: every write meets a closed pipe)
    proc = subprocess.run(
        f"{sys.executable} -m unimp.cli explain O2 --scalers | true",
        shell=True, capture_output=True, text=True, timeout=120,
    )
    assert proc.stderr == ""


def _synopses():
    """``{command: its synopsis}``: the text between the backticks of each '* `unimp COMMAND
    ...`' bullet of docs/reference/commands.md (the commands described in words)."""
    text = (Path(__file__).parents[1] / "docs" / "reference" / "commands.md").read_text()
    out: dict[str, str] = {}
    for whole, command in re.findall(r"^\* `(unimp (\w+)[^`]*)`", text, flags=re.M):
        out[command] = out.get(command, "") + " " + whole  # explain has two bullets
    return out


def test_the_synopses_list_every_option_the_parsers_take():
    from unimp.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    synopses = _synopses()
    assert {"compare", "trace", "audit", "doctor", "explain", "info"} <= set(synopses)
    for command, parser in sub.choices.items():
        options = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
        missing = sorted(o for o in options - {"--help"} if not re.search(rf"{o}\b", synopses[command]))
        assert not missing, f"docs/reference/commands.md's `unimp {command}` synopsis lacks {missing}"


def test_compare_help_names_every_loss_scale_preset(capsys):
    from unimp.loss_scale.presets import PRESETS

    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in PRESETS) and "deepspeed, megatron, fairseq" in text


@pytest.mark.slow  # a process importing TensorFlow: about 15 s
def test_a_keras_backend_exported_for_the_users_code_does_not_refuse_the_tensorflow_backend(tmp_path):
    # KERAS_BACKEND=jax set for a user's own Keras code: `--backends tensorflow` (Keras on
    # TensorFlow in the command's process) refused to load, and compare's defaults with it
    if "tensorflow" not in BACKENDS:
        pytest.skip("TensorFlow is not under test")
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    out = subprocess.run(
        [sys.executable, "-m", "unimp.cli", "trace", "mixed_float16", "--backends", "tensorflow", "--json"],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert '"framework": "tensorflow"' in out.stdout


@pytest.mark.parametrize("command", [["trace", "mixed_float16"], ["audit", "--to", "float16"]])
def test_trace_and_audit_refuse_a_users_model_at_once_naming_compare(command, tmp_path, capsys):
    # before: the model was built (14 s), then "unknown --model ...; choose one of mlp, cnn, vit"
    model = tmp_path / "net.py"
    model.write_text("raise SystemExit('imported')\n")  # importing it would end the test
    assert main([*command, "--model", f"{model}:build", "--backends", "torch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runs the built-in models" in err[0] and "unimp compare --model" in err[0]


def test_a_backend_named_twice_and_an_unmakeable_log_dir_are_one_line_each(tmp_path, capsys):
    assert main(["trace", "mixed_float16", "--backends", "torch,torch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names torch twice; name each backend once" in err[0]
    blocker = tmp_path / "file"
    blocker.write_text("")  # a folder cannot be made below a file
    code = main(["audit", "--to", "float16", "--backends", BACKENDS[0], "--steps", "1",
                 "--log-dir", str(blocker / "logs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--log-dir" in err[0] and "cannot be created" in err[0], err
    assert not (blocker / "logs").exists()


def test_ctrl_c_in_a_command_is_one_line_and_exit_130(monkeypatch, capsys):
    # audit on a keras engine printed the 19-line traceback of whatever ran (compare says where)
    import unimp.compare.run as run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "run_audit", interrupted)
    assert main(["audit", "--to", "float16", "--backends", BACKENDS[0]]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["unimp audit: interrupted"]


def test_compare_notes_tensorflows_slow_onednn_float16_on_a_cpu(monkeypatch):
    # a new user saw TensorFlow 26x slower than torch and no word why (52 ms -> 1.4 ms a step
    # with TF_ENABLE_ONEDNN_OPTS=0 on a CPU with AVX512-FP16)
    from unimp.cli import _onednn_note

    def report(policy, tf_ms, device="cpu:0"):
        return {"recipe": {"policy": policy}, "runs": {
            "torch": {"step_time": [0.002] * 3, "device": "cpu"},
            "tensorflow": {"step_time": [tf_ms / 1000] * 3, "device": device}}}

    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    assert "TF_ENABLE_ONEDNN_OPTS=0" in _onednn_note(report("mixed_float16", 52.0))
    assert _onednn_note(report("mixed_float16", 8.0)) is None  # 4x: not said
    assert _onednn_note(report("mixed_bfloat16", 52.0)) is None
    assert _onednn_note(report("mixed_float16", 52.0, device="gpu:0")) is None
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")
    assert _onednn_note(report("mixed_float16", 52.0)) is None
