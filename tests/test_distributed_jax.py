"""JAX data parallelism under shard_map (issue 8): replicas agree on skip, scale and params.

XLA_FLAGS=--xla_force_host_platform_device_count=4 must be set before jax is imported, so the
scenarios run once in a fresh process (tests/_dist_jax_script.py, ~8 s) and each test checks
one of its results.
"""



import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.backend("jax")

ROOT = pathlib.Path(__file__).parents[1]
SCALE = 65536.0


@pytest.fixture(scope="module")
def run():
    env = {**os.environ, "UNIMP_WORKTREE": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_dist_jax_script.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4
    return out


def test_sharded_inf_on_one_replica_skips_everywhere_and_halves_the_scale(run):
    # 65536, inf in replica 1's local gradient shard only: every replica skips, scale 32768
    r = run["sharded_bad"]
    assert r["applied"] is False and r["grads_finite"] is False
    assert r["scale_next"] == [SCALE / 2] * 4
    assert r["w"] == [0.0] * 4


def test_sharded_next_clean_step_applies_on_every_replica(run):
    r = run["sharded_clean"]
    assert r["applied"] is True and r["scale_next"] == [32768.0] * 4
    assert r["w"] == run["sharded_expected_w"] == [-7.0, -8.0, -9.0, -10.0]


def test_sharded_clipping_uses_the_global_norm_over_all_shards(run):
    r = run["sharded_clip"]
    norm = 294**0.5  # |[7, 8, 9, 10]|, one element per shard
    assert r["grad_norm"] == pytest.approx(norm, rel=1e-6)
    assert r["w"] == pytest.approx([-v / norm for v in (7, 8, 9, 10)], rel=1e-6)


def test_mesh_clipping_uses_the_norm_of_the_all_reduced_gradient(run):
    r = run["dp_clip"]
    norm = 294**0.5  # the mean gradient [7, 8, 9, 10]
    assert r["grad_norm"] == pytest.approx(norm, rel=1e-6)
    expected = pytest.approx([-v / norm for v in (7, 8, 9, 10)], rel=1e-6)
    assert all(w == expected for w in r["w"]) and len({tuple(w) for w in r["w"]}) == 1


def test_mesh_step_forward_overflow_on_one_replica_skips_all_keeps_scale(run):
    r = run["dp_bad"]
    assert r["applied"] is False and r["scale_used"] == SCALE
    assert r["scale_next"] == [SCALE] * 4  # a forward overflow does not lower the scale
    assert r["w"] == [[0.0] * 4] * 4


def test_mesh_step_equals_single_device_step_and_compiles_once(run):
    r = run["dp_clean"]
    assert r["applied"] is True
    assert r["w"] == [r["single_device_w"]] * 4 == [[-3.5, -4.0, -4.5, -5.0]] * 4
    assert r["loss"] == r["single_device_loss"]
    assert r["traces"] == r["traces_after_3"] == 1


def test_optax_loss_scaling_axis_name_inf_on_one_replica(run):
    assert run["optax_bad"] == {"params": [1.0] * 4, "scale_next": [32768.0] * 4, "skips": 1}
    # the next clean step applies the same update on every replica: 1 - 32768 / 32768
    assert run["optax_clean"]["params"] == [0.0] * 4


@pytest.mark.parametrize("mode", ["check_vma_false", "pmap", "vmap"])
def test_untracked_modes_average_gradients_and_agree(run, mode):
    # no variance tracking: the step pmeans the gradients itself; inf on replica 1 only
    bad, clean = run["modes"][mode]
    assert bad == {"w": [[0.0] * 4] * 4, "scale": [32768.0] * 4}
    assert clean["scale"] == [32768.0] * 4
    assert clean["w"] == [run["modes_expected_w"]] * 4 == [[-7.0, -8.0, -9.0, -10.0]] * 4


def test_replicas_with_different_scales_are_resynced_from_replica_0_with_a_warning(run):
    r = run["desync"]
    assert r["warned"] == ["ReplicaDesyncWarning"]
    assert r["scale_used"] == SCALE and r["scale_next"] == [SCALE] * 4
    assert r["w_equal"] is True


def test_mesh_step_resumes_from_a_portable_state_dict(run):
    assert run["resume"] == {"scale_used": 4096.0, "scale_next": [4096.0] * 4}


def test_axis_name_step_without_mesh_refuses_to_run_outside_shard_map():
    import jax.numpy as jnp
    import optax

    import unimp

    mp = unimp.mixed_precision("mixed_float16", backend="jax")
    step = mp.train_step(lambda p, b: jnp.sum(p * b), optax.sgd(1.0), jnp.zeros(2), axis_name="d")
    with pytest.raises(RuntimeError, match="replica_step"):
        step(jnp.ones(2))


def test_mesh_without_axis_name_is_refused():
    import jax
    import jax.numpy as jnp
    import optax

    import unimp

    mp = unimp.mixed_precision("mixed_float16", backend="jax")
    mesh = jax.make_mesh((1,), ("d",))
    with pytest.raises(ValueError, match="axis_name"):
        mp.train_step(lambda p, b: jnp.sum(p * b), optax.sgd(1.0), jnp.zeros(2), mesh=mesh)
    with pytest.raises(ValueError, match="not an axis"):
        mp.train_step(
            lambda p, b: jnp.sum(p * b), optax.sgd(1.0), jnp.zeros(2), mesh=mesh, axis_name="x"
        )


@pytest.mark.slow
def test_example_runs():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "distributed" / "jax_shard_map.py")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("applied True on 4 devices") == 3
    assert "compilations 1" in proc.stdout


def test_mesh_model_state_is_reduced_or_refused(run):
    # batch statistics reduced over the axis: the global mean of the batch, momentum 0.5
    m = run["model_state_mesh"]
    assert m["mean"] == 0.5 * m["total_mean"]
    assert m["per_replica"].startswith("with mesh=, the new model_state must be the same on every")
    assert "BatchNorm(axis_name='d')" in m["per_replica"]


# ------------------------------------------------------------------ reduce_dtype (issue 17)


def _exact_shares(run):
    """Per replica, its share of the mean gradient (its 2-row local gradient / 4), float64: the
    model is w.x + b, loss the mean squared error, params start at 0, so the local gradient
    of rows i is (-sum x_i y_i, -sum y_i) (2 / 2 rows)."""
    import numpy as np

    x = np.asarray(run["reduce"]["data"]["x"], np.float64)
    y = np.asarray(run["reduce"]["data"]["y"], np.float64)
    shares = []
    for r in range(4):
        xs, ys = x[2 * r : 2 * r + 2], y[2 * r : 2 * r + 2]
        shares.append(np.concatenate([-(xs * ys[:, None]).sum(0), [-ys.sum()]]) / 4)
    return np.stack(shares)


@pytest.mark.parametrize("mode", ["vma", "no_vma"])
def test_float32_reduce_is_bitwise_the_float32_reference(run, mode):
    got = run["reduce"][mode]
    assert got["float32"] == got["None"]
    w, b = got["float32"]
    assert len({tuple(r) for r in w}) == 1 and len(set(b)) == 1  # every replica the same


@pytest.mark.parametrize("mode", ["vma", "no_vma"])
@pytest.mark.parametrize("dtype,unit", [("float16", 2.0**-11), ("bfloat16", 2.0**-8)])
def test_half_reduce_stays_within_the_computed_bound(run, mode, dtype, unit):
    # Bound: the all-reduce rounds each replica's share s_r to the reduce dtype (relative error
    # <= u, the unit roundoff: 2**-11 float16, 2**-8 bfloat16) and rounds every partial sum
    # once more; any summation order of n = 4 terms puts at most n roundings on each term, so
    # |fl(sum s_r) - sum s_r| <= gamma_n * sum |s_r|, gamma_n = n u / (1 - n u) (Higham,
    # Accuracy and Stability of Numerical Algorithms, eq. 4.4). The float32 shares themselves
    # are off by ~1e-7 relative: 1e-6 * sum |s_r| covers them. SGD(1.0) from 0: w = -mean grad.
    import numpy as np

    shares = _exact_shares(run)
    exact = -shares.sum(0)
    n = 4
    bound = n * unit / (1 - n * unit) * np.abs(shares).sum(0) + 1e-6 * np.abs(shares).sum(0)
    w, b = run["reduce"][mode][dtype]
    got = np.concatenate([np.asarray(w[0]), [b[0]]])
    assert np.all(np.abs(got - exact) <= bound), (got - exact, bound)
    assert len({tuple(r) for r in w}) == 1  # the replicas agree bitwise
    f32 = np.concatenate([np.asarray(run["reduce"][mode]["float32"][0][0]), [run["reduce"][mode]["float32"][1][0]]])
    assert not np.array_equal(got, f32)  # the reduce really ran in the half dtype


def test_float16_reduce_overflow_skips_on_every_replica(run):
    # every replica's share of the scaled gradient is 65536 > 65504 (float16 max): inf on the
    # wire, the same on every replica, so every replica skips and halves the scale
    r = run["reduce_overflow"]
    assert r["applied"] is False and r["grads_finite"] is False
    assert r["scale_next"] == [32768.0] * 4
    assert r["w"] == [[0.0] * 4] * 4
