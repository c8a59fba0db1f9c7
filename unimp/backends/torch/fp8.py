"""torch FP8: :mod:`unimp.fp8`'s scaling and quantize-dequantize rules on device tensors, and
:class:`FP8Dense`, a float8 ``nn.Linear``: emulated by default, with an opt-in native path
through ``torch._scaled_mm`` where it runs (:func:`native_fp8_supported`).

The rule is :func:`unimp.fp8.step_arrays` / :func:`unimp.fp8.qdq_arrays` run on torch tensors
(the array namespace :class:`FP8Ops`), bit-identical to the NumPy reference, with no host sync.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import numpy as np
import torch

from unimp import fp8 as _fp8
from unimp.dtypes import device_support
from unimp.fp8 import FP8State

_FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


#: The float8 rule's scopes open now (``fp8_amax``, ``fp8_scale_update``): torch has no op
#: scopes, so :meth:`FP8Ops.scope` keeps them here for unimp's dtype trace to read.
SCOPES: list[str] = []


class FP8Ops:
    """The FP8 rule's array namespace over torch tensors on one device (constants cached);
    :meth:`on` gives the one instance per device."""

    @staticmethod
    def on(device: Any) -> FP8Ops:
        """The namespace for ``device`` (a ``torch.device`` or its name), made once per device
        and kept, so its cached constants are made once too."""
        device = torch.device(device)
        if device not in _OPS:
            _OPS[device] = FP8Ops(device)
        return _OPS[device]

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
        self._cache: dict[Any, torch.Tensor] = {}

    def f32(self, x: Any) -> torch.Tensor:
        """``x`` (a tensor, a Python number or a NumPy array of constants) as float32 on the
        namespace's device; constants are made once and kept."""
        if isinstance(x, torch.Tensor):
            return x.to(torch.float32)
        if isinstance(x, np.ndarray):  # e.g. the random Hadamard transform's signs
            key = (x.shape, np.asarray(x, np.float32).tobytes())
            if key not in self._cache:
                self._cache[key] = torch.tensor(np.asarray(x, np.float32), device=self.device)
            return self._cache[key]
        # keyed by the float32 bits: a NaN key never equals itself (a new entry per call), and
        # 0.0 == -0.0 would hand one for the other
        key = int(np.float32(x).view(np.uint32))
        if key not in self._cache:
            self._cache[key] = torch.tensor(float(x), dtype=torch.float32, device=self.device)
        return self._cache[key]

    def reciprocal(self, x: torch.Tensor) -> torch.Tensor:
        # torch keeps subnormals (unless torch.set_flush_denormal(True)): IEEE 1 / x
        return self.f32(1.0) / x

    @staticmethod
    def bits(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32).view(torch.int32)

    @staticmethod
    def from_bits(b: torch.Tensor) -> torch.Tensor:
        return b.to(torch.int32).view(torch.float32)

    @staticmethod
    def to_i32(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.int32)

    @staticmethod
    def amax(x: torch.Tensor) -> torch.Tensor:
        # NaN-propagating; 0 over no element, as the reference (torch.max raises on an empty
        # tensor; numel is host metadata, so this is no sync)
        return torch.max(x) if x.numel() else x.new_zeros(())

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
    def round_fp8(x: torch.Tensor, dtype: str) -> torch.Tensor:
        return x.to(_FP8_DTYPES[dtype]).to(torch.float32)  # eager: every cast runs

    @staticmethod
    def cast_like(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return x.to(like.dtype)

    # the block-scaled formats' names (unimp.blockscale)
    @staticmethod
    def round(x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)  # half to even

    @staticmethod
    def reshape(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.reshape(x, shape)

    @staticmethod
    def amax_axes(x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        return torch.amax(x, dim=tuple(axes), keepdim=True)  # NaN-propagating

    @staticmethod
    def sum(x: torch.Tensor) -> torch.Tensor:
        return torch.sum(x)

    @staticmethod
    def concat(xs: Any, axis: int) -> torch.Tensor:
        return torch.cat(xs, dim=axis)


_OPS: dict[torch.device, FP8Ops] = {}


def fp8_initial_state(config: _fp8.FP8Config, device: Any = "cpu") -> FP8State:
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


def fp8_amax(x: torch.Tensor, config: _fp8.FP8Config | None = None) -> torch.Tensor:
    """``max(abs(x))`` as a float32 0-d tensor (NaN-propagating; NaN elements ignored under the ``transformer_engine`` rule of ``config``, as :func:`unimp.fp8.amax_of`), on ``x``'s device."""
    return _fp8.amax_of(FP8Ops.on(x.device), x, config)


def fp8_step(
    config: _fp8.FP8Config, state: FP8State, amax: torch.Tensor, role: str = "forward"
) -> tuple[tuple[torch.Tensor, torch.Tensor], FP8State]:
    """One step of :func:`unimp.fp8.step_arrays` on device tensors.

    Returns:
        ``((scale, scale_inv) to quantize this step with, state after the step)``.
    """
    ops = FP8Ops.on(state.scale.device)
    used, new = _fp8.step_arrays(
        ops, config, role, state.scale, state.scale_inv, state.amax_history, ops.f32(amax)
    )
    return used, FP8State(*new)


def fp8_quantize_dequantize(
    x: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, dtype: str
) -> torch.Tensor:
    """:func:`unimp.fp8.qdq_arrays` on a tensor: same shape and dtype as ``x``."""
    return _fp8.qdq_arrays(FP8Ops.on(x.device), x, scale, scale_inv, dtype, _fp8.FP8_MAX[dtype])


_TENSORS, _FIELDS = _fp8.LAYER_TENSORS, _fp8.STATE_FIELDS

#: The switch (``UNIMP_FP8_NATIVE``), the shape rule and the fallback warning are the core's
#: (:mod:`unimp.fp8`), shared with Keras and JAX. torch's kernel rule behind the shape rule:
#: torch 2.13 ``_meta_registrations.py`` ``_check_scaled_mm_sizes``, CUDA and XPU: "Expected
#: self.size(1) to be divisible by 16", "Expected both dimensions of mat2 to be divisible by 16".
NATIVE_ENV, NATIVE_MULTIPLE = _fp8.NATIVE_ENV, _fp8.NATIVE_MULTIPLE
FP8NativeFallbackWarning = _fp8.FP8NativeFallbackWarning


_NATIVE_PROBED: dict[tuple[str, int | None], bool] = {}


def native_fp8_supported(device: Any) -> bool:
    """Whether ``torch._scaled_mm`` runs on ``device``: probed once per device (a CUDA GPU of
    compute capability 8.9 or later, which has float8 units; or a device type, the CPU in
    torch 2.13, where the op is implemented), cached, never per step."""
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    key = (device.type, index)
    if key not in _NATIVE_PROBED:
        ok = hasattr(torch, "_scaled_mm")
        if ok and device.type == "cuda":
            ok = bool(device_support("gpu", torch.cuda.get_device_capability(index))["float8"])
        if ok:
            try:
                a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
                one = torch.ones((), device=device)
                torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _NATIVE_PROBED[key] = ok
    return _NATIVE_PROBED[key]


def _has_float8_units(device: torch.device) -> bool:
    return device.type == "cuda" and native_fp8_supported(device)


def _native_matmul(a: torch.Tensor, a_fmt: str, b_rows: torch.Tensor, b_fmt: str) -> torch.Tensor:
    """``a @ b_rows^T`` by the native float8 GEMM with unit scales, as float32.

    ``a`` ``(M, K)`` and ``b_rows`` ``(N, K)`` are float32 holding values of the float8 formats
    ``a_fmt`` / ``b_fmt`` (the casts are exact); ``K`` is zero-padded to a multiple of 16, as
    the kernel needs (exact: the added products are 0); ``b`` goes in column-major, as
    ``_scaled_mm`` takes it.
    """
    pad = -a.shape[1] % NATIVE_MULTIPLE
    if pad:
        a = torch.nn.functional.pad(a, (0, pad))
        b_rows = torch.nn.functional.pad(b_rows, (0, pad))
    a8 = a.to(_FP8_DTYPES[a_fmt]).contiguous()
    b8 = b_rows.to(_FP8_DTYPES[b_fmt]).contiguous()
    one = FP8Ops.on(a.device).f32(1.0)
    return torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)


class _Fp8Matmul(torch.autograd.Function):
    """``y = (Q(x) @ Q(w)^T) * (sx * sw)`` with the output gradient quantized in backward
    (:func:`unimp.fp8.quantize_arrays`); the grad state is stepped and written in place.

    With ``native`` the three GEMMs run as ``torch._scaled_mm`` on the float8 values with unit
    scales, and the float32 result is scaled by the same ``sx * sw`` product as the emulated
    rule: only the accumulation order can differ (docs/fp8.md)."""

    @staticmethod
    def forward(ctx, x, weight, qx, qw, sinv_x, sinv_w, layer, native):  # type: ignore[override]
        ctx.save_for_backward(qx, qw, sinv_x, sinv_w)
        ctx.layer = layer
        ctx.native = native
        ctx.out_dtype = x.dtype
        fmt = layer.config.dtype("forward")
        if native:
            acc = _native_matmul(qx.reshape(-1, qx.shape[-1]), fmt, qw, fmt)
            acc = acc.reshape(*qx.shape[:-1], qw.shape[0])
        else:
            acc = qx @ qw.t()
        return (acc * (sinv_x * sinv_w)).to(x.dtype)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        # outside autocast, as the forward's matmul ran (torch.amp.custom_bwd's rule): a
        # backward called inside the user's own autocast block would otherwise run these
        # float32 GEMMs of the float8 values in the autocast dtype
        with torch.autocast(g.device.type, enabled=False):
            return _Fp8Matmul._backward(ctx, g)

    @staticmethod
    def _backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        qx, qw, sinv_x, sinv_w = ctx.saved_tensors
        layer = ctx.layer
        (sg, sinv_g), new = layer._step("grad", fp8_amax(g, layer.config), "backward")
        dtype = layer.config.dtype("backward")
        fwd = layer.config.dtype("forward")
        qg = _fp8.quantize_arrays(FP8Ops.on(g.device), g, sg, dtype, _fp8.FP8_MAX[dtype])
        shape = qg.shape
        qg2 = qg.reshape(-1, shape[-1])
        qx2 = qx.reshape(-1, qx.shape[-1])
        native = ctx.native and layer._native_refused is None
        if native:  # the gradient (e5m2 under HYBRID) is the first operand of both GEMMs
            try:
                dx_acc = _native_matmul(qg2, dtype, qw.t(), fwd)
                dw_acc = _native_matmul(qg2.t(), dtype, qx2.t(), fwd)
            except RuntimeError as err:
                layer._refuse_native(f"torch._scaled_mm raised in backward: {err}")
                native = False
        if not native:
            dx_acc, dw_acc = qg2 @ qw, qg2.t() @ qx2
        dx = (dx_acc * (sinv_g * sinv_w)).reshape(*shape[:-1], qw.shape[1])
        dw = dw_acc * (sinv_g * sinv_x)
        return dx.to(ctx.out_dtype), dw, None, None, None, None, None, None


class FP8Dense(torch.nn.Linear):
    """``nn.Linear`` whose matmul is emulated float8 by :mod:`unimp.fp8`'s rule.

    The input and the weight are quantized to the config's forward format with their own
    per-tensor scales, the output gradient to its backward format (e5m2 under ``HYBRID``) in a
    custom autograd Function; the matmul multiplies the float8 values (exact in float32) and
    scales the result once. The scaling states (``<input|kernel|grad>_scale``, ``_scale_inv``,
    ``_amax_history``) are buffers, stepped on the device in training mode (no host sync) and
    saved in ``state_dict``; :meth:`fp8_state` gives them as :class:`unimp.fp8.FP8State` for
    :func:`unimp.fp8.state_dict`. The bias is added in the output dtype.

    The matmuls are emulated (float32 GEMMs of the float8 values) unless ``native``: then, on a
    device where ``torch._scaled_mm`` runs (:func:`native_fp8_supported`: CUDA sm89+, or the
    CPU), the forward and both backward GEMMs run as ``torch._scaled_mm`` (e4m3 x e4m3, and
    e5m2 x e4m3 for the gradient under ``HYBRID``) with unit scales, and the float32 result is
    scaled as the emulated rule scales it. The quantized values, the scales and the states are
    the same; the accumulation order is the kernel's, so the result is not bit-identical to the
    emulated one (measured on CPU, docs/fp8.md): the emulated path stays the default, and
    frameworks bit-identical. A layer whose ``in_features`` or ``out_features`` is not a
    multiple of 16 (the kernel's rule, :data:`NATIVE_MULTIPLE`), or whose native GEMM raises,
    runs emulated with one :class:`FP8NativeFallbackWarning` naming it. On a device without
    float8 units (anything but CUDA sm89+) the first call per device type warns once
    (:class:`unimp.fp8.FP8EmulationWarning`), native or not.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        config: a :class:`unimp.fp8.DelayedScaling` (default) or
            :class:`unimp.fp8.CurrentScaling`.
        native: use ``torch._scaled_mm`` where it runs; ``None`` (default) reads the
            environment variable ``UNIMP_FP8_NATIVE`` at construction (``"1"``: on; unset or
            anything else: off), so recipe-built layers (``mp.prepare``) can opt in.
        name: the layer's name in warnings (``mp.prepare`` passes its dotted path); default
            ``FP8Dense(in_features, out_features)``.

    Shapes: input ``(..., in_features)``, output ``(..., out_features)``, input's dtype.

    Calling it with a tensor that is not floating point (integers, bools) raises a TypeError,
    as ``nn.Linear`` refuses one (:func:`unimp.fp8.refuse_non_float`).

    Raises:
        TypeError: ``in_features`` / ``out_features`` not an int (``2.7``, ``"4"``), ``bias``
            not True or False, ``config`` not a DelayedScaling / CurrentScaling (a preset
            name: use :func:`unimp.fp8.fp8_preset`), ``native`` not True, False or None (the
            field named).
        ValueError: a size below 1.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: Any = None, config: _fp8.FP8Config | None = None, native: bool | None = None,
                 name: str | None = None) -> None:
        in_features = _fp8.layer_size(in_features, "in_features", "FP8Dense")
        out_features = _fp8.layer_size(out_features, "out_features", "FP8Dense")
        bias = _fp8.layer_flag(bias, "bias", "FP8Dense")
        config = _fp8.layer_config(config, "FP8Dense")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = config
        self.native = _fp8.native_requested(native, "FP8Dense")
        self.fp8_name = name if name is not None else f"FP8Dense({in_features}, {out_features})"
        self._native_refused: str | None = None  # why this layer runs emulated though native
        for name in _TENSORS:
            init = FP8State.initial(self.config)
            for field in _FIELDS:
                buf = torch.tensor(np.asarray(getattr(init, field)), device=self.weight.device)
                self.register_buffer(f"{name}_{field}", buf)

    def fp8_state(self, name: str) -> FP8State:
        """The state of ``"input"``, ``"kernel"`` or ``"grad"`` (buffers, not copies)."""
        _fp8.check_tensor(name, "FP8Dense.fp8_state")
        return FP8State(*(getattr(self, f"{name}_{f}") for f in _FIELDS))

    def load_fp8_state(self, name: str, state: FP8State | dict[str, Any]) -> None:
        """Copies a (NumPy or tensor, any device) state, or its ``to_dict()``, into the buffers
        of ``name``, checked first against this layer's config (:func:`unimp.fp8.check_state`).

        Raises:
            TypeError: ``state`` neither an FP8State nor a dict (:meth:`unimp.fp8.FP8State.coerce`).
            ValueError: ``name`` is not ``"input"``, ``"kernel"`` or ``"grad"``, or a bad state
                (wrong history length, a scale that is not finite and > 0, ...); nothing is
                changed.
        """
        _fp8.check_tensor(name, "FP8Dense.load_fp8_state")
        fields = _FIELDS
        state = FP8State.coerce(state, "FP8Dense.load_fp8_state")
        host = FP8State(*(
            v.detach().cpu() if isinstance(v, torch.Tensor) else v for v in (getattr(state, f) for f in fields)
        ))
        checked = _fp8.check_state(host, self.config, name)
        with torch.no_grad():
            for f in fields:
                getattr(self, f"{name}_{f}").copy_(torch.as_tensor(getattr(checked, f)))

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """``load_state_dict``'s per-module loader: the scaling states it brings are checked as
        :meth:`load_fp8_state` checks them (Keras's FP8Dense checks its loaders the same way);
        a bad one is an error of ``load_state_dict`` (torch's ``error_msgs``) and this layer
        loads nothing."""
        for name in _TENSORS:
            keys = [f"{prefix}{name}_{f}" for f in _FIELDS]
            if all(k in state_dict for k in keys):
                host = FP8State(*(
                    v.detach().cpu() if isinstance(v, torch.Tensor) else v for v in (state_dict[k] for k in keys)
                ))
                try:
                    _fp8.check_state(host, self.config, name)
                except ValueError as e:
                    error_msgs.append(f"{prefix or 'FP8Dense'}: {e}")
                    return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def _step(self, name: str, amax: torch.Tensor, role: str) -> tuple[Any, FP8State]:
        state = self.fp8_state(name)
        if not self.training and isinstance(self.config, _fp8.DelayedScaling):
            return (state.scale, state.scale_inv), state
        used, new = fp8_step(self.config, state, amax, role)
        used = (used[0].clone(), used[1].clone())  # may be the buffers, overwritten next
        window = self.__dict__.get("_window")
        if self.training and window is not None:  # accumulating: one step per window (fp8_window)
            window[name] = _fp8.window_merge(FP8Ops.on(amax.device), window.get(name), new, amax)
        elif self.training:
            with torch.no_grad():
                for f in _FIELDS:
                    getattr(self, f"{name}_{f}").copy_(getattr(new, f))
        return used, new

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, config: _fp8.FP8Config, native: bool | None = None,
                    name: str | None = None) -> FP8Dense:
        """An FP8Dense sharing ``linear``'s ``weight`` and ``bias`` Parameters (the same
        objects: an optimizer built on the model keeps updating them), with fresh float32
        scaling states on the weight's device and ``linear``'s training flag (``native`` and
        ``name`` as in the constructor)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  device="meta", config=config, native=native, name=name)
        new.weight, new.bias = linear.weight, linear.bias
        for name, buf in list(new.named_buffers(recurse=False)):
            setattr(new, name, torch.zeros(buf.shape, dtype=torch.float32, device=linear.weight.device))
        for name in _TENSORS:
            new.load_fp8_state(name, FP8State.initial(config))
        new.train(linear.training)
        return new

    def _use_native(self, device: torch.device) -> bool:
        """Whether this call runs ``torch._scaled_mm``; a refusal is decided (and warned)
        once per layer, from its dimensions, the same on every device."""
        if not self.native or self._native_refused is not None or not native_fp8_supported(device):
            return False
        why = _fp8.native_refusal(self.in_features, self.out_features, "torch._scaled_mm")
        if why is not None:
            self._refuse_native(why)
            return False
        return True

    def _refuse_native(self, why: str) -> None:
        self._native_refused = why
        _fp8.warn_native_fallback("torch", self.fp8_name, why)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():  # nn.Linear refuses it too (mat1 and mat2 dtypes differ)
            _fp8.refuse_non_float(x.dtype, f"FP8Dense {self.fp8_name!r}",
                                  "cast the input to a float dtype (x.float()), as nn.Linear needs")
        if not _has_float8_units(x.device) or not self._use_native(x.device):
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
        ops = FP8Ops.on(x.device)
        with torch.no_grad():
            (sx, sinv_x), _ = self._step("input", fp8_amax(x, self.config), "forward")
            (sw, sinv_w), _ = self._step("kernel", fp8_amax(self.weight, self.config), "forward")
            qx = _fp8.quantize_arrays(ops, x, sx, dtype, fmax)
            qw = _fp8.quantize_arrays(ops, self.weight, sw, dtype, fmax)
        native = self._use_native(x.device)
        try:
            y = _Fp8Matmul.apply(x, self.weight, qx, qw, sinv_x, sinv_w, self, native)
        except RuntimeError as err:
            if not native:
                raise
            self._refuse_native(f"torch._scaled_mm raised: {err}")
            y = _Fp8Matmul.apply(x, self.weight, qx, qw, sinv_x, sinv_w, self, False)
        return y if self.bias is None else y + self.bias.to(y.dtype)



def fp8_model_layers(model: torch.nn.Module) -> list[tuple[str, str]]:
    """``(dotted path, kind)`` of every submodule in definition order, the input of
    :meth:`unimp.fp8.recipe.FP8Recipe.select` (``nn.Linear`` and its subclasses, FP8Dense
    included, are ``"Linear"``)."""
    return [(name, "Linear" if isinstance(m, torch.nn.Linear) else type(m).__name__)
            for name, m in model.named_modules() if name]


def fp8_select(model: torch.nn.Module, recipe: Any) -> tuple[str, ...]:
    """The paths ``recipe`` selects in ``model`` (:meth:`unimp.fp8.recipe.FP8Recipe.select`);
    a selected module reachable at several paths (``nn.Sequential(a, l, l, b)``) is refused
    (:func:`unimp.fp8.recipe.refuse_shared`).

    Raises:
        ValueError: a shared selected module, named with its paths.
    """
    from unimp.fp8.recipe import refuse_shared

    selected = recipe.select(fp8_model_layers(model))
    paths: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if name:
            paths.setdefault(id(m), []).append(name)
    refuse_shared(selected, {p[0]: p for p in paths.values() if len(p) > 1})
    return selected


def fp8_swap(model: torch.nn.Module, recipe: Any) -> tuple[str, ...]:
    """Replaces the ``nn.Linear`` modules ``recipe`` (an :class:`unimp.fp8.recipe.FP8Recipe`)
    selects by :class:`FP8Dense` sharing their Parameters, in place (named by their paths in
    warnings; native per ``UNIMP_FP8_NATIVE``); returns the selected paths. Selected layers already FP8Dense are kept; a selected convolution stays as it is
    (float8 convolutions are not built) with a warning naming it.

    Raises:
        ValueError: a selected module reachable at several paths (:func:`fp8_select`);
            nothing is swapped.
    """
    selected = fp8_select(model, recipe)
    modules = dict(model.named_modules())
    done = []
    for path in selected:
        layer = modules[path]
        if isinstance(layer, FP8Dense):
            done.append(path)
        elif isinstance(layer, torch.nn.Linear):
            parent, _, attr = path.rpartition(".")
            new = FP8Dense.from_linear(layer, recipe.scaling, name=path)
            setattr(modules[parent] if parent else model, attr, new)
            done.append(path)
        else:
            warnings.warn(f"layer {path!r} ({type(layer).__name__}): float8 convolutions are not built; "
                          "it runs in the recipe's compute dtype.", UserWarning, stacklevel=3)
    return tuple(done)


@contextlib.contextmanager
def fp8_window(model: torch.nn.Module) -> Any:
    """A gradient-accumulation window over the :class:`FP8Dense` layers of ``model``: every
    micro-batch run inside quantizes with the states as they are, and on leaving (without an
    error) each tensor's state takes one step, the rule run on the window's largest amax
    (:func:`unimp.fp8.window_merge`, the convention of every backend; TensorFlow's
    ``fp8_window`` is the same). On an error the states stay as they were. The train step
    opens one around its micro-batches."""
    layers = [m for m in model.modules() if isinstance(m, FP8Dense)]
    for m in layers:
        m.__dict__["_window"] = {}
    try:
        yield
        windows = [(m, m.__dict__.get("_window") or {}) for m in layers]
    finally:
        for m in layers:
            m.__dict__.pop("_window", None)
    with torch.no_grad():
        for m, window in windows:
            for name, (state, _) in window.items():
                for f in _FIELDS:
                    getattr(m, f"{name}_{f}").copy_(getattr(state, f))
