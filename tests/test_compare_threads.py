"""`unimp compare --threads N`: each framework's CPU threads, set for the run and reported."""

from __future__ import annotations

import json
import sys
import types
import warnings

import pytest

from unimp.cli import main
from unimp.compare.report import _device
from unimp.compare.threads import MAX_THREADS, threads


def test_threads_are_set_for_the_block_and_reported(backend):
    if backend == "torch":
        import torch

        before = torch.get_num_threads()
        with threads([backend], 1) as info:
            assert torch.get_num_threads() == 1 and info == {"torch": "1"}
        assert torch.get_num_threads() == before  # process-wide: restored
    elif backend == "tensorflow":
        import tensorflow as tf

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with threads([backend], 1) as info:
                pass
        if info["tensorflow"] == "1":  # TensorFlow had not started in this process yet
            assert tf.config.threading.get_intra_op_parallelism_threads() == 1 and not caught
        else:  # it had: its pools keep their size, and the warning says how to set them
            assert "already started" in info["tensorflow"]
            assert any("fresh process" in str(w.message) for w in caught)
    else:
        with threads([backend], 1) as info:
            assert info == {"jax": "framework default (XLA:CPU has no thread setting)"}


@pytest.mark.parametrize("n", [0, -2, True, 1.5, "2"])
def test_bad_thread_count_is_refused_before_anything_changes(n):
    import torch

    before = torch.get_num_threads()
    with pytest.raises(ValueError, match="--threads must be an integer >= 1"):
        with threads(["torch"], n):
            pass
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("n", [MAX_THREADS + 1, 10**6, 2**31, 2**40])
def test_a_count_past_the_cap_is_refused_before_anything_changes(n):
    import torch

    before = torch.get_num_threads()
    with pytest.raises(ValueError, match=f"--threads must be an integer >= 1 and <= {MAX_THREADS}, got {n}"):
        with threads(["torch", "tensorflow"], n):
            pass
    assert torch.get_num_threads() == before


def _fake_tensorflow(monkeypatch, set_threads, held):
    """A ``tensorflow`` module whose thread setters call ``set_threads`` and whose getters say
    ``held``, in place of the real one for the test."""
    threading = types.SimpleNamespace(
        set_intra_op_parallelism_threads=set_threads, set_inter_op_parallelism_threads=set_threads,
        get_intra_op_parallelism_threads=lambda: held, get_inter_op_parallelism_threads=lambda: held,
    )  # fmt: skip
    fake_tf = types.ModuleType("tensorflow")
    fake_tf.config = types.SimpleNamespace(threading=threading)
    monkeypatch.setitem(sys.modules, "tensorflow", fake_tf)


def test_a_failure_setting_a_later_framework_restores_torch(monkeypatch):
    # TensorFlow raising anything but its "already started" RuntimeError (MemoryError here)
    # after torch's count was set: torch's must still be put back
    import torch

    def fail(n):
        raise MemoryError("no room for the pool")

    _fake_tensorflow(monkeypatch, fail, held=0)  # TensorFlow's getters say 0 until a count is set
    before = torch.get_num_threads()
    n = 2 if before != 2 else 3
    with pytest.raises(MemoryError):
        with threads(["torch", "tensorflow"], n):
            pytest.fail("the block must not run")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("n", ["-1", str(MAX_THREADS + 1), "2147483648"])
def test_cli_refuses_a_thread_count_out_of_range_naming_it(tmp_path, capfd, n):
    out = tmp_path / "rep"
    code = main(["compare", "--epochs", "1", "--quiet", "--threads", n, "--out", str(out)])
    _, err = capfd.readouterr()
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert (
        f"unimp compare: error: --threads must be 0 (each framework's own) or an integer from 1 to "
        f"{MAX_THREADS}, got {n}." in err
    )
    assert not out.exists()  # refused before anything ran or was written


def test_device_cell_says_the_thread_count():
    assert _device("cpu", "1") == "cpu, 1 thread"
    assert _device("cpu:0", "4") == "cpu:0, 4 threads"
    assert _device("cpu:0", "framework default (XLA:CPU has no thread setting)") == "cpu:0, own threads"
    assert _device("cuda:0", "1") == "cuda:0" and _device("cpu", None) == "cpu"


def test_compare_with_threads_reports_them(backend, tmp_path):
    out = tmp_path / "rep"
    code = main(["compare", "--epochs", "1", "--batch-size", "64", "--quiet", "--threads", "1",
                 "--backends", backend, "--out", str(out)])
    assert code == 0
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["threads"]) == {backend} and rep["config"]["threads"] == 1
    assert f"CPU threads (--threads): {backend} " in (out / "report.md").read_text()


def test_compare_on_a_cpu_runs_one_thread_per_framework_by_default(tmp_path):
    # torch with a thread per core on a shared CPU read 20-50x slower than JAX in the step-time
    # row; the default is the benchmarks' choice, and --threads 0 keeps each framework's own
    out = tmp_path / "rep"
    code = main(["compare", "--epochs", "1", "--batch-size", "64", "--quiet",
                 "--backends", "torch", "--out", str(out)])
    assert code == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["threads"] == {"torch": "1"} and rep["config"]["threads"] is None
    code = main(["compare", "--epochs", "1", "--batch-size", "64", "--quiet", "--threads", "0",
                 "--backends", "torch", "--out", str(tmp_path / "own")])
    assert code == 0 and json.loads((tmp_path / "own" / "report.json").read_text())["threads"] == {}


def test_tensorflow_already_at_the_count_is_left_alone_without_a_warning(monkeypatch):
    # compare builds a user's Keras model under the run's count (which starts TensorFlow); the
    # run's own setting then finds the same count and must not warn that it could not set it
    def started(n):
        raise RuntimeError("Intra op parallelism cannot be modified after initialization.")

    _fake_tensorflow(monkeypatch, started, held=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with threads(["tensorflow"], 3) as got:
            assert got == {"tensorflow": "3"}
    with pytest.warns(RuntimeWarning, match="already started"), threads(["tensorflow"], 2) as got:
        assert got["tensorflow"].startswith("framework default")
