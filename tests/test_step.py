"""The framework-free step core (unimp.step): StepResult, the step rules every backend shares
(micro-batches, half optimizer state, lost decays, the replica re-sync message), and the core's
doctests."""

import doctest
import importlib

import numpy as np
import pytest
from conftest import step_raw

from unimp import DynamicLossScale, LossScaleError, StepResult
from unimp.backends._base import COMMON_API, MixedPrecisionBase


def test_step_result_converts_lazily():
    calls = []

    def to_host(x):
        calls.append(x)
        return x

    r = StepResult(step_raw(), to_host)
    assert calls == []  # nothing read, nothing converted
    assert r.loss == 0.5 and isinstance(r.loss, float)
    assert r.applied is True and r.total_skips == 2 and r.grad_norm is None
    assert r.as_dict()["scale"] == 1024.0
    assert "loss=0.5" in repr(r)


def test_step_result_checks_stuck_scale_on_read():
    cfg = DynamicLossScale(max_consecutive_skips=2)
    r = StepResult(
        step_raw(applied=np.bool_(False), consecutive_skips=np.int32(3), total_skips=np.int32(3)),
        config=cfg,
    )
    with pytest.raises(LossScaleError, match="3 skipped steps in a row"):
        _ = r.loss


def test_step_result_missing_field():
    raw = step_raw()
    del raw["grad_norm"]
    with pytest.raises(ValueError, match="grad_norm"):
        StepResult(raw)


def test_mixed_precision_base():
    mp = MixedPrecisionBase("mixed_bfloat16")
    assert mp.policy.compute_dtype == "bfloat16" and mp.loss_scale.kind == "none"
    assert "bfloat16" in repr(mp)
    assert "MixedPrecision" in COMMON_API and "StepResult" in COMMON_API


@pytest.mark.parametrize(
    "module",
    ["unimp", "unimp.attached", "unimp.dtypes", "unimp.policy", "unimp.overrides", "unimp.loss_scale",
     "unimp.recipe"],
)
def test_core_doctests(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_half_optimizer_state_rule():
    import warnings

    from unimp import HalfOptimizerStateWarning
    from unimp.step import warn_half_optimizer_state

    with pytest.warns(HalfOptimizerStateWarning, match="epsilon=1e-08 becomes 0 in float16"):
        warn_half_optimizer_state("Adam", 1e-8)
    with pytest.warns(HalfOptimizerStateWarning, match="epsilon=1e-07 becomes 1.19209e-07"):
        warn_half_optimizer_state("Adam", 1e-7)
    with pytest.warns(HalfOptimizerStateWarning, match="below 6.1e-5"):
        warn_half_optimizer_state("the optax optimizer", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_half_optimizer_state("Adam", 1e-4)  # at least float16's smallest normal: bounded
        warn_half_optimizer_state("Adam", 2.0**-14)


def test_micro_batches_is_one_rule_for_every_backend():
    from unimp.step import micro_batches

    assert micro_batches({"x": 1}, 1) == [{"x": 1}]
    assert micro_batches(["a", "b"], 2) == ["a", "b"]
    with pytest.raises(ValueError, match=r"got a tuple \(one batch, such as \(x, y\)\)"):
        micro_batches(("a", "b"), 2)  # step((x, y)) is one batch, never two micro-batches
    with pytest.raises(ValueError, match=r"takes a list of 3 micro-batches, got list of length 2"):
        micro_batches(["a", "b"], 3)
    with pytest.raises(ValueError, match=r"takes a list of 2 micro-batches, got dict\."):
        micro_batches({"x": 1}, 2)


def test_replica_desync_warning_is_one_message():
    from unimp.loss_scale import ReplicaDesyncWarning, warn_replica_desync

    def engine_check():  # an engine warns for its caller's line, as warnings.warn(stacklevel=2)
        warn_replica_desync("Load the same checkpoint on every rank.", ["scale in [1, 2]"])

    with pytest.warns(ReplicaDesyncWarning) as rec:
        engine_check()
    msg = str(rec[0].message)
    assert msg == (
        "the replicas held different loss-scale states (scale in [1, 2]); re-synchronized every "
        "replica from replica 0. Load the same checkpoint on every rank to avoid this."
    )
    assert rec[0].filename == __file__
    with pytest.warns(ReplicaDesyncWarning, match=r"states; re-synchronized"):
        warn_replica_desync("Restore it everywhere")
