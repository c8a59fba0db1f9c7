"""Helpers shared by the torch backend's test files (models, losses, batches, bitwise checks)."""



import copy

import torch

# These tests build their tensors on the CPU; the backend itself takes the device from the user.
DEV = "cpu"


HALF = ["float16", "bfloat16"]


MIXED = {"float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}


class _InfGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``inf`` when ``bad`` (an overflow
    in the backward pass with a finite loss)."""

    @staticmethod
    def forward(ctx, x, bad):
        ctx.bad = bad
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (g * float("inf") if ctx.bad else g), None


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )


def _loss(model, batch):
    x, y, bad = batch
    return torch.nn.functional.cross_entropy(_InfGrad.apply(model(x), bad), y)


def _batch(seed, bad=False, n=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g), bad


def _state_copy(opt):
    return {k: {n: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v)) for n, v in s.items()}
            for k, s in opt.state.items()}


def _assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


SKIP_OPTS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5),
    "sgd_plain": lambda p: torch.optim.SGD(p, lr=0.1),  # keeps no state at all
}
