"""JAX data parallelism under shard_map (issue 8): replicas agree on skip, scale and params.

XLA_FLAGS=--xla_force_host_platform_device_count=4 must be set before jax is imported, so the
scenarios run once in a fresh process (tests/_dist_jax_script.py, ~8 s) and each test checks
one of its results.
"""

from conftest import require_backend

ujax = require_backend("jax")

import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

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
