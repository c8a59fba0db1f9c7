"""The train step's algorithm, written once (unimp.trainstep): its options and the order of its
phases, over primitives that record what they are given (no framework)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest
from conftest import BACKENDS, require_backend

from unimp.step import STEP_FIELDS
from unimp.trainstep import StepOptions, StepPrimitives, run_step

PHASES = [
    name for name, member in vars(StepPrimitives).items()
    if inspect.isfunction(member) and not name.startswith("_")
]  # fmt: skip


class Recording:
    """Primitives over Python floats: the gradients are a list, ``log`` the calls in order."""

    def __init__(self, grads, loss=2.0, fail=False, skip=False, half=None):
        self.log, self.grads, self.loss, self.fail, self.skip = [], grads, loss, fail, skip
        self.norm_limit = float("inf")
        self.half = half  # the half parameters' finite flag after the update; None: none

    def _note(self, name, *args):
        self.log.append((name, *args))

    def begin(self):
        self._note("begin")
        return 8.0

    def save_forward_state(self):
        self._note("save_forward_state")
        return "saved"

    def gradients(self, micro, scale):
        self._note("gradients", len(micro), scale)
        if self.fail:
            raise RuntimeError("loss_fn failed")
        return [g * scale for g in self.grads], self.loss, True

    def abort(self, saved):
        self._note("abort", saved)

    def unscale(self, grads, scale):
        self._note("unscale", scale)
        return [g / scale for g in grads]

    def observe(self, grads, scale):
        self._note("observe", list(grads))
        return {"grad_flags": "flags"}

    def finite(self, grads, scale):
        self._note("finite")
        return grads, not self.skip

    def global_norm(self, grads, grads_finite):
        self._note("global_norm", list(grads), grads_finite)
        norm = sum(g * g for g in grads) ** 0.5
        return norm, grads_finite and norm < self.norm_limit

    def clip(self, grads, norm, max_norm):
        self._note("clip", norm, max_norm)
        return [g * min(1.0, max_norm / norm) for g in grads]

    def apply(self, grads, grads_finite, loss_finite):
        self._note("apply", list(grads), grads_finite, loss_finite)
        return grads_finite and loss_finite

    def restore_forward_state(self, saved, applied):
        self._note("restore_forward_state", saved, applied)

    def params_finite(self):
        self._note("params_finite")
        return self.half

    def update_scale(self, grads_finite, loss_finite):
        self._note("update_scale", grads_finite, loss_finite)
        skipped = int(not (grads_finite and loss_finite))
        return {"consecutive_skips": skipped, "total_skips": skipped}


def test_the_phases_run_in_the_algorithms_order_and_clipping_acts_on_unscaled_gradients():
    ops = Recording([3.0, 4.0])
    raw = run_step(ops, ["mb0", "mb1"], StepOptions(grad_accum_steps=2, max_grad_norm=1.0))
    assert [entry[0] for entry in ops.log] == [
        "begin", "save_forward_state", "gradients", "unscale", "observe", "finite",
        "global_norm", "clip", "apply", "restore_forward_state", "params_finite", "update_scale",
    ]  # fmt: skip
    by_name = {entry[0]: entry[1:] for entry in ops.log}
    assert by_name["gradients"] == (2, 8.0)  # both micro-batches, at the step's scale
    assert by_name["global_norm"] == ([3.0, 4.0], True)  # unscaled, before clipping
    clipped, grads_finite, loss_finite = by_name["apply"]
    assert clipped == pytest.approx([0.6, 0.8]) and grads_finite and loss_finite  # norm 1
    assert raw["grad_norm"] == 5.0 and raw["scale"] == 8.0 and raw["loss"] == 2.0
    assert set(STEP_FIELDS) <= set(raw) and raw["grad_flags"] == "flags"
    assert "params_finite" not in raw  # float32 parameters: not checked, not reported


def test_half_parameters_that_went_non_finite_are_reported():
    raw = run_step(Recording([1.0], half=False), ["mb"], StepOptions())
    assert raw["applied"] is True and raw["params_finite"] is False


def test_without_max_grad_norm_no_norm_is_taken_and_a_skipped_step_is_reported():
    ops = Recording([1.0], skip=True)
    raw = run_step(ops, ["mb"], StepOptions())
    assert "global_norm" not in [e[0] for e in ops.log] and raw["grad_norm"] is None
    assert raw["applied"] is False and raw["grads_finite"] is False
    assert raw["consecutive_skips"] == raw["total_skips"] == 1
    assert ("restore_forward_state", "saved", False) in ops.log


def test_a_norm_beyond_the_range_skips_the_step_as_a_non_finite_gradient():
    ops = Recording([3.0, 4.0])
    ops.norm_limit = 4.0  # the backend's norm overflowed: its flag says so
    raw = run_step(ops, ["mb"], StepOptions(max_grad_norm=1.0))
    assert raw["applied"] is False and raw["grads_finite"] is False
    assert ("update_scale", False, True) in ops.log  # the scale backs off, as on an overflow


def test_a_window_that_raises_is_aborted_and_nothing_after_it_runs():
    ops = Recording([1.0], fail=True)
    with pytest.raises(RuntimeError, match="loss_fn failed"):
        run_step(ops, ["mb"], StepOptions())
    assert [e[0] for e in ops.log] == ["begin", "save_forward_state", "gradients", "abort"]
    assert ops.log[-1] == ("abort", "saved")


def test_the_updates_own_report_replaces_the_steps_fields():
    class Fused(Recording):
        def update_scale(self, grads_finite, loss_finite):
            return {"scale": "snapshot", "consecutive_skips": 0, "total_skips": 0}

    raw = run_step(Fused([1.0]), ["mb"], StepOptions())
    assert raw["scale"] == "snapshot"


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("grad_accum_steps", 0, "grad_accum_steps must be an int >= 1"),
        ("grad_accum_steps", True, "grad_accum_steps must be an int >= 1"),
        ("max_grad_norm", -1.0, "max_grad_norm must be a finite number > 0"),
        ("max_grad_norm", float("inf"), "max_grad_norm must be a finite number > 0"),
        ("stats_every", 0, "stats_every must be None"),
        ("schedule_counts", "skipped", "schedule_counts must be 'applied' or 'attempted'"),
        ("log_every", 0, "log_every must be an int >= 1"),
        ("log", 3, "log must be None, a file path"),
    ],
)
def test_step_options_refuse_bad_values_naming_the_option(option, value, words):
    with pytest.raises(ValueError, match=words):
        StepOptions(**{option: value})


def test_step_options_are_one_checked_frozen_record():
    import numpy as np

    o = StepOptions(grad_accum_steps=np.int64(3), max_grad_norm=2, stats_every=4)
    assert (type(o.grad_accum_steps), type(o.max_grad_norm)) == (int, float)
    assert [c for c in range(9) if o.stats_step(c)] == [0, 4, 8]
    assert not StepOptions().stats_step(0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.grad_accum_steps = 1  # type: ignore[misc]
    assert o.micro_batches([1, 2, 3]) == [1, 2, 3]
    with pytest.raises(ValueError, match="takes a list of 3 micro-batches"):
        o.micro_batches((1, 2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_supplies_the_same_primitives(backend):
    """The parallel catalogue: each backend's StepOps has every phase, with its signature."""
    require_backend(backend)
    ops = importlib.import_module(f"unimp.backends.{backend}.step").StepOps
    for name in PHASES:
        want = inspect.signature(getattr(StepPrimitives, name))
        got = inspect.signature(getattr(ops, name))
        assert list(got.parameters) == list(want.parameters), (backend, name)
