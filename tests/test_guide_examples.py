"""The guides' framework tabs include the scripts under examples/guides/ (one per capability and
framework, ``<capability>_<backend>.py``); each runs here on a tiny model, in this process (the
framework is imported once), and does what its page says. ``tests/test_examples.py`` runs each
with ``--help`` as a user would."""

from __future__ import annotations

import pathlib
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDES = ROOT / "examples" / "guides"
FRAMEWORKS = ("torch", "tensorflow", "jax")
CAPABILITIES = ("overrides", "precision", "stats", "trace", "audit", "steplog", "fp8", "compiled")


def run(capability: str, backend: str):
    """The example's ``main()`` result (its printout goes to the captured stdout)."""
    return runpy.run_path(str(GUIDES / f"{capability}_{backend}.py"), run_name="example")["main"]()


def test_every_capability_has_a_script_per_framework():
    names = {p.stem for p in GUIDES.glob("*.py")}
    assert names == {f"{c}_{f}" for c in CAPABILITIES for f in FRAMEWORKS}


def test_every_script_is_a_tab_of_a_page():
    pages = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs").rglob("*.md"))
    for script in sorted(GUIDES.glob("*.py")):
        assert f'--8<-- "guides/{script.name}"' in pages, f"{script.name} is on no page"


def test_overrides_keep_the_output_layer_in_float32(backend):
    seen = run("overrides", backend)
    if backend == "tensorflow":  # the layers' dtype policies
        assert seen == {"l1": "mixed_float16", "l2": "float32"}
    else:  # the layers' output dtypes
        assert {k: v.replace("torch.", "") for k, v in seen.items()} == {"l1": "float16", "l2": "float32"}


def test_matmul_precision_is_set_in_the_step_and_restored(backend):
    if backend == "tensorflow":  # from TF's default (TF32 on), whatever an earlier test left
        import tensorflow as tf

        previous = tf.config.experimental.tensor_float_32_execution_enabled()
        tf.config.experimental.enable_tensor_float_32_execution(True)
        try:
            seen = run("precision", backend)
        finally:
            tf.config.experimental.enable_tensor_float_32_execution(previous)
    else:
        seen = run("precision", backend)
    assert seen["after" if backend == "torch" else "after a step"] == seen["before"]
    inside = seen["in the step"]
    if backend == "torch":
        assert inside["mkldnn.matmul"] == "tf32" and seen["before"]["mkldnn.matmul"] != "tf32"
    elif backend == "tensorflow":
        assert inside["tf32"] is False and seen["before"]["tf32"] is True
    else:
        assert inside["default_matmul_precision"] == "tensorfloat32"


def test_statistics_come_on_every_kth_step(backend):
    out = run("stats", backend)
    assert out["steps"] == [0, 2]
    assert "l1" in out["stats"].activations and len(out["stats"].gradients) == 4


def test_trace_shows_the_overridden_layer_in_float32(backend):
    matmuls = run("trace", backend)["matmuls"]
    assert matmuls[("l1", "forward")] == {"float16"} and matmuls[("l2", "forward")] == {"float32"}
    assert matmuls[("l1", "backward")] == {"float16"} and matmuls[("l2", "backward")] == {"float32"}


def test_audit_finds_the_planted_overflow_at_l1(backend):
    findings = run("audit", backend)
    assert (findings[0].kind, findings[0].layer) == ("activation overflow", "l1")


def test_doctor_names_the_bad_batch(backend):
    out = run("steplog", backend)
    assert [s["step"] for s in out["log"].steps if not s["applied"]] == [5]
    assert out["log"].ended
    (finding,) = out["diagnosis"].logs[0].findings
    assert finding.cls == "nonfinite_input" and finding.steps == [5]


@pytest.mark.filterwarnings("ignore::unimp.fp8.FP8EmulationWarning")  # emulated on a CPU: expected
def test_fp8_recipe_selects_the_middle_layer(backend):
    out = run("fp8", backend)
    assert out["layers"] == ("l2",)
    assert all(0 < s < float("inf") and s != 1.0 for s in out["scales"].values())


def _compiled(backend):
    results = run("compiled", backend)
    assert [bool(r.applied) for r in results] == [True, True, True, False, True, True]
    assert [float(r.scale) for r in results] == [32768.0] * 4 + [16384.0] * 2


@pytest.mark.parametrize("backend_", ["tensorflow", "jax"])
def test_compiled_step_skips_inside_the_program(backend_):
    from conftest import require_backend

    require_backend(backend_)
    _compiled(backend_)


@pytest.mark.slow
def test_torch_compiled_step_skips_inside_the_graph():
    # torch.compile (inductor, a C++ build on a CPU): about 10 s. In a subprocess, as a user runs
    # it: dynamo imports the module of the function it compiles, which runpy's is not
    import os
    import subprocess
    import sys

    from conftest import require_backend

    require_backend("torch")
    out = subprocess.run([sys.executable, str(GUIDES / "compiled_torch.py")], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split(",")[:2] for line in out.stdout.splitlines() if line.startswith("step ")]
    assert [a.split("applied ")[1] for a, _ in lines] == ["True"] * 3 + ["False"] + ["True"] * 2
    assert [b.strip() for _, b in lines] == ["scale 32768"] * 4 + ["scale 16384"] * 2
