"""Horovod (TensorFlow, Gloo, 2 ranks on the CPU) with unimp's LossScaleOptimizer.

Runs in its own tox env (``horovod``): Horovod 0.28.1 must be built with
``scripts/build_horovod.sh``. Without Horovod the whole module skips with that reason. Each
two-rank case starts ``examples/distributed/horovod_tensorflow.py`` (seed 004's Horovod snippet,
the TensorFlow 2 way) with ``horovodrun -np 2 --gloo``, and compares every step with the same
script's one-process run under MultiWorkerMirroredStrategy, two replicas on two logical CPUs,
replica ``r`` holding rank ``r``'s batch and poison.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.backend("tensorflow")

# without Horovod the module skips with unimp's ImportError, which names the build script
uhvd = pytest.importorskip("unimp.distributed.horovod.tensorflow", exc_type=ImportError)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "distributed" / "horovod_tensorflow.py"
HOROVODRUN = shutil.which("horovodrun", path=str(Path(sys.executable).parent)) or shutil.which("horovodrun")
# rank 1's gradients are inf at step 2 (rank 0's are finite), rank 1's loss is inf at step 5;
# with the example's scale (1024, doubling after 2 finite steps) nothing else overflows
POISON = ("--steps", "8", "--bad-grad-steps", "2", "--bad-loss-steps", "5")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _horovodrun(out: Path, *args: str) -> list[dict]:
    if HOROVODRUN is None:
        pytest.fail("horovod is importable but horovodrun is not on PATH")
    out.mkdir()
    cmd = [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(EXAMPLE),
           "--out", str(out), *args]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[list[dict]]:
    """The one-process MultiWorkerMirroredStrategy run: one list of steps per replica."""
    out = tmp_path_factory.mktemp("reference")
    cmd = [sys.executable, str(EXAMPLE), "--reference", "multiworker", "--out", str(out), *POISON]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "reference.json").read_text())


@pytest.mark.slow
def test_the_reference_skips_both_replicas_when_one_is_poisoned(reference):
    """What the two ranks must reproduce: skips at steps 2 and 5 only, the scale halving at 2
    (one replica's inf gradient) and kept at 5 (one replica's inf loss)."""
    for steps in reference:
        assert [s["applied"] for s in steps] == [True, True, False, True, True, False, True, True]
        assert [s["scale_after"] for s in steps] == [1024, 2048, 1024, 1024, 2048, 2048, 2048, 4096]
    assert reference[0][2]["loss"] < math.inf and reference[1][5]["loss"] == math.inf


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [("--pattern", "optimizer", "--function"), ("--pattern", "tape", "--after-reduce")],
    ids=["optimizer-function", "tape-eager-after-reduce"],
)
def test_two_ranks_agree_with_the_one_process_run_on_every_step(tmp_path, reference, args):
    """Every step's loss (each rank's own), scale before and after, skip and skip count equal
    the reference replica's, bitwise: both ranks skip where only rank 1's gradients (step 2) or
    loss (step 5) were non-finite, and the scale backs off on both at step 2. With
    ``--after-reduce`` rank 1's gradients turn inf after the all-reduce, so rank 0's are finite
    at step 2 and only the all-reduced flags make it skip and back off."""
    ranks = _horovodrun(tmp_path / "out", *POISON, *args)
    for rank, result in enumerate(ranks):
        assert result["warnings"] == []
        assert result["steps"] == reference[rank], f"rank {rank}"


@pytest.mark.slow
def test_fp16_compression_and_a_desynced_rank(tmp_path, reference):
    """unimp's float16 wire (divided by scale x world size in float32 first) with rank 1
    starting from scale 64: both ranks warn, take rank 0's 1024 and skip that step (their
    gradients were scaled differently); from then on they agree, with losses near the float32
    wire's."""
    r0, r1 = _horovodrun(tmp_path / "out", "--steps", "4", "--compression", "fp16", "--desync", "--function")
    for r in (r0, r1):
        assert len(r["warnings"]) == 1 and "ReplicaDesyncWarning" in r["warnings"][0]
        assert "scale in [64, 1024]" in r["warnings"][0]
        assert [s["applied"] for s in r["steps"]] == [False, True, True, True]
        assert [s["scale_after"] for s in r["steps"]] == [1024, 1024, 2048, 2048]
        assert r["steps"][-1]["total_skips"] == 1
    assert r1["steps"][0]["scale_used"] == 64 and r0["steps"][0]["scale_used"] == 1024
    for rank, r in enumerate((r0, r1)):
        # one step behind the reference (step 0 skipped), through the float16 wire
        assert [s["loss"] for s in r["steps"][1:]] == pytest.approx(
            [s["loss"] for s in reference[rank][:3]], rel=1e-3
        )


def test_loss_scale_compression_keeps_the_scale_off_the_wire():
    """Rank 0's scaled gradient 65536 (inf in float16) goes on the wire as
    65536 / (65536 * 2) = 0.5; the sum over the two ranks (0.5 + 1.0) comes back as the mean
    of the scaled gradients, 1.5 * 65536."""
    opt = uhvd.LossScaleOptimizer(keras.optimizers.SGD(0.1), loss_scale=65536.0)
    comp = uhvd.LossScaleCompression(opt, world_size=2)
    wire0, ctx = comp.compress(tf.constant([65536.0]))
    wire1, _ = comp.compress(tf.constant([131072.0]))
    assert wire0.dtype == tf.float16 and float(wire0[0]) == 0.5 and float(wire1[0]) == 1.0
    assert math.isinf(float(tf.cast(tf.constant(65536.0), tf.float16)))  # what hvd.Compression.fp16 sends
    out = comp.decompress(wire0 + wire1, ctx)
    assert out.dtype == tf.float32 and float(out[0]) == 1.5 * 65536
    ints, none = comp.compress(tf.constant([3], tf.int32))
    assert none is None and comp.decompress(ints, none) is ints


def test_hvd_fp16_compression_with_a_loss_scale_is_refused():
    import horovod.tensorflow as hvd

    with pytest.raises(ValueError, match="compression='fp16'"):
        uhvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hvd.Compression.fp16)
    with pytest.raises(ValueError, match="'none', 'fp16'"):
        uhvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="bf16")
    with pytest.raises(ValueError, match="'float16' or 'bfloat16'"):
        uhvd.LossScaleCompression(None, world_size=2, dtype="float32")


def test_distributed_gradient_tape_needs_the_horovod_optimizer():
    from unimp.backends.tensorflow import LossScaleOptimizer

    with tf.GradientTape() as tape:
        pass
    with pytest.raises(TypeError, match=r"uhvd.DistributedOptimizer\(optimizer\)"):
        uhvd.DistributedGradientTape(tape, LossScaleOptimizer(keras.optimizers.SGD(0.1)))


def test_distributed_optimizer_takes_an_unbuilt_loss_scale_optimizer_whole():
    from unimp.backends.tensorflow import LossScaleOptimizer
    from unimp.loss_scale import DynamicLossScale

    cfg = DynamicLossScale(init_scale=256.0, growth_interval=3)
    opt = uhvd.DistributedOptimizer(LossScaleOptimizer(keras.optimizers.SGD(0.1), loss_scale=cfg, update="kahan"))
    assert isinstance(opt, uhvd.LossScaleOptimizer)
    assert opt.loss_scale_config == cfg and opt.update_mode == "kahan"
    assert [v.name for v in opt.loss_scale_state_variables()] == [
        "dynamic_scale", "counter", "consecutive_skips", "total_skips"
    ]
    with pytest.raises(ValueError, match="already all-reduces"):
        uhvd.DistributedOptimizer(opt)
