"""torch overflow detection, on the device, no host sync: ``all_finite`` over a nested structure,
and the train step's overflow flags on its fused path: one reused float32 scratch
``[loss_inf, grads_inf, skip, overflow]``, zeroed by one op, written by torch's check kernels
(:func:`_check_loss` for the loss, ``unscale_`` for the gradients) and one ``lerp``
(:func:`skip_flags`), as the step's report and the fused loss-scale update read them."""

from __future__ import annotations

from typing import Any

import torch

from unimp.backends.torch.casting import _leaves
from unimp.backends.torch.devices import _to


def all_finite(tree: Any) -> torch.Tensor:
    """A 0-d bool tensor, on the first floating leaf's device: every floating element is finite.

    Does not synchronize with the device (``bool()`` of the result does). A tree without
    floating tensors gives ``True`` on the CPU.
    """
    flags = [torch.isfinite(t).all() for t in _leaves(tree) if t.is_floating_point()]
    if not flags:
        return torch.tensor(True)
    dev = flags[0].device
    return torch.stack([_to(f, dev) for f in flags]).all()


def _scratch(sc: Any) -> dict[str, Any]:
    """The scaler's scratch dict (never pickled: see ``GradScaler.__getstate__``)."""
    return sc.__dict__.setdefault("_scratch", {})


def step_flags(sc: Any) -> tuple[torch.Tensor, ...]:
    """``(loss_inf, grads_inf, skip, overflow)``: 0-d float32 views of the scaler's flag scratch,
    zeroed (one op; the views are made once)."""
    views = _scratch(sc).get("flag_views")
    if views is None:
        flags = sc._buffer("flags", (4,))
        end = torch.tensor([1.0, 0.0], dtype=torch.float32, device=sc.device)
        views = _scratch(sc)["flag_views"] = (*flags.unbind(), flags[:3], flags[2:], end)
    sc._buffer("flags", (4,)).zero_()
    return views[:4]


def skip_flags(sc: Any) -> None:
    """Writes ``skip = max(loss_inf, grads_inf)`` (exactly 1.0 or 0.0: torch's fused optimizers
    skip on ``found_inf == 1`` only) and ``overflow = grads_inf and not loss_inf`` (the backoff
    flag: finite loss, non-finite gradients) in one op: ``lerp(grads_inf, [1, 0], loss_inf)``
    is ``[grads_inf, grads_inf]`` for a finite loss and ``[1, 0]`` for a non-finite one (a
    weight of exactly 0 or 1 gives the start or the end exactly)."""
    loss_inf, grads_inf, _, _, _, skip_overflow, end = _scratch(sc)["flag_views"]
    torch.lerp(grads_inf, end, loss_inf, out=skip_overflow)


def _check_loss(loss: torch.Tensor, loss_inf: torch.Tensor, one: torch.Tensor) -> None:
    """Sets ``loss_inf`` (float32 0-d, the scaler's device) to 1 when ``loss`` is not finite, with
    torch's check kernel (one op; it multiplies ``loss`` by ``one`` in place, which changes no
    value); through a scratch on the loss's device when that is another one."""
    if loss.device == loss_inf.device:
        torch._amp_foreach_non_finite_check_and_unscale_([loss], loss_inf, one)
    else:
        here = torch.zeros((), dtype=torch.float32, device=loss.device)
        torch._amp_foreach_non_finite_check_and_unscale_([loss], here, _to(one, loss.device))
        torch.maximum(loss_inf, _to(here, loss_inf.device), out=loss_inf)


def flags_from_bools(grads_finite: torch.Tensor, loss_finite: torch.Tensor, out: torch.Tensor) -> Any:
    """``(overflow, skipped, loss_inf)`` for :func:`update_in_place` from the two finite flags
    (bool 0-d); ``overflow`` is written into ``out`` (float32 0-d)."""
    torch.gt(loss_finite, grads_finite, out=out)  # finite loss, non-finite gradients
    return out, (grads_finite & loss_finite).logical_not(), loss_finite.logical_not()
