"""``unimp compare`` on Keras's own trainer on each Keras backend (keras-tensorflow, keras-jax,
keras-torch: a worker process each, unimp.compare.runner_keras)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import require_backend

from unimp.cli import main
from unimp.compare.run import device_for

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "compare", "keras_model.py")
ENGINES = ("keras-tensorflow", "keras-jax", "keras-torch")


def _run(tmp_path, *extra):
    out = tmp_path / "rep"
    code = main(["compare", "--epochs", "1", "--batch-size", "64", "--quiet", "--out", str(out), *extra])
    return code, out


def test_a_users_keras_model_runs_on_three_engines_from_the_same_weights(tmp_path):
    for b in ("tensorflow", "jax", "torch"):
        require_backend(b)
    code, out = _run(tmp_path, "--model", f"{EXAMPLE}:build", "--backends", ",".join(ENGINES))
    assert code == 0
    rep = json.loads((out / "report.json").read_text())
    runs = rep["runs"]
    assert list(runs) == list(ENGINES)
    assert [r["framework"] for r in runs.values()] == list(ENGINES)
    first = [r["loss"][0] for r in runs.values()]
    # the same initial weights and batches: the engines differ by their kernels only
    # (float16 compute), far less than two models from other seeds would
    np.testing.assert_allclose(first, first[0], rtol=2e-3)
    for r in runs.values():
        assert len(r["loss"]) == rep["steps"] and all(r["applied"])
        assert r["scale"][0] == rep["recipe"]["loss_scale"]["init_scale"]
        assert r["loss"][-1] < r["loss"][0]
    # --threads (1 on a CPU by default) reaches each worker: read back there by the framework
    assert rep["threads"] == {
        "keras-tensorflow": "1", "keras-jax": "framework default (XLA:CPU has no thread setting)",
        "keras-torch": "1",
    }  # fmt: skip
    assert runs["keras-torch"]["threads_set"] == {"torch": "1"}
    # each engine's first step is traced (unimp's step on the same model, in the worker): the
    # report's diff names the op whose dtype differs, and no op that runs alike everywhere
    assert [r["trace"]["framework"] for r in runs.values()] == list(ENGINES)
    diff = {row["key"]: row for row in rep["trace_diff"]}
    assert "relu" not in diff and "norm" not in diff  # float16 / float32 on every engine
    if runs["keras-torch"]["device"] == "cpu":  # Keras-torch: float16 matmuls in float32 there
        assert diff["matmul"]["dtypes"] == {
            "keras-tensorflow": ["float16"], "keras-jax": ["float16"], "keras-torch": ["float32"]
        }  # fmt: skip
        md = (out / "report.md").read_text()
        assert "* matmul: keras-tensorflow float16, keras-jax float16, keras-torch float32 (Keras's torch" in md
    assert runs["keras-tensorflow"]["threads_set"] == {"tensorflow": "1"}
    # Keras's trainer takes no statistics: unimp's step beside it does, at the first and the
    # last step, with the weights put back (the losses above are the training's own)
    last = str(rep["steps"] - 1)
    assert all(sorted(r["stats"], key=int) == ["0", last] for r in runs.values())
    assert set(rep["layer_stats"]) == set(ENGINES)
    acts = {e: rep["layer_stats"][e]["first"]["layers"]["l1"]["act_amax"] for e in ENGINES}
    assert max(acts.values()) == pytest.approx(min(acts.values()), rel=1e-2), acts


def test_per_layer_overrides_run_on_keras_engines(tmp_path):
    # the worker prepares the model with the recipe bound to Keras on its engine: l2 computes
    # in float32 under the override, so its losses leave the plain mixed_float16 run's
    require_backend("torch")
    losses = {}
    for recipe in ("mixed_float16", "mixed_float16;l2:float32"):
        code, out = _run(tmp_path / recipe.replace(";", "_").replace(":", "_"), "--backends", "keras-torch", "--recipe", recipe)
        assert code == 0
        rep = json.loads((out / "report.json").read_text())
        losses[recipe] = np.array(rep["runs"]["keras-torch"]["loss"])
    plain, overridden = losses.values()
    np.testing.assert_allclose(overridden, plain, rtol=5e-2)  # the same model and data
    assert not np.array_equal(overridden, plain)  # l2's float32 matmul rounds otherwise


@pytest.mark.parametrize(
    "extra,words",
    [
        (("--backends", "keras-jax", "--recipe", "mixed_float16;l2:params=bfloat16"), "no Keras policy"),
        (("--backends", "keras-torch", "--recipe", "params=bfloat16,compute=float32"), "no dtype policy"),
        (("--backends", "keras-mxnet"), "unknown backend"),
    ],
)
def test_what_keras_engines_cannot_run_fails_before_training(tmp_path, capsys, extra, words):
    require_backend("torch")
    code, out = _run(tmp_path, *extra)
    err = capsys.readouterr().err
    assert code == 2
    assert words in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.slow
def test_trace_records_every_keras_engine_beside_torch_and_the_diff_names_the_op_that_differs(capsys):
    for b in ("tensorflow", "jax", "torch"):
        require_backend(b)
    backends = ["torch", *ENGINES]  # in process, and a worker per Keras engine
    argv = ["trace", "mixed_float16", "--backends", ",".join(backends), "--batch-size", "8"]
    assert main([*argv, "--diff", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data["traces"]) == backends and list(data["reference"]) == ["float32 (torch)"]
    for name, t in data["traces"].items():  # the whole step, forward to update, of the same model
        assert t["framework"] == name and t["ops"] == len(t["records"])
        assert set(t["by_phase"]) == {"forward", "backward", "update"}
        fwd = {r["layer"] for r in t["records"] if r["phase"] == "forward" and r["op"] == "matmul"}
        assert fwd == {"l1", "l2"}, (name, fwd)
    rows = {(r["kind"], r["key"]): r for r in data["diff"]}
    assert ("op", "relu") not in rows  # float16 in every framework: not a difference
    # Keras's torch backend runs float16 matmuls in float32 on the CPU (torch's own autocast
    # and the other engines run them in float16): the one op that differs, with the reason
    if device_for("keras-torch", "auto") == "cpu":
        matmul = rows[("op", "matmul")]
        assert matmul["dtypes"] == {
            "torch": ["float16"], "keras-tensorflow": ["float16"], "keras-jax": ["float16"],
            "keras-torch": ["float32"], "float32 (torch)": ["float32"],
        }  # fmt: skip
        assert matmul["notes"] == {"keras-torch": "Keras's torch backend computes float16 matmuls in float32 on the CPU"}
        assert [key for kind, key in rows if kind == "op"] == ["matmul"]


@pytest.mark.slow
def test_audit_finds_a_planted_layer_alike_on_every_keras_engine(capsys, tmp_path):
    from unimp.steplog import read_steplog

    for b in ("tensorflow", "jax", "torch"):
        require_backend(b)
    argv = ["audit", "--to", "float16", "--backends", ",".join(ENGINES), "--steps", "2", "--plant", "l1=1e5"]
    assert main([*argv, "--json", "--log-dir", str(tmp_path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["clean"] == dict.fromkeys(ENGINES, False)
    fractions = set()
    for engine, found in data["findings"].items():
        first = found[0]  # l1's outputs pass float16's 65504; what carries them on is not flagged
        assert (first["layer"], first["kind"]) == ("l1", "activation overflow"), found
        assert first["downstream"][-1] == "l2"
        fractions.add(first["fraction"])
        log = read_steplog(tmp_path / f"{engine}.jsonl")  # the worker's step log, statistics on
        assert log.ended and log.steps[0]["stats"]["activations"]["l1"]["counts"]["float16_overflow"] > 0
    # the same model, weights and batch: every engine counts the same overflowing elements
    assert len(fractions) == 1 and 0 < fractions.pop() < 0.01


def test_a_keras_trace_worker_that_raises_prints_its_traceback_then_one_line(monkeypatch, capsys):
    import unimp.compare.trace as trace_module

    require_backend("jax")
    real = trace_module._spec

    def without_weights(cfg, recipe, backend):  # the worker's model then finds no weights
        spec, batch = real(cfg, recipe, backend)
        spec.weights = {}
        return spec, batch

    monkeypatch.setattr(trace_module, "_spec", without_weights)
    assert main(["trace", "mixed_float16", "--backends", "keras-jax", "--batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "keras_models.py" in err  # the worker's own
    assert err.strip().splitlines()[-1] == "unimp trace: error: keras-jax: KeyError: 'w1'"


CHATTY_BUT_FAILING_ON_JAX = '''
import sys
import keras


class OnlyOnTensorFlow(keras.layers.Layer):
    def call(self, x):
        if keras.backend.backend() != "tensorflow":
            raise ValueError("this layer runs on TensorFlow only")
        return x


def build():
    for i in range(3000):  # 300 KB on stderr while building: more than a pipe holds
        sys.stderr.write("W: a chatty library's warning, line %d ......................................\\n" % i)
    layers = [keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10)]
    if keras.backend.backend() == "jax":
        layers.insert(2, OnlyOnTensorFlow())
    return keras.Sequential(layers)
'''


def test_a_worker_that_floods_stderr_or_raises_reports_in_one_line(tmp_path, capsys):
    for b in ("tensorflow", "jax"):
        require_backend(b)
    model = tmp_path / "chatty.py"
    model.write_text(CHATTY_BUT_FAILING_ON_JAX)
    # keras-tensorflow floods its stderr and must finish (a full pipe stalled it for good);
    # keras-jax raises in the user's layer: its traceback, then one line, exit 2, nothing written
    code, out = _run(tmp_path, "--model", f"{model}:build", "--backends", "keras-tensorflow,keras-jax")
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert "this layer runs on TensorFlow only" in err and "Traceback" in err
    assert err.strip().splitlines()[-1].startswith("unimp compare: error: keras-jax: --model ")


def test_an_fp8_recipe_runs_on_keras_engines_and_the_first_scales_agree(tmp_path):
    require_backend("jax")
    require_backend("torch")
    model = tmp_path / "three.py"
    model.write_text(
        "import keras\n\n\ndef build():\n    return keras.Sequential([keras.Input((8, 8, 1)), "
        "keras.layers.Flatten(), keras.layers.Dense(32, name='a'), keras.layers.ReLU(), "
        "keras.layers.Dense(32, name='b'), keras.layers.ReLU(), keras.layers.Dense(10, name='c')])\n"
    )
    code, out = _run(tmp_path, "--model", f"{model}:build", "--backends", "keras-jax,keras-torch",
                     "--recipe", "fp8-delayed")
    assert code == 0
    rep = json.loads((out / "report.json").read_text())
    fp8 = rep["fp8"]
    # the recipe's default selection, the same on both engines: the first and last Dense out
    assert fp8["layers"] == {"keras-jax": ["b"], "keras-torch": ["b"]}
    # after the first step, from the same weights and batch: the same float32 bits of every
    # scale (the rule and the amaxes are the same; later steps drift with bfloat16 rounding)
    assert set(fp8["agree"]["b"]) == {"input", "kernel", "grad"}
    assert all(first for first, _ in fp8["agree"]["b"].values()), fp8["scales"]["b"]
    for r in rep["runs"].values():
        assert all(r["applied"]) and r["loss"][-1] < r["loss"][0]


def test_a_compensated_bfloat16_recipe_learns_alike_on_the_tensorflow_backend_and_keras_engines(tmp_path):
    """bf16-kahan (bfloat16 parameters, no loss scale, Kahan-compensated updates): every keras-*
    worker applies unimp's optimizer, so the policy's update rule and the float32 update of the
    half variables run there too. (Before, a recipe without a loss scale ran Keras's own
    optimizer, which computes Adam in bfloat16: the loss stayed at ln 10.)"""
    for b in ("tensorflow", "jax", "torch"):
        require_backend(b)
    code, out = _run(tmp_path, "--recipe", "bf16-kahan", "--backends", "tensorflow," + ",".join(ENGINES[1:]))
    assert code == 0
    runs = json.loads((out / "report.json").read_text())["runs"]
    final = {name: r["loss"][-1] for name, r in runs.items()}
    assert final["tensorflow"] < 0.8 * runs["tensorflow"]["loss"][0]  # it learns
    for name in ENGINES[1:]:  # the same rule; the engines differ by their kernels only
        assert final[name] == pytest.approx(final["tensorflow"], rel=0.05), final
