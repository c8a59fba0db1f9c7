"""Pure half precision (bfloat16 parameters and optimizer state, no float32 master weights) with
round-to-nearest updates, in every framework (issue 32).

Every framework's optimizer computes its scalars (hyperparameters, step count, bias corrections)
in float32 whatever the parameters' dtype, as torch's do: Keras's optimizers computed in the
variables' dtype, where Adam's ``beta_2 = 0.999`` is 1.0 in bfloat16 and nothing was learned,
and ``optax.inject_hyperparams`` cast its hyperparameters to the parameters' dtype, where the
first step wrote NaN parameters. unimp's optimizer wrappers (TensorFlow's LossScaleOptimizer,
JAX's train step and ``loss_scaling``) run them in float32 for half parameters.
"""

from __future__ import annotations

import kits
import numpy as np

from unimp.doctor import diagnose
from unimp.steplog import read_steplog

# bfloat16's spacing: 2**-8 in [0.5, 1), 2**-7 in [1, 2)
TWO_SPACINGS = 2.0**-6


def test_adam_in_pure_bfloat16_moves_as_float32_adam_does(backend):
    # gradient (1, -1) every step: Adam moves each weight by lr per step, to (0.7, 1.3) after 3
    run = kits.build_linear(backend, "bfloat16", w=[1.0, 1.0], lr=0.1, optimizer="adam")
    for _ in range(3):
        assert bool(run.step(kits.linear_batch([1.0, -1.0])).applied)
    w = np.asarray(run.w(), np.float32)
    assert np.isfinite(w).all(), w
    np.testing.assert_allclose(w, [0.7, 1.3], rtol=0, atol=TWO_SPACINGS)


def test_round_to_nearest_leaves_a_bfloat16_weight_of_one_where_it_is(backend):
    # the right value: 1,000 SGD steps of lr 1 and gradient 1e-3 on a bfloat16 weight of
    # 1.0 leave exactly 1.0 (each step is below half the spacing at 1.0, 2**-8); in float32 the
    # same steps take it to 0
    half = kits.build_linear(backend, "bfloat16", w=[1.0], lr=1.0)
    full = kits.build_linear(backend, "float32", w=[1.0], lr=1.0)
    b = kits.linear_batch([1e-3])
    for _ in range(1000):
        half.step(b)
        full.step(b)
    assert np.asarray(half.w(), np.float32).tolist() == [1.0]
    np.testing.assert_allclose(full.w(), [0.0], rtol=0, atol=1e-4)


def test_an_applied_step_that_writes_non_finite_half_params_is_reported(backend, tmp_path):
    # Adam with eps=0 and a gradient of exactly 0 for the second weight: m / (sqrt(v) + eps) is
    # 0 / 0, so the applied step (finite loss, finite gradients) writes NaN into it: the result,
    # the step log and the doctor say so
    path = tmp_path / "run.jsonl"
    run = kits.build_linear(backend, "bfloat16", w=[1.0, 1.0], lr=0.1, optimizer="adam", eps=0.0, log=path)
    r = run.step(kits.linear_batch([1.0, 0.0]))
    assert (r.applied, r.grads_finite, r.loss_finite) == (True, True, True)
    assert r.params_finite is False
    assert np.isnan(np.asarray(run.w(), np.float32)[1])
    run.step(kits.linear_batch([1.0, 0.0]))  # NaN parameters: a NaN loss, skipped
    run._step.close()
    log = read_steplog(path)
    assert [s["params_finite"] for s in log.steps] == [False, False]
    (d,) = diagnose([log]).logs
    first = d.findings[0]
    assert first.cls == "params_non_finite" and first.steps == [0]
    assert first.summary.startswith(
        "the bfloat16 parameters went non-finite at step 0, an applied step, with a finite loss "
        "and finite gradients"
    )
    assert [f.id for f in first.fixes] == ["master_weights", "optimizer_epsilon"]
    # the NaN loss of step 1 follows from it: not a forward overflow of its own
    assert "forward_overflow" not in [f.cls for f in d.findings]
    assert "'mixed_bfloat16'" in first.fixes[0].text
    # float32 parameters are not checked: no op is added to their steps
    full = kits.build_linear(backend, "float32", w=[1.0, 1.0], lr=0.1, optimizer="adam")
    f = full.step(kits.linear_batch([1.0, 0.5]))
    assert f.params_finite is None and "params_finite" not in f.raw
    good = kits.build_linear(backend, "bfloat16", w=[1.0, 1.0], lr=0.1, optimizer="adam")
    assert good.step(kits.linear_batch([1.0, 0.5])).params_finite is True
