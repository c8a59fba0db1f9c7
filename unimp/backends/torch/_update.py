"""The loss-scale update on device tensors: :class:`LossScaleOps`, the array namespace that
:func:`unimp.loss_scale.update_arrays` (the reference) runs on, and the fused path, the rule in
as few torch ops as the common configs allow: torch's ``torch._amp_update_scale_`` plus a
clamp, and the skip counters in place.

The reference stays the path for the configs the fused one cannot follow bit for bit (see
:func:`fused_rule`).

torch only, on purpose: torch runs eagerly, one kernel launch per op, so the rule's ~17 small
ops cost a step real time unless a fused kernel does them; TensorFlow and JAX run the same
:func:`~unimp.loss_scale.update_arrays` inside a traced graph / one XLA program, which fuses it
already, so their ``scaling`` modules need no such path. Split from ``scaling.py`` (the
``GradScaler`` drop-in) to keep both under the layout's size limit. Everything here runs on the device,
in place (tensors handed out earlier and CUDA graphs see the new values), with no host sync.

Why ``_amp_update_scale_`` (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp and
cuda/AmpKernels.cu, ``amp_update_scale_cuda_kernel``) equals the reference for these configs:

* it takes the factors as float64 and multiplies the float32 scale by them in float64, then
  rounds to float32. Given the float32 factor (``float(np.float32(f))``), the float64 product of
  two float32 numbers is exact (48 significant bits), so the one rounding gives the correctly
  rounded float32 product: the reference's ``scale * f32(factor)``. (The config already holds
  float32-rounded factors; with 1.1 unrounded, 3 * 1.1 would give 3.3 instead of 3.3000002.)
* overflow (``found_inf`` nonzero): ``scale * backoff``, counter 0; else the counter counts and,
  on reaching ``growth_interval`` (``==``; the reference's ``>=`` is the same because a valid
  state keeps ``counter < growth_interval``), the scale grows unless the product is inf, and
  the counter restarts at 0.
* the reference floors a backoff at ``min_scale`` and caps a growth at ``max_scale``: one
  ``clamp_`` after the kernel does both, because a valid state keeps the scale inside
  ``[floor, max_scale]`` (every load and override is validated), so the clamp changes nothing
  on the other branches. With a ``max_scale`` the reference caps an inf growth at ``max_scale``
  where torch keeps the scale: the fused path is used only where ``max_scale * growth_factor``
  is finite in float32, so no growth from a scale ``<= max_scale`` is inf.
* a non-finite loss (forward overflow) must leave scale and counter alone: ``found_inf`` is
  then 0 and the counter is first lowered by 1, so the kernel's ``+1`` restores it and it never
  reaches ``growth_interval`` (it is below it before).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from unimp.loss_scale import LossScaleConfig, tracks_extra
from unimp.loss_scale.portable import check_scale_value


class LossScaleOps:
    """The array namespace :func:`unimp.loss_scale.update_arrays` runs on: device tensors.

    Constants are made once per value and cached, so an update issues no host-to-device copy
    after the first one.
    """

    where = staticmethod(torch.where)
    minimum = staticmethod(torch.minimum)
    maximum = staticmethod(torch.maximum)
    isfinite = staticmethod(torch.isfinite)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cache: dict[tuple[Any, torch.dtype], torch.Tensor] = {}

    def _const(self, x: Any, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x.to(dtype)
        key = (x, dtype)
        if key not in self._cache:
            self._cache[key] = torch.tensor(x, dtype=dtype, device=self.device)
        return self._cache[key]

    def f32(self, x: Any) -> torch.Tensor:
        return self._const(float(x) if not isinstance(x, torch.Tensor) else x, torch.float32)

    def f64(self, x: Any) -> torch.Tensor:
        return self._const(float(x), torch.float64)

    def i32(self, x: Any) -> torch.Tensor:
        return self._const(int(x) if not isinstance(x, torch.Tensor) else x, torch.int32)

    @property
    def true(self) -> torch.Tensor:
        """A cached 0-d ``True`` on the device (the loss-finite flag's start value)."""
        return self._const(True, torch.bool)


@functools.lru_cache(maxsize=64)
def fused_rule(config: LossScaleConfig) -> bool:
    """True where :func:`update_in_place` equals :func:`unimp.loss_scale.update_arrays` bit for
    bit: every static config, and dynamic ones without the extra fields' rule (hysteresis, overflow
    tolerance, floor action), without ``delayed_first_growth``, and whose ``max_scale`` (if
    any) times the growth factor is finite in float32.

    Asked on every step: the answer is cached per config (configs are frozen dataclasses)."""
    if not config.dynamic:
        return True
    if tracks_extra(config) or config.delayed_first_growth:
        return False
    if config.max_scale is not None:
        with np.errstate(over="ignore"):
            return bool(np.isfinite(np.float32(config.max_scale) * np.float32(config.growth_factor)))
    return True


def _f32(x: float) -> float:
    """``x`` rounded to float32, as a Python float (what the reference multiplies with)."""
    return float(np.float32(x))


@functools.lru_cache(maxsize=64)
def _kernel_args(config: LossScaleConfig) -> tuple[float, float, int, float, float | None]:
    """``(growth, backoff, interval, floor, max_scale)`` as the fused path passes them: the
    factors and bounds rounded to float32, once per config rather than on every step."""
    hi = None if config.max_scale is None else _f32(config.max_scale)
    return (
        _f32(config.growth_factor), _f32(config.backoff_factor), int(config.growth_interval),
        _f32(config.floor), hi,
    )  # fmt: skip


def update_in_place(
    config: LossScaleConfig,
    scale: torch.Tensor,
    counter: torch.Tensor,
    skips: torch.Tensor,
    consecutive: torch.Tensor,
    *,
    loss_inf: torch.Tensor | None,
    overflow: torch.Tensor | None,
    skipped: torch.Tensor,
    skipped_one: torch.Tensor | None = None,
) -> None:
    """One step of the rule, in place, for a config :func:`fused_rule` accepts.

    Args:
        config: the loss-scale config (static in the call).
        scale: float32 0-d; counter: int32 0-d; skips: int32 ``[consecutive_skips,
            total_skips]`` (the state, changed in place; one tensor, so each counter op and the
            snapshot serve both); consecutive: the 0-d view ``skips[0]`` (made once by the caller:
            indexing is an op too).
        loss_inf: bool or int32 0-d, 1 (True) when the loss was not finite.
        overflow: float32 0-d, nonzero when the loss was finite and a gradient was not (the
            step that backs off).
        skipped: bool or int32 0-d, 1 (True) when the step was skipped (non-finite loss or
            gradients).
        skipped_one: optional int32 ``[skipped, 1]`` (``skipped`` a view of its first element):
            then both counters change in one op, ``skips = skipped + skips * [skipped, 1]``.

    Ops: the skip counters 2 (``skips += skipped``, ``consecutive *= skipped``; 1 with
    ``skipped_one``); a dynamic
    scale 3 more (the counter's forward-overflow correction, the kernel, the clamp), against
    :func:`unimp.loss_scale.update_arrays`'s 17 and 4 copies. A report snapshots the state
    itself (the state changes in place). ``loss_inf`` and ``overflow`` are read only for a
    dynamic scale (None otherwise).
    """
    if config.dynamic:
        growth, backoff, interval, floor, hi = _kernel_args(config)
        counter.add_(loss_inf, alpha=-1)  # a forward overflow: the kernel's +1 gives it back
        torch._amp_update_scale_(scale, counter, overflow, growth, backoff, interval)
        scale.clamp_(floor, hi)
    if skipped_one is not None:  # [s + consecutive * s, s + total]: the same, in one op
        torch.addcmul(skipped, skips, skipped_one, out=skips)
        return
    skips.add_(skipped)  # [consecutive + s, total + s]
    consecutive.mul_(skipped)  # (consecutive + s) * s: consecutive + 1 on a skip, 0 otherwise


def check_new_scale(config: LossScaleConfig, new_scale: float | torch.Tensor) -> float:
    """``GradScaler.update(new_scale)``'s value as a Python float, validated against ``config``
    before anything changes (a tensor is read once on the host: an explicit override is rare,
    and a bad value would poison every later step).

    Raises:
        ValueError: not a number or a one-element floating tensor; outside ``[min_scale,
            max_scale]`` (float32's max without a cap) or not finite; different from a static
            scale (:func:`unimp.loss_scale.portable.check_scale_value`, the loaded states' check).
    """
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or not new_scale.is_floating_point():
            raise ValueError(
                f"new_scale must be a float or a one-element floating tensor, got a "
                f"{new_scale.dtype} tensor of shape {tuple(new_scale.shape)}."
            )
        f = float(new_scale.detach().reshape(()).float().cpu())
    else:
        try:
            f = float(new_scale)
        except (TypeError, ValueError):
            raise ValueError(f"new_scale must be a number, got {new_scale!r}.") from None
    check_scale_value(config, f, "new_scale")
    return f
