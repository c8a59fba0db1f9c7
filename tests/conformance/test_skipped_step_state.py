"""A skipped step changes nothing: params, optimizer state, and the state the forward pass
changes (norm running statistics), in every backend (pytorch/pytorch#88474 kind)."""

from __future__ import annotations

import kits
import numpy as np


def _same(a, b):
    assert a.keys() == b.keys() if isinstance(a, dict) else len(a) == len(b)
    pairs = zip(a.values(), b.values(), strict=True) if isinstance(a, dict) else zip(a, b, strict=True)
    for x, y in pairs:
        np.testing.assert_array_equal(x, y)


def test_skipped_step_leaves_params_optimizer_and_norm_statistics(backend):
    run = kits.NormRun(backend, "mixed_float16")
    x = np.random.default_rng(1).normal(size=(8, 3)).astype(np.float32)
    for _ in range(3):  # clean steps (the first ones may back the scale off to a clean one)
        run.step(x)
    assert run.step(x).applied
    before = (run.forward_state(), run.params(), run.optimizer_state())
    assert before[0], "the model has forward state to check"
    r = run.step(x * 1e5)  # activations overflow float16: the step is skipped
    assert r.applied is False
    _same(run.forward_state(), before[0])
    _same(run.params(), before[1])
    _same(run.optimizer_state(), before[2])
    # evaluation still works: no NaN statistics left behind
    assert np.isfinite(run.evaluate(x)).all()
    # and the next clean step moves the statistics again
    assert run.step(x).applied
    assert any(
        not np.array_equal(a, b) for a, b in zip(run.forward_state().values(), before[0].values(), strict=True)
    )
