"""torch backend, ``devices``: version, device parsing and placement, device_info."""


import pytest
import torch

import unimp.backends.torch as ut
from backends.torch.helpers import (
    DEV,
    _loss,
    _mlp,
)
from unimp.attached import peek


@pytest.mark.parametrize("device", ["meta", "cuda"])
def test_device_that_cannot_run_the_dtype_raises(device):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error path needs a device without it")
    with pytest.raises(ValueError, match="cannot run on"):
        ut.MixedPrecision("mixed_float16", device=device)


@pytest.mark.parametrize("recipe", ["mixed_float16", "mixed_bfloat16", "bf16-true"])
def test_cuda_without_cuda_raises(recipe):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error path needs a machine without it")
    with pytest.raises(ValueError, match="CUDA is not available"):
        ut.MixedPrecision(recipe, device="cuda")


@pytest.mark.parametrize("call", ["prepare", "train_step"])
def test_model_on_another_device_type_raises(call):
    mp = ut.MixedPrecision("mixed_bfloat16", device=DEV)
    model = _mlp().to("meta")
    with pytest.raises(ValueError, match="bound to cpu"):
        if call == "prepare":
            mp.prepare(model)
        else:
            mp.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss)
    assert not peek(model, "prepared", False)


def test_bad_device_name_raises():
    with pytest.raises(ValueError, match="not a torch device"):
        ut.MixedPrecision("mixed_float16", device="gpu0")


def test_device_info_lists_cpu_first():
    # the keys and framework_version: tests/conformance/test_backend_api.py
    info = ut.device_info()
    assert info[0]["device"] == "cpu" and info[0]["bfloat16"] is True
    assert info[0]["kind"] == "cpu" and info[0]["recommended"] == "float32"  # core rule: device_support


def test_cuda_device_without_cuda_is_a_value_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        ut.GradScaler(device="cuda")
