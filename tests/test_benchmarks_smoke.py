"""Smoke test of benchmarks/: every script runs end to end on a tiny model, per backend, so the
benchmarks do not rot. Timings are not asserted (targets live in the issue and the README);
the host-sync facts are: unimp's step reads nothing on the host (torch), compiles once and has
no host callback or implicit transfer (JAX), and is one tf.function traced once (TensorFlow).

Each case calls ``benchmarks.<script>.main([--tiny, --backends, <backend>, --in-process])``:
the workers run in the test process (the frameworks are imported once, threads are left alone).
One case runs the real command line, with its worker subprocess.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BACKENDS, require_backend

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("overhead", "syncs", "speedup", "memory", "observe", "opcount", "gemm", "fp8check")
# (script, backend) cases measured above 10 s on the 2-core CI-like machine (the first case of a
# framework also pays its import; JAX compiles each loop and recipe)
SLOW = {
    ("overhead", "torch"),
    ("overhead", "tensorflow"),
    ("overhead", "jax"),
    ("syncs", "jax"),
    ("speedup", "jax"),
    ("observe", "tensorflow"),
    ("gemm", "tensorflow"),
    ("gemm", "jax"),
    ("fp8check", "tensorflow"),
}


def run_script(script: str, backend: str, out: Path) -> dict:
    args = ["--tiny", "--backends", backend, "--out", str(out), "--threads", "0", "--in-process"]
    importlib.import_module(f"benchmarks.{script}").main(args)
    assert (out / f"{script}.md").read_text().count("|") > 10
    return json.loads((out / f"{script}.json").read_text())


@pytest.mark.slow
def test_command_line_with_worker_process(tmp_path: Path) -> None:
    """The real path: ``python -m benchmarks.syncs`` starts a worker process per backend."""
    backend = next((b for b in ("jax", "torch", "tensorflow") if b in BACKENDS), None)
    if backend is None:
        pytest.skip("no backend under test")
    require_backend(backend)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.syncs", "--tiny", "--backends", backend, "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "syncs.json").read_text())["results"][backend]
    assert "error" not in res, res.get("error")
    assert [r["impl"] for r in res["rows"]] == ["unimp", "native"]


CASES = [
    pytest.param(s, b, marks=[pytest.mark.slow] if (s, b) in SLOW else [], id=f"{s}-{b}")
    for s in SCRIPTS
    for b in BACKENDS
]


@pytest.mark.parametrize("script,backend", CASES)
def test_benchmark_runs(script: str, backend: str, tmp_path: Path) -> None:
    require_backend(backend)
    if script == "gemm":  # it sets the framework's TF32 switches per precision, then puts them back
        from benchmarks.gemm import _tf32_now

        before = _tf32_now(backend)
        payload = run_script(script, backend, tmp_path)
        assert _tf32_now(backend) == before
    else:
        payload = run_script(script, backend, tmp_path)
    results = payload["results"]
    if script == "memory":
        assert [r["backend"] for r in results] == [backend]
        assert all("error" not in r for r in results), results
        assert results[0]["peak_rss_mib"] > 0 and results[0]["rss_after_build_mib"] > 0
        return
    if script == "observe":  # one row per model: a trace of the step and a statistics step
        (row,) = results
        assert "error" not in row, row.get("error")
        assert row["backend"] == backend and row["trace_ops"] > 0
        assert row["trace_ms"] > 0 and row["stats_step_ms"] > 0 and row["step_ms"] > 0
        return
    res = results[backend]
    assert "error" not in res, res.get("error")
    if script == "gemm":  # the GPU probe's plumbing: every precision measured, under its guard
        assert [r["precision"] for r in res["rows"]] == ["float32", "tf32", "bfloat16", "float16", "float8"]
        # float8: every framework's native path (a CPU runs it emulated), against bfloat16
        assert res["rows"][-1]["recipe"] == "fp8-delayed" and res["rows"][-1]["vs_bfloat16"] > 0
        # JAX's float8 step is its own: its reference is the same step without float8
        assert ("bfloat16_same_step_ms" in res["rows"][-1]) == (backend == "jax")
        for r in res["rows"]:
            assert "error" not in r and "skipped" not in r, r
            assert r["tflops"] > 0 and r["steps"] == 2 and r["ms_per_step"] > 0
            assert r["device_name"] == "cpu" and r["peak_tflops"] is None  # no peak for a CPU
        guard = res["rows"][0]["guard"]
        assert ("transfer_guard" in guard) if backend == "jax" else guard.startswith("none")
    elif script == "fp8check":  # gpu.sh's check runs here as on a GPU: plumbing cannot fail it
        assert res["pass"] and res["states_equal"] and res["unequal"] == [], res
        assert res["float8_units"] is False and res["max_rel_gemm_diff"] < 1e-6
        assert payload["settings"]["steps"] == res["steps"] == 4
    elif script == "opcount":  # the counts are recorded for both loops (their values are not asserted)
        assert [r["impl"] for r in res["rows"]] == ["unimp", "native"]
        key = {"torch": "aten_ops", "tensorflow": "compute_ops", "jax": "kernels"}[backend]
        by = "ops_by_type" if backend == "tensorflow" else "ops_by_name"
        assert all(r[key] > 0 and sum(r[by].values()) >= r[key] for r in res["rows"])
        if backend == "jax":
            assert all(r["dispatches"] >= 1 and r["fusions"] > 0 for r in res["rows"])
    elif script == "overhead":
        (row,) = res["rows"]
        assert row["pairs"] == len(row["ratios"]) == 1
        assert row["a_ms_per_step"] > 0 and row["b_ms_per_step"] > 0
        assert len(row["diffs_us"]) == 1 and row["diff_us_median"] == row["diffs_us"][0]
    elif script == "speedup":
        assert [r["recipe"] for r in res["rows"]] == ["float32", "mixed_float16", "mixed_bfloat16"]
        assert res["rows"][0]["speedup_median"] == 1.0  # float32 against itself
    elif script == "syncs":
        row = next(r for r in res["rows"] if r["impl"] == "unimp")
        assert row["meets_target"], row
        if backend == "torch":  # host reads of tensors inside the step, after warm-up
            assert row["host_reads_per_step"] == 0
            assert row["host_reads_by_name"] == {}
        elif backend == "jax":  # one compiled function, no host callback
            assert row["compilations_first_call"] == 1
            assert row["compilations_later_calls"] == 0
            assert row["traces"] == 1
            assert row["host_primitives"] == []
        elif backend == "tensorflow":  # one tf.function, no retracing
            assert row["tracings_after_steps"] == 1
            assert row["host_ops"] == []


@pytest.mark.parametrize(
    "name,precision,peak",
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989.5),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.5),
        ("NVIDIA H100 PCIe", "float16", 756.5),
        ("NVIDIA H200", "float32", 67.0),
        ("NVIDIA H200 NVL", "bfloat16", 835.5),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
        ("NVIDIA A100 80GB PCIe", "float32", 19.5),
        ("cpu", "float32", None),
    ],
)
def test_gemm_dense_peaks(name: str, precision: str, peak: float | None) -> None:
    """The datasheets' dense peaks (half the tensor-core figures they list with sparsity)."""
    from benchmarks.gemm import peak_tflops

    assert peak_tflops(name, precision) == peak


def test_gemm_flops_per_step() -> None:
    """4 x Dense(8192) at batch 8192: 6 * 8192 * 4 * 8192^2 FLOPs a training step."""
    from benchmarks.gemm import probe_spec, step_flops

    assert step_flops(probe_spec(8192, 4, 8192)) == 6 * 8192 * 4 * 8192**2 == 13194139533312


def test_gpu_script_fits_three_minutes(capsys: pytest.CaptureFixture[str]) -> None:
    """gpu.sh parses, runs only scripts that exist (with options they accept), and caps the
    whole run: TOTAL_S plus the 5 s nvidia-smi and 10 s info limits (which TOTAL_S counts from
    the start) and one 3 s kill grace stay under 180 s."""
    import re

    script = (ROOT / "benchmarks" / "gpu.sh").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu.sh")]).returncode == 0
    total = int(re.search(r"^TOTAL_S=(\d+)$", script, re.M).group(1))
    assert total + 3 < 180
    runs = re.findall(r"^run (\w+) (\d+)(.*)$", script, re.M)
    assert [name for name, _, _ in runs] == ["syncs", "gemm", "fp8check", "overhead", "memory"]
    assert sum(int(limit) for _, limit, _ in runs) <= total  # each step's cap fits the total
    for name, _, options in runs:
        module = importlib.import_module(f"benchmarks.{name}")
        # the options parse: the run stops only at the check of --backends, after parse_args
        with pytest.raises(SystemExit):
            module.main([*options.split(), "--device", "cuda", "--backends", "none"])
        err = capsys.readouterr().err
        assert "--backends: unknown ['none']" in err and "unrecognized" not in err, err


@pytest.mark.parametrize(
    "backend", [pytest.param(b, marks=[pytest.mark.slow] if b == "torch" else []) for b in BACKENDS]
)
def test_opcount_compiled_counts_graphs_breaks_and_recompiles(backend: str, tmp_path: Path) -> None:
    require_backend(backend)
    args = ["--tiny", "--compiled", "--backends", backend, "--out", str(tmp_path), "--threads", "0", "--in-process"]
    importlib.import_module("benchmarks.opcount").main(args)
    assert "graph breaks (unimp / native)" in (tmp_path / "opcount.md").read_text()
    res = json.loads((tmp_path / "opcount.json").read_text())["results"][backend]
    assert "error" not in res, res.get("error")
    unimp_row, native = res["rows"]
    assert unimp_row["compiled"] and unimp_row["recompiles"] == 0 and unimp_row["graphs"] >= 1
    if backend == "torch":  # torch's GradScaler breaks the native compiled step; unimp's adds none
        # (the one left is torch's: its fused Adam kernel runs outside the compiler)
        assert unimp_row["graph_breaks"] == 1 < native["graph_breaks"]
    else:  # an XLA function compiles whole, once
        assert unimp_row["graphs"] == native["graphs"] == 1
        assert unimp_row["graph_breaks"] == native["graph_breaks"] == 0
