"""torch FP8: :mod:`unimp.fp8`'s scaling and quantize-dequantize rules on device tensors, and
:class:`FP8Dense`, an emulated float8 ``nn.Linear``.

The rule is :func:`unimp.fp8.step_arrays` / :func:`unimp.fp8.qdq_arrays` run on torch tensors
(the array namespace :class:`Fp8Ops`), bit-identical to the NumPy reference, with no host sync.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from unimp import fp8 as _fp8
from unimp.fp8 import FP8State

_FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


#: The float8 rule's scopes open now (``fp8_amax``, ``fp8_scale_update``): torch has no op
#: scopes, so :meth:`Fp8Ops.scope` keeps them here for unimp's dtype trace to read.
SCOPES: list[str] = []


class Fp8Ops:
    """The FP8 rule's array namespace over torch tensors on one device (constants cached)."""

    @staticmethod
    @contextlib.contextmanager
    def scope(name: str) -> Any:
        """Marks the ops run inside as the rule's ``name`` for unimp's dtype trace."""
        SCOPES.append(name)
        try:
            yield
        finally:
            SCOPES.pop()

    where = staticmethod(torch.where)
    isfinite = staticmethod(torch.isfinite)
    isnan = staticmethod(torch.isnan)
    isinf = staticmethod(torch.isinf)
    abs = staticmethod(torch.abs)
    floor = staticmethod(torch.floor)
    log2 = staticmethod(torch.log2)
    exp2 = staticmethod(torch.exp2)

    def __init__(self, device: Any = "cpu") -> None:
        self.device = torch.device(device)
        self._cache: dict[float, torch.Tensor] = {}

    def f32(self, x: Any) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x.to(torch.float32)
        x = float(x)
        if x not in self._cache:
            self._cache[x] = torch.tensor(x, dtype=torch.float32, device=self.device)
        return self._cache[x]

    @staticmethod
    def amax(x: torch.Tensor) -> torch.Tensor:
        return torch.max(x)  # NaN-propagating

    @staticmethod
    def push(history: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        return torch.cat([amax.reshape(1).to(history.dtype), history[:-1]])

    @staticmethod
    def clip(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
        return torch.clamp(x, lo, hi)

    @staticmethod
    def pow2_floor(x: torch.Tensor) -> torch.Tensor:
        return (x.view(torch.int32) & -0x800000).view(torch.float32)

    @staticmethod
    def to_fp8(x: torch.Tensor, dtype: str) -> torch.Tensor:
        return x.to(_FP8_DTYPES[dtype])

    @staticmethod
    def to_f32(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32)

    @staticmethod
    def cast_like(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return x.to(like.dtype)


_OPS: dict[torch.device, Fp8Ops] = {}


def _ops(device: Any) -> Fp8Ops:
    device = torch.device(device)
    if device not in _OPS:
        _OPS[device] = Fp8Ops(device)
    return _OPS[device]


def fp8_initial_state(config: _fp8.Fp8Config, device: Any = "cpu") -> FP8State:
    """Scale 1, zero history: an :class:`unimp.fp8.FP8State` of float32 tensors on ``device``."""
    return fp8_state_from_numpy(FP8State.initial(config), device)


def fp8_state_from_numpy(state: FP8State, device: Any = "cpu") -> FP8State:
    """The same state as float32 tensors on ``device`` (e.g. from :func:`unimp.fp8.from_state_dict`)."""
    return FP8State(
        *(torch.tensor(np.asarray(v, np.float32), device=device) for v in
          (state.scale, state.scale_inv, state.amax_history))
    )


def fp8_state_to_numpy(state: FP8State) -> FP8State:
    """The state as NumPy float32 (for :func:`unimp.fp8.state_dict`); one host copy."""
    return FP8State(*(np.array(v.detach().cpu().numpy(), np.float32, copy=True) for v in
                      (state.scale, state.scale_inv, state.amax_history)))


def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    """``max(abs(x))`` as a float32 0-d tensor (NaN-propagating), on ``x``'s device."""
    return _fp8.amax_of(_ops(x.device), x)


def fp8_step(
    config: _fp8.Fp8Config, state: FP8State, amax: torch.Tensor, role: str = "forward"
) -> tuple[tuple[torch.Tensor, torch.Tensor], FP8State]:
    """One step of :func:`unimp.fp8.step_arrays` on device tensors.

    Returns:
        ``((scale, scale_inv) to quantize this step with, state after the step)``.
    """
    ops = _ops(state.scale.device)
    used, new = _fp8.step_arrays(
        ops, config, role, state.scale, state.scale_inv, state.amax_history, ops.f32(amax)
    )
    return used, FP8State(*new)


def fp8_quantize_dequantize(
    x: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, dtype: str
) -> torch.Tensor:
    """:func:`unimp.fp8.qdq_arrays` on a tensor: same shape and dtype as ``x``."""
    return _fp8.qdq_arrays(_ops(x.device), x, scale, scale_inv, dtype, _fp8.FP8_MAX[dtype])


_TENSORS = ("input", "kernel", "grad")


class _Fp8Matmul(torch.autograd.Function):
    """``y = (Q(x) @ Q(w)^T) * (sx * sw)`` with the output gradient quantized in backward
    (:func:`unimp.fp8.quantize_arrays`); the grad state is stepped and written in place."""

    @staticmethod
    def forward(ctx, x, weight, qx, qw, sinv_x, sinv_w, layer):  # type: ignore[override]
        ctx.save_for_backward(qx, qw, sinv_x, sinv_w)
        ctx.layer = layer
        ctx.out_dtype = x.dtype
        return ((qx @ qw.t()) * (sinv_x * sinv_w)).to(x.dtype)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        qx, qw, sinv_x, sinv_w = ctx.saved_tensors
        layer = ctx.layer
        (sg, sinv_g), new = layer._step("grad", fp8_amax(g), "backward")
        dtype = layer.config.dtype("backward")
        qg = _fp8.quantize_arrays(_ops(g.device), g, sg, dtype, _fp8.FP8_MAX[dtype])
        shape = qg.shape
        qg2 = qg.reshape(-1, shape[-1])
        dx = ((qg2 @ qw) * (sinv_g * sinv_w)).reshape(*shape[:-1], qw.shape[1])
        dw = (qg2.t() @ qx.reshape(-1, qx.shape[-1])) * (sinv_g * sinv_x)
        return dx.to(ctx.out_dtype), dw, None, None, None, None, None


class FP8Dense(torch.nn.Linear):
    """``nn.Linear`` whose matmul is emulated float8 by :mod:`unimp.fp8`'s rule.

    The input and the weight are quantized to the config's forward format with their own
    per-tensor scales, the output gradient to its backward format (e5m2 under ``HYBRID``) in a
    custom autograd Function; the matmul multiplies the float8 values (exact in float32) and
    scales the result once. The scaling states (``<input|kernel|grad>_scale``, ``_scale_inv``,
    ``_amax_history``) are buffers, stepped on the device in training mode (no host sync) and
    saved in ``state_dict``; :meth:`fp8_state` gives them as :class:`unimp.fp8.FP8State` for
    :func:`unimp.fp8.state_dict`. The bias is added in the output dtype. Weights, inputs and
    gradients are emulated on every device (the native ``torch._scaled_mm`` path is not built,
    docs/fp8.md); the first call per device type warns once
    (:class:`unimp.fp8.Fp8EmulationWarning`).

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        config: a :class:`unimp.fp8.DelayedScaling` (default) or
            :class:`unimp.fp8.CurrentScaling`.

    Shapes: input ``(..., in_features)``, output ``(..., out_features)``, input's dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: Any = None, config: _fp8.Fp8Config | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = config if config is not None else _fp8.DelayedScaling()
        for name in _TENSORS:
            init = FP8State.initial(self.config)
            for field in ("scale", "scale_inv", "amax_history"):
                buf = torch.tensor(np.asarray(getattr(init, field)), device=self.weight.device)
                self.register_buffer(f"{name}_{field}", buf)

    def fp8_state(self, name: str) -> FP8State:
        """The state of ``"input"``, ``"kernel"`` or ``"grad"`` (buffers, not copies)."""
        if name not in _TENSORS:
            raise ValueError(f"FP8Dense.fp8_state: name must be one of {list(_TENSORS)}, got {name!r}.")
        return FP8State(*(getattr(self, f"{name}_{f}") for f in ("scale", "scale_inv", "amax_history")))

    def load_fp8_state(self, name: str, state: FP8State) -> None:
        """Copies a (NumPy or tensor, any device) state into the buffers of ``name``, checked
        first against this layer's config (:func:`unimp.fp8.check_state`).

        Raises:
            ValueError: ``name`` is not ``"input"``, ``"kernel"`` or ``"grad"``, or a bad state
                (wrong history length, a scale that is not finite and > 0, ...); nothing is
                changed.
        """
        if name not in _TENSORS:
            raise ValueError(f"FP8Dense.load_fp8_state: name must be one of {list(_TENSORS)}, got {name!r}.")
        fields = ("scale", "scale_inv", "amax_history")
        host = FP8State(*(
            v.detach().cpu() if isinstance(v, torch.Tensor) else v for v in (getattr(state, f) for f in fields)
        ))
        checked = _fp8.check_state(host, self.config, name)
        with torch.no_grad():
            for f in fields:
                getattr(self, f"{name}_{f}").copy_(torch.as_tensor(getattr(checked, f)))

    def _step(self, name: str, amax: torch.Tensor, role: str) -> tuple[Any, FP8State]:
        state = self.fp8_state(name)
        if not self.training and isinstance(self.config, _fp8.DelayedScaling):
            return (state.scale, state.scale_inv), state
        used, new = fp8_step(self.config, state, amax, role)
        used = (used[0].clone(), used[1].clone())  # may be the buffers, overwritten next
        if self.training:
            with torch.no_grad():
                for f in ("scale", "scale_inv", "amax_history"):
                    getattr(self, f"{name}_{f}").copy_(getattr(new, f))
        return used, new

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, config: _fp8.Fp8Config) -> FP8Dense:
        """An FP8Dense sharing ``linear``'s ``weight`` and ``bias`` Parameters (the same
        objects: an optimizer built on the model keeps updating them), with fresh float32
        scaling states on the weight's device and ``linear``'s training flag."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  device="meta", config=config)
        new.weight, new.bias = linear.weight, linear.bias
        for name, buf in list(new.named_buffers(recurse=False)):
            setattr(new, name, torch.zeros(buf.shape, dtype=torch.float32, device=linear.weight.device))
        for name in _TENSORS:
            new.load_fp8_state(name, FP8State.initial(config))
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _fp8.warn_emulated("torch", x.device.type)
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            # as autocast runs a linear: the input in the autocast dtype; the float8 matmul
            # itself runs outside autocast (its float32 accumulation is the rule)
            x = x.to(torch.get_autocast_dtype(device_type))
            with torch.autocast(device_type, enabled=False):
                return self._forward(x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.config.dtype("forward")
        fmax = _fp8.FP8_MAX[dtype]
        ops = _ops(x.device)
        with torch.no_grad():
            (sx, sinv_x), _ = self._step("input", fp8_amax(x), "forward")
            (sw, sinv_w), _ = self._step("kernel", fp8_amax(self.weight), "forward")
            qx = _fp8.quantize_arrays(ops, x, sx, dtype, fmax)
            qw = _fp8.quantize_arrays(ops, self.weight, sw, dtype, fmax)
        y = _Fp8Matmul.apply(x, self.weight, qx, qw, sinv_x, sinv_w, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)



def fp8_model_layers(model: torch.nn.Module) -> list[tuple[str, str]]:
    """``(dotted path, kind)`` of every submodule in definition order, the input of
    :meth:`unimp.fp8.recipe.Fp8Recipe.select` (``nn.Linear`` and its subclasses, FP8Dense
    included, are ``"Linear"``)."""
    return [(name, "Linear" if isinstance(m, torch.nn.Linear) else type(m).__name__)
            for name, m in model.named_modules() if name]


def fp8_swap(model: torch.nn.Module, recipe: Any) -> tuple[str, ...]:
    """Replaces the ``nn.Linear`` modules ``recipe`` (an :class:`unimp.fp8.recipe.Fp8Recipe`)
    selects by :class:`FP8Dense` sharing their Parameters, in place; returns the selected
    paths. Selected layers already FP8Dense are kept; a selected convolution stays as it is
    (float8 convolutions are not built) with a warning naming it."""
    import warnings

    selected = recipe.select(fp8_model_layers(model))
    modules = dict(model.named_modules())
    done = []
    for path in selected:
        layer = modules[path]
        if isinstance(layer, FP8Dense):
            done.append(path)
        elif isinstance(layer, torch.nn.Linear):
            parent, _, attr = path.rpartition(".")
            setattr(modules[parent] if parent else model, attr, FP8Dense.from_linear(layer, recipe.scaling))
            done.append(path)
        else:
            warnings.warn(f"layer {path!r} ({type(layer).__name__}): float8 convolutions are not built; "
                          "it runs in the recipe's compute dtype.", UserWarning, stacklevel=3)
    return tuple(done)
