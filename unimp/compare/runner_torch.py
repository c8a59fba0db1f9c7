"""``unimp compare`` in PyTorch: the shared model, weights and batches through unimp's torch backend."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from unimp.backends import torch as backend
from unimp.compare.fp8_scales import TENSORS, capture_first, scales_record
from unimp.compare.models import LAYER_NORM_EPS, VIT_HEADS
from unimp.compare.run import RunSpec, test_metrics, train_loop
from unimp.compare.user import user_model


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


def _linear(w: np.ndarray, b: np.ndarray) -> torch.nn.Linear:
    """``nn.Linear`` holding a (in, out) kernel and its bias."""
    layer = torch.nn.Linear(*w.shape)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w.T.copy()))
        layer.bias.copy_(torch.from_numpy(b))
    return layer


def _layer_norm(g: np.ndarray, b: np.ndarray) -> torch.nn.LayerNorm:
    layer = torch.nn.LayerNorm(len(g), eps=LAYER_NORM_EPS)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(g))
        layer.bias.copy_(torch.from_numpy(b))
    return layer


class _Attention(torch.nn.Module):
    """Multi-head self-attention written out: ``softmax(q k^T / sqrt(head_dim)) v``, then ``o``."""

    def __init__(self, w: dict[str, np.ndarray], heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = _linear(w["attn_q_w"], w["attn_q_b"])
        self.k = _linear(w["attn_k_w"], w["attn_k_b"])
        self.v = _linear(w["attn_v_w"], w["attn_v_b"])
        self.o = _linear(w["attn_o_w"], w["attn_o_b"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        hd = d // self.heads

        def split(y: torch.Tensor) -> torch.Tensor:  # (N, T, D) -> (N, heads, T, hd)
            return y.view(n, t, self.heads, hd).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(hd), dim=-1)
        return self.o((att @ v).transpose(1, 2).reshape(n, t, d))


class _MLP(torch.nn.Module):
    def __init__(self, w: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.fc1 = _linear(w["mlp_fc1_w"], w["mlp_fc1_b"])
        self.fc2 = _linear(w["mlp_fc2_w"], w["mlp_fc2_b"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class _ViT(torch.nn.Module):
    """vit of :mod:`unimp.compare.models` (tokens: image rows), taking ``(x NHWC, dropout mask)``."""

    def __init__(self, w: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.emb = _linear(w["emb_w"], w["emb_b"])
        self.pos = torch.nn.Parameter(torch.from_numpy(w["pos"].copy()))
        self.ln1 = _layer_norm(w["ln1_g"], w["ln1_b"])
        self.attn = _Attention(w, VIT_HEADS)
        self.ln2 = _layer_norm(w["ln2_g"], w["ln2_b"])
        self.mlp = _MLP(w)
        self.lnf = _layer_norm(w["lnf_g"], w["lnf_b"])
        self.l2 = _linear(w["w2"], w["b2"])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n, h, wd, c = x.shape
        z = self.emb(x.reshape(n, h, wd * c)) + self.pos
        z = z + self.attn(self.ln1(z))
        z = z + self.mlp(self.ln2(z))
        pooled = self.lnf(z).mean(1)
        return self.l2(pooled * mask.to(pooled.dtype))


def _fp8_scales(model: torch.nn.Module) -> dict[str, dict[str, float]]:
    """``{layer: {tensor: scale}}`` of the FP8Dense modules ``prepare`` put in."""
    return {name: {t: float(getattr(m, f"{t}_scale")) for t in TENSORS}
            for name, m in model.named_modules() if isinstance(m, backend.FP8Dense)}


def probe(model: torch.nn.Module, x: np.ndarray, seed: int) -> np.ndarray:
    """The user's model's outputs for ``x`` in float32, on the CPU, in evaluation mode (the
    shape check of ``--model FILE.py:FUNCTION``, before any training)."""
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(np.ascontiguousarray(x))).float().numpy()


def _user_net(spec: RunSpec) -> torch.nn.Module:
    model, _ = user_model(spec.model, spec.seed)  # the same initial weights as the check's
    return model


def _forward(model: torch.nn.Module, b: dict[str, torch.Tensor], user: bool) -> torch.Tensor:
    return model(b["x"]) if user else model(b["x"], b["mask"])


def loss_of(out: torch.Tensor, y: torch.Tensor, loss: str) -> torch.Tensor:
    """The mean loss of a batch, in float32: softmax cross-entropy of logits and class indices,
    or the mean squared error."""
    if loss == "mse":
        return torch.nn.functional.mse_loss(out.float(), y.float())
    return torch.nn.functional.cross_entropy(out.float(), y.long())


def build(spec: RunSpec) -> tuple[Any, Any, Callable[[dict], Any]]:
    """The bound recipe, the train step and the batch conversion, as :func:`run` uses them.

    Returns:
        ``(mp, step, convert)``.
    """
    device = torch.device(spec.device)
    mp = backend.MixedPrecision(spec.recipe, device=device)
    if spec.user_model:
        net = _user_net(spec)
    else:
        net = _ViT(spec.weights) if spec.model == "vit" else _Net(spec.model, spec.weights)
    model = net.to(device)
    if spec.optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=spec.lr, eps=1e-8)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=spec.lr)
    prepared = mp.prepare(model, opt)
    model, opt = prepared if isinstance(prepared, tuple) else (prepared, opt)

    def loss_fn(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return loss_of(_forward(model, b, spec.user_model), b["y"], spec.loss)

    step = mp.train_step(model, opt, loss_fn, **spec.step_options())
    return mp, step, lambda b: {k: torch.from_numpy(v).to(device) for k, v in b.items()}


def run(spec: RunSpec) -> dict[str, Any]:
    device = torch.device(spec.device)
    mp, step, convert = build(spec)
    model = step.model
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    trace = mp.trace(step, convert(spec.batches[0])) if spec.trace else None
    first = capture_first(spec, lambda: _fp8_scales(model))
    out = train_loop(step, spec, convert)
    fp8 = scales_record(first, _fp8_scales(model)) if spec.recipe.fp8 is not None else None
    model.eval()
    with torch.no_grad():
        x = torch.from_numpy(spec.x_test).to(device)
        ones = torch.ones((len(x), spec.batches[0]["mask"].shape[1]), device=device)
        with mp.autocast():
            out_test = _forward(model, {"x": x, "mask": ones}, spec.user_model).float()
        test = test_metrics(out_test.cpu().numpy(), spec.y_test, spec.loss)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "framework": "torch",
        "version": backend.framework_version(),
        "device": str(device),
        **out,
        **test,
        "peak_memory_bytes": peak,
        "trace": None if trace is None else trace.to_dict(),
        "fp8_scales": fp8,
        "block_layers": list(mp.fp8_layers(model)) if spec.recipe.block is not None else None,
    }
