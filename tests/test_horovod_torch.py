"""Horovod (torch, Gloo, 2 ranks on the CPU) with unimp's scaler and float16 compression.

Runs in its own tox env (``horovod``): Horovod 0.28.1 must be built with
``scripts/build_horovod.sh``. Without Horovod the whole module skips with that reason. Each
case starts ``examples/distributed/horovod_torch.py`` with ``horovodrun -np 2 --gloo``.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.backend("torch")

# without Horovod the module skips with unimp's ImportError, which names the build script
uhvd = pytest.importorskip("unimp.distributed.horovod.torch", exc_type=ImportError)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "distributed" / "horovod_torch.py"
HOROVODRUN = shutil.which("horovodrun", path=str(Path(sys.executable).parent)) or shutil.which("horovodrun")


def _horovodrun(tmp_path, *args):
    if HOROVODRUN is None:
        pytest.fail("horovod is importable but horovodrun is not on PATH")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(EXAMPLE),
           "--out", str(tmp_path), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_hvd_fp16_compression_with_loss_scale_skips_the_first_step(tmp_path):
    """The failure as seen: Horovod's Compression.fp16 casts the scaled gradients (65536, 131072)."""
    r0, r1 = _horovodrun(tmp_path, "--compression", "hvd-fp16", "--steps", "1")
    for r in (r0, r1):
        assert r[0]["applied"] is False
        assert r[0]["scale_after"] == 32768.0


@pytest.mark.slow
def test_unimp_fp16_compression_applies_the_first_step(tmp_path):
    r0, r1 = _horovodrun(tmp_path, "--compression", "fp16", "--steps", "2")
    for r in (r0, r1):
        assert [s["applied"] for s in r] == [True, True]
        assert r[0]["scale_after"] == 65536.0
    assert r0 == r1  # identical parameters and scale on both ranks
    # mean gradient of out.sum() over x = ones / twos: weight 1.5, bias 1; SGD lr 0.01
    assert r0[0]["params"] != r0[1]["params"]


@pytest.mark.slow
def test_inf_on_one_rank_after_allreduce_skips_on_both(tmp_path):
    r0, r1 = _horovodrun(tmp_path, "--compression", "none", "--steps", "2", "--poison-first-step")
    for r in (r0, r1):
        assert r[0]["applied"] is False and r[0]["scale_after"] == 32768.0
        assert r[1]["applied"] is True
    assert r0 == r1


def test_loss_scale_compression_keeps_the_scale_off_the_wire():
    """Rank 0's scaled weight gradient 65536 (inf in float16) goes on the wire as
    65536 / (65536 * 2) = 0.5; the sum over the two ranks (0.5 + 1.0) comes back as the mean
    of the scaled gradients, 1.5 * 65536."""
    scaler = uhvd.GradScaler(device="cpu")  # torch preset: 65536
    comp = uhvd.LossScaleCompression(scaler, world_size=2)
    wire0, ctx = comp.compress(torch.tensor([65536.0]))
    wire1, _ = comp.compress(torch.tensor([131072.0]))
    assert wire0.dtype == torch.float16 and wire0.item() == 0.5 and wire1.item() == 1.0
    assert torch.tensor([65536.0]).to(torch.float16).isinf().item()  # what hvd.Compression.fp16 sends
    out = comp.decompress(wire0 + wire1, ctx)
    assert out.dtype == torch.float32 and out.item() == 1.5 * 65536


def test_hvd_fp16_compression_with_a_scaler_is_refused():
    import horovod.torch as hvd

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = uhvd.GradScaler(device="cpu")
    with pytest.raises(ValueError, match="compression='fp16'"):
        uhvd.DistributedOptimizer(opt, scaler, model.named_parameters(), compression=hvd.Compression.fp16)
    with pytest.raises(ValueError, match="'none' or 'fp16'"):
        uhvd.DistributedOptimizer(opt, scaler, model.named_parameters(), compression="bf16")


def test_horovod_scaler_refuses_a_torch_process_group():
    with pytest.raises(ValueError, match="Horovod's ranks"):
        uhvd.GradScaler(device="cpu", process_group=object())
