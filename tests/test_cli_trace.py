"""``unimp trace``: the table, ``--diff`` beside a float32 run, ``--json``, and bad input."""

import json

import pytest
from conftest import BACKENDS, require_backend

from unimp.cli import main


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_holds_every_record(backend, capsys):
    require_backend(backend)
    assert main(["trace", "mixed_bfloat16", "--backends", backend, "--json", "--batch-size", "8"]) == 0
    data = json.loads(capsys.readouterr().out)
    t = data["traces"][backend]
    assert t["framework"] == backend and t["ops"] == len(t["records"]) > 0
    mm = [r for r in t["records"] if r["layer"] == "l1" and r["op"] == "matmul" and r["phase"] == "forward"]
    assert mm and {r["compute"] for r in mm} == {"bfloat16"}
    assert data["reference"] == {} and data["diff"] == []


def test_the_table_and_the_diff_beside_float32(capsys):
    if len(BACKENDS) < 2:
        pytest.skip("the diff needs two frameworks under test")
    for b in BACKENDS:
        require_backend(b)
    argv = ["trace", "mixed_float16", "--backends", ",".join(BACKENDS), "--batch-size", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "l1" in out and "l2" in out and "casts" in out  # the table (rich wraps its headers)
    assert main([*argv, "--diff"]) == 0
    out = capsys.readouterr().out
    first = BACKENDS[0]
    assert f"where the frameworks differ (forward pass; reference run: float32 ({first})):" in out
    assert "casts" not in out  # --diff lists only the differences


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["trace", "mixed_float17"], "mixed_float16"),
        (["trace", "mixed_float16", "--model", "rnn"], "mlp, cnn, vit"),
        (["trace", "mixed_float16", "--backends", ","], "names no backend"),
        (["trace", "mixed_float16", "--backends", "mxnet"], "torch"),
        (["trace", "mixed_float16", "--batch-size", "0"], "--batch-size"),
        (["trace", "mixed_float16", "--device", "tpu"], "auto, cpu, cuda"),
        (["trace", "mixed_float16", "--loss-scale", "huge"], "--loss-scale"),
        (["trace", "mixed_float16", "--batch-size", "x"], "invalid int value"),
        (["trace"], "recipe"),
        (["trace", "--diff", "--recipe", "mixed_bfloat16"], "unimp trace: error: unrecognized arguments: --recipe; see unimp trace --help"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_one_framework_is_diffed_against_float32(capsys):
    backend = BACKENDS[0]
    require_backend(backend)
    assert main(["trace", "mixed_float16", "--backends", backend, "--diff", "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert f"matmul: {backend} float16, float32 ({backend}) float32" in out


def test_a_float8_recipe_on_a_model_with_no_float8_layer_says_so(capfd):
    # the seeds' MLP: first and last layers stay out of float8, and it has no other; the note
    # goes to stderr, so --json output stays JSON
    backend = BACKENDS[0]
    require_backend(backend)
    assert main(["trace", "fp8-delayed", "--backends", backend, "--json", "--batch-size", "8"]) == 0
    out, err = capfd.readouterr()  # the command writes stderr on the real descriptor
    json.loads(out)
    assert "no layer of model 'mlp' ran in float8" in err and "--model vit" in err
    assert main(["trace", "mixed_bfloat16", "--backends", backend, "--json", "--batch-size", "8"]) == 0
    assert "float8" not in capfd.readouterr().err
