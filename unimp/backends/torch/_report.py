"""The torch train step's flags and report on the fused path: one reused float32 flag scratch,
and one packed int32 snapshot per step from which every reported flag and counter is derived
only when it is read.

Per step (torch ops): the scratch's ``zero_``; the check kernels write ``loss_inf`` and
``grads_inf``; :func:`skip_flags` writes ``skip`` and ``overflow`` (one ``lerp``);
:func:`snapshot` then issues ``ne`` (the three flags as int32, which the in-place
skip counters, one ``addcmul`` with ``[skip, 1]``, and the counter's forward-overflow
correction take) and one ``cat``, the report:
``[scale bits, consecutive_skips, total_skips, loss_inf, grads_inf, skip]`` before the update,
the scale as its float32 bit pattern (a view: exact). The values after the update are derived
on the host as the rule defines them (``unimp.loss_scale.update_arrays``): ``applied = not
skip``, ``consecutive_skips = (consecutive + skip) * skip``, ``total_skips = total + skip``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__: list[str] = []


def _to_host(x: Any) -> Any:
    """A step value on the host: a tensor's (or a :class:`_Field`'s) ``item()``; else ``x``."""
    return x.item() if isinstance(x, (torch.Tensor, _Field)) else x


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


def snapshot(sc: Any) -> tuple[dict[str, _Field], tuple[torch.Tensor, ...]]:
    """The step's report (two ops: ``ne`` and ``cat``), taken after the step's flags are
    written and before the loss-scale update.

    Returns:
        ``(fields, (loss_inf, skip, skip_one))``: the report's fields (``scale``,
        ``applied``, ``loss_finite``, ``grads_finite``, ``consecutive_skips``,
        ``total_skips``), each a :class:`_Field` of one snapshot; and for ``update_in_place``
        the int32 flags (0-d, 1: non-finite loss, 1: skipped) and ``[skip, 1]``.
    """
    s = _scratch(sc)
    held = s.get("report")
    if held is None or held[0] is not sc._scale or held[1] is not sc._skips:  # a new state
        bits = torch.tensor([0, 0, 0, 1], dtype=torch.int32, device=sc.device)  # [.., .., .., 1]
        parts = [sc._scale.view(torch.int32).reshape(1), sc._skips, bits[:3]]
        held = s["report"] = (sc._scale, sc._skips, bits[:3], (*bits.unbind()[::2], bits[2:]), parts)
    _, _, bits, (loss_bad, skip, skip_one), parts = held
    torch.ne(s["flag_views"][4], 0, out=bits)
    snap = _Snapshot(torch.cat(parts))
    return {name: _Field(snap, name) for name in _DERIVE}, (loss_bad, skip, skip_one)


def _scale_of(bits: int) -> float:
    return float(np.array(bits, dtype=np.int32).view(np.float32))


# name -> (dtype of the device value it stands for, its value from the packed host list
# [scale bits, consecutive, total, loss_inf, grads_inf, skip])
_DERIVE = {
    "scale": (torch.float32, lambda v: _scale_of(v[0])),
    "applied": (torch.bool, lambda v: v[5] == 0),
    "loss_finite": (torch.bool, lambda v: v[3] == 0),
    "grads_finite": (torch.bool, lambda v: v[4] == 0),
    "consecutive_skips": (torch.int32, lambda v: (v[1] + v[5]) * v[5]),
    "total_skips": (torch.int32, lambda v: v[2] + v[5]),
}


class _Snapshot:
    """One step's packed int32 report on the device, read to the host once (on first need)."""

    __slots__ = ("packed", "_host")

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed
        self._host: list[int] | None = None

    def host(self) -> list[int]:
        if self._host is None:
            self._host = self.packed.tolist()  # the only sync, shared by every field
        return self._host


class _Field:
    """A step's report field on the fused path: stands for a 0-d device value of ``dtype``,
    derived from its step's :class:`_Snapshot` when read (``item()``, ``bool()``, ``int()``,
    ``float()``: each waits for the device once per step)."""

    __slots__ = ("_snap", "name")

    def __init__(self, snap: _Snapshot, name: str) -> None:
        self._snap = snap
        self.name = name

    @property
    def dtype(self) -> torch.dtype:
        return _DERIVE[self.name][0]

    def item(self) -> Any:
        return _DERIVE[self.name][1](self._snap.host())

    def __bool__(self) -> bool:
        return bool(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def device_value(self) -> torch.Tensor:
        """The field as the 0-d device tensor it stands for, derived from the snapshot with
        torch ops on its device (no host sync): what :attr:`unimp.StepResult.raw` hands out."""
        p = self._snap.packed
        if self.name == "scale":
            return p[0].view(torch.float32)
        if self.name in ("applied", "loss_finite", "grads_finite"):
            return p[{"applied": 5, "loss_finite": 3, "grads_finite": 4}[self.name]] == 0
        if self.name == "consecutive_skips":
            return (p[1] + p[5]) * p[5]
        return p[2] + p[5]  # total_skips

    def __repr__(self) -> str:
        return f"<unimp step {self.name}: {self.dtype}, read on access>"
