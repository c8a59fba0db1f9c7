"""torch FP8: :mod:`unimp.fp8`'s scaling and quantize-dequantize rules on device tensors, and
:class:`FP8Dense`, an emulated float8 ``nn.Linear``.

The rule is :func:`unimp.fp8.step_arrays` / :func:`unimp.fp8.qdq_arrays` run on torch tensors
(the array namespace :class:`Fp8Ops`), bit-identical to the NumPy reference, with no host sync.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from unimp import fp8 as _fp8
from unimp.fp8 import FP8State

_FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


class Fp8Ops:
    """The FP8 rule's array namespace over torch tensors on one device (constants cached)."""

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
    return FP8State(*(np.asarray(v.detach().cpu().numpy(), np.float32) for v in
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
