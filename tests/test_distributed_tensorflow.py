"""tf.distribute (issue 8): unimp's LossScaleOptimizer and train step under MirroredStrategy
over 2 logical CPU devices; the finite flag is reduced over the replicas.

Logical devices must be configured before TensorFlow initializes its devices, so the
scenarios run once in a fresh process (tests/_dist_tf_script.py) and each test checks one of
its results.
"""

import os
import re

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import json
import math
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
SCALE = 65536.0
INF = float("inf")

# a TensorFlow process with 2 logical devices: ~30 s on 2 cores
pytestmark = [pytest.mark.backend("tensorflow"), pytest.mark.slow]


@pytest.fixture(scope="module")
def run():
    env = {
        **os.environ,
        "UNIMP_WORKTREE": str(ROOT),
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "KERAS_BACKEND": "tensorflow",
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_dist_tf_script.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["replicas"] == 2
    return out


def test_train_step_inf_on_replica_1_only_skips_both_and_halves_the_scale(run):
    r = run["step_bad"]
    assert r["applied"] is False and r["grads_finite"] is False
    assert r["scale_used"] == SCALE and r["scale_next"] == [32768.0, 32768.0]
    assert r["w"] == [[0.0, 0.0], [0.0, 0.0]]
    assert r["iterations"] == [0, 0]  # the skipped step did not touch the inner optimizer


def test_train_step_next_clean_step_applies_the_mean_gradient_on_both(run):
    r = run["step_clean"]
    assert r["applied"] is True and r["scale_used"] == 32768.0
    # replica gradients [1, 2] and [3, 4]: the mean [2, 3], as one device on the global batch
    assert r["w"] == [[-2.0, -3.0], [-2.0, -3.0]]
    assert r["iterations"] == [1, 1]


def test_clipping_uses_the_norm_of_the_all_reduced_gradient(run):
    r = run["clip"]
    assert r["grad_norm"] == pytest.approx(13**0.5, rel=1e-6)  # |[2, 3]|
    w = [-2 / 13**0.5, -3 / 13**0.5]
    assert r["w"][0] == r["w"][1] and r["w"][0] == pytest.approx(w, rel=1e-6)


def test_grad_accumulation_window_under_the_strategy(run):
    # a window with inf on replica 1 in its first micro-batch is skipped whole; then the mean
    # of the micro-batch mean gradients [2, 3] and [6, 7] is applied on both replicas
    assert run["accum"] == {"bad_applied": False, "applied": True, "w": [[-4.0, -5.0]] * 2}


def test_loss_scale_optimizer_custom_loop_reduces_the_finite_flag(run):
    assert run["lso"] == {"w": [[0.0, 0.0], [0.0, 0.0]], "scale_next": [32768.0, 32768.0]}


def test_evidence_keras_lso_reads_the_finite_flag_from_one_replica(run):
    # keras.optimizers.LossScaleOptimizer, same inf on replica 1 only: it applies the step
    # (weights -inf on both replicas) and keeps the scale. unimp's skips (previous test).
    assert run["keras_lso"] == {"w": [[-INF, -INF], [-INF, -INF]], "scale_next": [SCALE, SCALE]}


def test_replicas_with_different_scales_are_resynced_from_replica_0_with_a_warning(run):
    r = run["desync"]
    assert r["warned"] == ["ReplicaDesyncWarning"]
    assert r["applied"] is True and r["scale_next"] == [32768.0, 32768.0]
    assert r["w_equal"] is True


def test_bad_input_is_refused_with_the_fix_and_changes_nothing(run):
    e = run["errors"]
    assert "divisible by 2" in e["uneven"] and e["unchanged"] is True
    assert "jit_compile=False" in e["jit"]


def test_example_runs():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "distributed" / "tf_mirrored.py")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # three steps on both replicas; the output layer computes in float16 (one recipe, one model
    # in every framework), so an early step may overflow and back the scale off: that is fine
    lines = re.findall(r"step \d: loss [\d.]+ scale (\d+) applied (True|False) on 2 replicas", proc.stdout)
    # which step overflows depends on the weights (the example now seeds them; CI once drew
    # weights that skipped step 0) and may still differ between CPUs' float16 kernels: ask for one
    # applied step, not a given one
    assert len(lines) == 3 and any(applied == "True" for _, applied in lines)
    for (scale, applied), (next_scale, _) in zip(lines, lines[1:], strict=False):
        allowed = {int(scale)} if applied == "True" else {int(scale), int(scale) // 2}
        assert int(next_scale) in allowed  # a skip backs off (gradients) or keeps it (the loss)


# ------------------------------------------------------------------ reduce_dtype (issue 17)


def test_float32_reduce_is_bitwise_kerass_own_sum(run):
    assert run["reduce"]["float32"] == run["reduce"]["None"]


@pytest.mark.parametrize("dtype,unit", [("float16", 2.0**-11), ("bfloat16", 2.0**-8)])
def test_half_reduce_stays_within_the_computed_bound(run, dtype, unit):
    # Bound: each replica's share s_r (its local gradient / 2; on a half wire, times the loss
    # scale 1, a power of two: exact) is rounded to the reduce dtype (relative error <= u, the
    # unit roundoff) and the sum of the 2 shares once more, so |fl(sum) - sum| <= gamma_2 *
    # sum |s_r|, gamma_n = n u / (1 - n u) (Higham, eq. 4.4); the float32 shares are within
    # 1e-6 relative. Dense(1) from zeros, loss mean((x.k + b - y)**2) over each replica's 4 rows:
    # local gradient (-(1/2) sum x_i y_i, -(1/2) sum y_i); SGD(1.0): new params = -mean gradient.
    import numpy as np

    x = np.asarray(run["reduce"]["data"]["x"], np.float64)
    y = np.asarray(run["reduce"]["data"]["y"], np.float64)[:, 0]
    shares = []
    for r in range(2):
        xs, ys = x[4 * r : 4 * r + 4], y[4 * r : 4 * r + 4]
        shares.append(np.concatenate([-0.5 * (xs * ys[:, None]).sum(0), [-0.5 * ys.sum()]]) / 2)
    shares = np.stack(shares)
    exact = -shares.sum(0)
    size = np.abs(shares).sum(0)
    bound = 2 * unit / (1 - 2 * unit) * size + 1e-6 * size
    kernel, bias = run["reduce"][dtype]
    assert kernel[0] == kernel[1] and bias[0] == bias[1]  # the replicas agree
    got = np.concatenate([np.asarray(kernel[0])[:, 0], bias[0]])
    assert np.all(np.abs(got - exact) <= bound), (got - exact, bound)
    assert run["reduce"][dtype] != run["reduce"]["float32"]  # the sum really ran in half


def test_float16_reduce_overflow_skips_on_both_replicas(run):
    # the scaled shares 2**20 * 0.1 / 2 fit float16, their sum 104858 does not: inf on both
    r = run["reduce_overflow"]
    assert r["applied"] is False and r["grads_finite"] is False
    assert r["scale_next"] == [524288.0, 524288.0]
    assert r["w"] == [[0.0, 0.0], [0.0, 0.0]]


def test_pure_bfloat16_fit_updates_the_replicas_alike(run):
    # issue 32: the float32 view of a bfloat16 variable still finds the replica's Adam slots
    # (a KeyError 'sequential/dense/kernel/replica_1_...' before); Adam lr 0.1 moved the ones
    r = run["bfloat16_fit"]
    assert r["dtype"] == "bfloat16" and all(map(math.isfinite, r["loss"]))
    w0, w1 = r["w"]
    assert w0 == w1 and all(abs(v - 1.0) > 0.05 for v in sum(w0, []))
