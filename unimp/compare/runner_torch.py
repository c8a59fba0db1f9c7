"""``unimp compare`` in PyTorch: the shared model, weights and batches through unimp's torch backend."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from unimp.backends import torch as backend
from unimp.compare.run import RunSpec, train_loop


class _Net(torch.nn.Module):
    """mlp or cnn of :mod:`unimp.compare.models`, taking ``(x NHWC, dropout mask)``."""

    def __init__(self, model: str, w: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.kind = model
        t = torch.from_numpy
        if model == "mlp":
            self.l1 = torch.nn.Linear(*w["w1"].shape)
            self.l1.weight.data.copy_(t(w["w1"].T.copy()))
            self.l1.bias.data.copy_(t(w["b1"]))
        else:
            kh, kw, cin, cout = w["k"].shape
            self.conv = torch.nn.Conv2d(cin, cout, (kh, kw), padding="same")
            self.conv.weight.data.copy_(t(w["k"].transpose(3, 2, 0, 1).copy()))
            self.conv.bias.data.copy_(t(w["bk"]))
        self.l2 = torch.nn.Linear(*w["w2"].shape)
        self.l2.weight.data.copy_(t(w["w2"].T.copy()))
        self.l2.bias.data.copy_(t(w["b2"]))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.kind == "mlp":
            h = torch.relu(self.l1(x.flatten(1)))
        else:  # NHWC in, NCHW for torch, back to NHWC so the flatten order matches the others
            h = torch.relu(self.conv(x.permute(0, 3, 1, 2))).permute(0, 2, 3, 1).flatten(1)
        return self.l2(h * mask.to(h.dtype))


def run(spec: RunSpec) -> dict[str, Any]:
    device = torch.device(spec.device)
    mp = backend.MixedPrecision(spec.recipe, device=device)
    model = _Net(spec.model, spec.weights).to(device)
    if spec.optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=spec.lr, eps=1e-8)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=spec.lr)
    prepared = mp.prepare(model, opt)
    model, opt = prepared if isinstance(prepared, tuple) else (prepared, opt)

    def loss_fn(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(b["x"], b["mask"])
        return torch.nn.functional.cross_entropy(logits.float(), b["y"].long())

    step = mp.train_step(model, opt, loss_fn)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    out = train_loop(
        step, spec, lambda b: {k: torch.from_numpy(v).to(device) for k, v in b.items()}
    )
    model.eval()
    with torch.no_grad():
        x = torch.from_numpy(spec.x_test).to(device)
        ones = torch.ones((len(x), spec.batches[0]["mask"].shape[1]), device=device)
        with mp.autocast():
            pred = model(x, ones).float().argmax(1).cpu().numpy()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "framework": "torch",
        "version": backend.framework_version(),
        "device": str(device),
        **out,
        "test_accuracy": float((pred == spec.y_test).mean()),
        "peak_memory_bytes": peak,
    }
