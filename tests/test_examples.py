"""Every example runs as a user would run it (a subprocess, on CPU) and finishes cleanly."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from conftest import require_backend

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (example, its backend, arguments, text its output must contain). torch_mlp.py and apex_o2.py
# run in tests/backends/torch/test_mixed_precision.py / test_compat_apex.py (both loops, O1 and O2), jax_flax_optax.py
# in tests/backends/jax/test_mixed_precision.py (with its compilation count).
EXAMPLES = [
    ("keras_mlp_fit.py", "tensorflow", [], "float32"),
    ("tf_keras2_custom_loop.py", "tensorflow", [], "loss"),
    ("port_any_backend.py", "torch", ["--backend", "torch", "--steps", "30"], "final loss"),
    (
        "port_any_backend.py",
        "tensorflow",
        ["--backend", "tensorflow", "--steps", "30"],
        "final loss",
    ),
    ("port_any_backend.py", "jax", ["--backend", "jax", "--steps", "30"], "final loss"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script,backend,args,needle", EXAMPLES, ids=[f"{e[0]}-{e[1]}" for e in EXAMPLES]
)
def test_example_runs(script, backend, args, needle):
    require_backend(backend)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert needle in out.stdout.lower()
    assert "nan" not in out.stdout.lower().split("final loss")[-1][:20]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["tensorflow", "jax", "torch"])
def test_keras_example_runs_on_every_keras_backend(engine):
    # backend="keras" binds the tensorflow backend on TensorFlow and unimp.keras on JAX / torch;
    # the planted overflow at step 5 is skipped on each
    require_backend(engine)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": engine}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "keras_any_backend.py"), "--steps", "7"],
        capture_output=True, text=True, timeout=180, env=env, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"on {engine}: " in out.stdout
    module = "unimp.backends.tensorflow" if engine == "tensorflow" else "unimp.keras.mixed_precision"
    assert module in out.stdout
    assert "step  5" in out.stdout and "applied False" in out.stdout.split("step  5")[1].splitlines()[0]
    assert "skipped steps 1" in out.stdout


def test_port_script_gives_the_same_losses_in_every_framework(backend):
    import runpy

    from conftest import BACKENDS

    if len(BACKENDS) < 2:
        pytest.skip("needs two backends under test to compare")
    main = runpy.run_path(str(ROOT / "examples" / "port_any_backend.py"), run_name="example")[
        "main"
    ]
    mine = main(["--backend", backend, "--steps", "20"])
    other = main(["--backend", next(b for b in BACKENDS if b != backend), "--steps", "20"])
    assert max(abs(a - b) / b for a, b in zip(mine, other, strict=True)) < 2e-2


SCRIPTS = sorted(p.relative_to(ROOT / "examples").as_posix() for p in (ROOT / "examples").rglob("*.py"))


def _frameworks(script: str) -> set[str]:
    """The unimp backends an example imports (each must be under test to run it)."""
    text = (ROOT / "examples" / script).read_text()
    found = set()
    for backend, names in {"torch": ("torch",), "tensorflow": ("tensorflow", "keras"),
                           "jax": ("jax", "flax", "optax")}.items():
        if any(f"import {n}" in text or f"from {n}" in text for n in names):
            found.add(backend)
    return found


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_example_takes_help(script):
    for backend in sorted(_frameworks(script)):
        require_backend(backend)  # skips with a reason when that backend is not under test
    # --help prints the usage and trains nothing (Horovod's example parses before importing it)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--help"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage:") and "step 0" not in out.stdout


@pytest.mark.parametrize("script", ["keras_mlp_fit.py", "tf_keras2_custom_loop.py"])
def test_tensorflow_examples_parse_their_arguments_before_importing_tensorflow(script):
    # --help took 33-36 s on a new user's machine: TensorFlow was imported first
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{script!r}, '--help']\n"
        "try:\n"
        f"    runpy.run_path({str(ROOT / 'examples' / script)!r}, run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('imported:', sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "imported: []", out.stdout + out.stderr
