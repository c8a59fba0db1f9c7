"""Golden tests of ``train_step(log=...)`` + ``unimp doctor`` in every backend: planted faults
give the same diagnosis (class, step, layer) from the torch, Keras and JAX logs."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from conftest import BACKENDS, require_backend

from unimp.cli import main
from unimp.compare.data import batches, load_dataset
from unimp.compare.models import init_weights
from unimp.compare.run import RunSpec
from unimp.doctor import diagnose
from unimp.recipe import get_recipe
from unimp.steplog import read_steplog

NAN_AT = 5


def _spec(steps, path=None, *, optimizer="adam", lr=1e-3, plant=None, nan_at=None, stats_every=None):
    """The seeds' MLP on the digits under mixed_float16, its first ``steps`` batches, logged to
    ``path``: l1's weights times ``plant``, one NaN pixel in batch ``nan_at``."""
    ds = load_dataset("digits", seed=0, num_classes=10)
    weights = init_weights("mlp", ds.image_shape, ds.num_classes, 0)
    if plant is not None:
        weights = {**weights, "w1": weights["w1"] * np.float32(plant)}
    data = batches(ds, batch_size=32, epochs=1, seed=0, dropout=0.2, hidden=512)[:steps]
    if nan_at is not None:
        x = data[nan_at]["x"].copy()
        x[0, 3, 3, 0] = np.nan  # one pixel of one image
        data[nan_at] = {**data[nan_at], "x": x}
    return RunSpec(
        get_recipe("mixed_float16"), "mlp", weights, data, ds.x_test, ds.y_test,
        ds.num_classes, optimizer, lr, "cpu", stats_every=stats_every,
        log=None if path is None else str(path),
    )  # fmt: skip


def _build(backend, spec):
    """``(step, convert)`` of the backend's compare runner for ``spec``."""
    _, step, convert = importlib.import_module(f"unimp.compare.runner_{backend}").build(spec)
    return step, convert


def _run(backend, path, *, steps=10, **faults):
    importlib.import_module(f"unimp.compare.runner_{backend}").run(_spec(steps, path, **faults))
    return read_steplog(path)


def _lr_raised_100x_at_10(backend, path, lr):
    """An SGD run of 24 steps whose learning rate is raised 100x at step 10; its log."""
    spec = _spec(24, path, optimizer="sgd", lr=lr)
    step, convert = _build(backend, spec)
    for i, b in enumerate(spec.batches):
        if i == 10:
            _raise_lr(backend, step, 100)
        step(convert(b))
    step.close()
    return read_steplog(path)


def _classes(diagnosis):
    (log,) = diagnosis.logs
    return [(f.cls, f.step, f.layer) for f in log.findings]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_log_holds_every_step_and_a_clean_run_has_nothing_wrong(backend, tmp_path):
    require_backend(backend)
    log = _run(backend, tmp_path / "clean.jsonl", steps=12)
    assert log.ended and [r["step"] for r in log.steps] == list(range(12))
    assert log.run["backend"] == backend and log.loss_scale["init_scale"] == 32768.0
    assert all(r["applied"] and r["batch_finite"] for r in log.steps)
    d = diagnose([log])
    assert d.ok and [c for c, _, _ in _classes(d)] == ["nothing_wrong"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_with_a_nan_is_found_at_its_step(backend, tmp_path):
    require_backend(backend)
    log = _run(backend, tmp_path / "nan.jsonl", nan_at=NAN_AT)
    rec = log.steps[NAN_AT]
    assert rec["batch_finite"] is False and rec["applied"] is False and rec["loss"] is None
    found = _classes(diagnose([log]))
    assert found[0][:2] == ("nonfinite_input", NAN_AT)
    assert diagnose([log]).fixes[0]["id"] == "check_data"  # the root cause first


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_layer_whose_activations_overflow_float16_is_named(backend, tmp_path):
    require_backend(backend)
    # l1's weights x 1e5: its float16 outputs overflow, the loss is inf on every step (a forward
    # overflow: skipped, the scale kept); the statistics say which layer went first
    log = _run(backend, tmp_path / "planted.jsonl", steps=4, plant=1e5, stats_every=1)
    assert all(r["loss_finite"] is False for r in log.steps)
    assert log.steps[0]["nonfinite"] == {"phase": "forward", "layer": "l1", "tensor": "l1"}
    found = _classes(diagnose([log]))
    assert ("forward_overflow", 0, "l1") in found


def test_the_same_fault_gives_the_same_diagnosis_in_every_framework(tmp_path, capsys):
    if len(BACKENDS) < 2:
        pytest.skip("needs two frameworks under test")
    paths = []
    for b in BACKENDS:
        require_backend(b)
        _run(b, tmp_path / f"{b}.jsonl", nan_at=NAN_AT)
        paths.append(str(tmp_path / f"{b}.jsonl"))
    d = diagnose([read_steplog(p) for p in paths])
    assert d.comparison is not None and d.comparison["agree"] and d.comparison["mismatch"] == []
    assert main(["doctor", *paths]) == 0
    out = capsys.readouterr().out
    assert "nonfinite_input" in out and "they agree" in out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("bad", "needle"),
    [({"log_every": 0}, "log_every"), ({"log_every": True}, "log_every"), ({"log": 3}, "log must be")],
)
def test_bad_log_options_are_refused_before_anything_is_written(backend, bad, needle, tmp_path):
    require_backend(backend)
    spec = _spec(1)
    path = tmp_path / "log.jsonl"
    spec.step_options = lambda: {"log": str(path), **bad}
    with pytest.raises(ValueError, match=needle):
        importlib.import_module(f"unimp.compare.runner_{backend}").build(spec)
    assert not path.exists()


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("torch", "jax")])
def test_logging_reads_the_device_only_every_log_every_steps(backend, tmp_path):
    """torch: no host read of a tensor between writes (the benchmarks' checker); JAX: no
    device-to-host transfer (transfer guard). TensorFlow runs eagerly outside its step
    function and has no such check."""
    require_backend(backend)
    spec = _spec(8)
    data = spec.batches
    path = tmp_path / "log.jsonl"
    spec.step_options = lambda: {"log": str(path), "log_every": 4}
    step, convert = _build(backend, spec)
    batches_ = [convert(b) for b in data]
    step(batches_[0])  # compiled / optimizer state created; record 0 buffered
    if backend == "torch":
        from benchmarks._kit_torch import count_host_reads

        spec.step_options = lambda: {}  # the same step without a log: the reads it makes itself
        _, plain, _ = importlib.import_module("unimp.compare.runner_torch").build(spec)
        plain(batches_[0])
        with count_host_reads() as unlogged:
            for b in batches_[1:3]:
                plain(b)
        with count_host_reads() as reads:
            for b in batches_[1:3]:
                step(b)
        # torch.optim.Adam (not fused) reads its step counters itself; the log adds nothing
        assert reads == unlogged
    else:
        import jax

        with jax.transfer_guard_device_to_host("disallow"):
            for b in batches_[1:3]:
                step(b)
    step(batches_[3])  # the 4th record: written now
    step.close()
    assert [r["step"] for r in read_steplog(path).steps] == [0, 1, 2, 3]


def _raise_lr(backend, step, factor):
    if backend == "torch":
        step.optimizer.param_groups[0]["lr"] *= factor
    elif backend == "tensorflow":
        step.optimizer.learning_rate = float(step.optimizer.learning_rate) * factor
    else:  # the runner's optax optimizer has its learning rate in the state (inject_hyperparams)
        hp = step.opt_state.hyperparams
        hp["learning_rate"] = hp["learning_rate"] * factor


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_learning_rate_raised_100x_is_named_before_the_overflows(backend, tmp_path):
    require_backend(backend)
    log = _lr_raised_100x_at_10(backend, tmp_path / "lr.jsonl", 0.1)  # overflows from step 12
    assert [r["lr"] for r in log.steps[9:11]] == pytest.approx([0.1, 10.0])
    d = diagnose([log])
    found = [(c, s) for c, s, _ in _classes(d)]
    assert found[:2] == [("lr_change_before_overflow", 10), ("overflow_burst", 12)]
    assert d.fixes[0]["id"] == "lower_lr"


def test_a_step_after_close_is_not_logged_and_says_so(tmp_path):
    backend = BACKENDS[0]
    require_backend(backend)
    path = tmp_path / "log.jsonl"
    spec = _spec(3, path)
    data = spec.batches
    step, convert = _build(backend, spec)
    step(convert(data[0]))
    step.close()
    with pytest.warns(RuntimeWarning, match="after the step log"):
        step(convert(data[1]))
    step(convert(data[2]))  # warned once
    log = read_steplog(path)
    assert log.ended and [r["step"] for r in log.steps] == [0]


GRAD_AT = 12  # after the first 10 steps, where the doctor reads an overflow as calibration


def _poison_l1_gradient(backend, step, monkeypatch):
    """An inf injected into the gradient of l1's output at the step the returned setter arms,
    each framework by its own means: a torch full backward pre-hook, a Keras layer call under
    tf.custom_gradient with a variable factor, a jax.custom_vjp whose backward reads the factor
    through jax.experimental.io_callback (a test-only sync). Returns ``arm(on: bool)``."""
    if backend == "torch":
        import torch

        armed = {"on": False}

        def hook(module, grad_output):
            if armed["on"]:
                return tuple(None if g is None else g * torch.inf for g in grad_output)
            return None

        step.model.l1.register_full_backward_pre_hook(hook)
        return lambda on: armed.__setitem__("on", on)
    if backend == "tensorflow":
        import tensorflow as tf

        factor = tf.Variable(1.0, trainable=False)
        layer = step.model.get_layer("l1")
        call = layer.call

        @tf.custom_gradient
        def poison(y):
            return tf.identity(y), lambda g: g * tf.cast(factor, g.dtype)

        layer.call = lambda *a, **k: poison(call(*a, **k))
        return lambda on: factor.assign(np.inf if on else 1.0)
    raise AssertionError(backend)  # JAX: patched before the step is built (see the test)


def _jax_poison(monkeypatch):
    import jax
    from jax.experimental import io_callback

    from unimp.compare import runner_jax

    armed = {"factor": np.float32(1.0)}

    @jax.custom_vjp
    def poison(y):
        return y

    def bwd(_, g):
        f = io_callback(lambda: armed["factor"], jax.ShapeDtypeStruct((), np.float32))
        return (g * f.astype(g.dtype),)

    poison.defvjp(lambda y: (y, None), bwd)
    observe = runner_jax.observe
    monkeypatch.setattr(
        runner_jax, "observe", lambda name, x: poison(observe(name, x)) if name == "l1" else observe(name, x)
    )
    return lambda on: armed.__setitem__("factor", np.float32(np.inf if on else 1.0))


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the torch hook's own note
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_inf_injected_in_one_layers_gradient_is_named_on_a_step_without_statistics(
    backend, tmp_path, monkeypatch
):
    """The same planted fault, by each framework's own means, gives the same diagnosis: an
    isolated gradient overflow at step 12 (the scale had held since the start), first in layer
    l1 (backward order: l2's gradients are finite), with no statistics asked for."""
    require_backend(backend)
    path = tmp_path / "grad.jsonl"
    spec = _spec(16, path)
    data = spec.batches
    arm = _jax_poison(monkeypatch) if backend == "jax" else None
    step, convert = _build(backend, spec)
    arm = arm or _poison_l1_gradient(backend, step, monkeypatch)
    for i, b in enumerate(data):
        arm(i == GRAD_AT)
        # read the result before re-arming: JAX dispatches asynchronously, and its callback
        # reads the factor when the step runs, which may be after the loop moved on
        bool(step(convert(b)).applied)
    step.close()
    log = read_steplog(path)
    rec = log.steps[GRAD_AT]
    assert rec["loss_finite"] is True and rec["grads_finite"] is False and rec["applied"] is False
    assert rec["stats"] is None and rec["nonfinite"]["phase"] == "backward"
    assert rec["nonfinite"]["layer"] == "l1"
    assert all(r["applied"] for r in log.steps if r["step"] != GRAD_AT)
    found = _classes(diagnose([log]))
    assert found[0] == ("isolated_overflow", GRAD_AT, "l1")
    assert diagnose([log]).fixes[0]["id"] == "check_layer"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_learning_rate_raised_100x_until_the_run_diverges(backend, tmp_path):
    """SGD at 0.5, raised 100x at step 10: gradient overflows back the scale off from 32768 to
    2048 (steps 11-14, first non-finite in l2, from the per-gradient flags of a logged step),
    one step applies at 2048 and the run diverges: from step 16 the loss is inf on every step.
    unimp's forward-overflow rule keeps the scale at 2048 there, where torch.amp.GradScaler,
    which backs off on any inf, would halve it on every step toward zero; the doctor names the
    learning-rate change first either way."""
    require_backend(backend)
    log = _lr_raised_100x_at_10(backend, tmp_path / "lr.jsonl", 0.5)
    assert [r["scale"] for r in log.steps[10:16]] == [32768, 32768, 16384, 8192, 4096, 2048]
    assert all(not r["loss_finite"] and r["scale"] == 2048 for r in log.steps[16:])
    d = diagnose([log])
    found = _classes(d)
    assert found[:3] == [
        ("lr_change_before_overflow", 10, None),
        ("forward_overflow", 16, None),
        ("overflow_burst", 11, "l2"),
    ]
    assert d.fixes[0]["id"] == "lower_lr"
