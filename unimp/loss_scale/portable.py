"""The portable loss-scale state_dict format, the same in every backend."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unimp.loss_scale.config import _F32_MAX, LossScaleConfig, LossScaleState, loss_scale_from_dict

#: Version tag of the portable state_dict format, the same in every backend.
STATE_FORMAT = "unimp.loss_scale/1"


def state_dict(config: LossScaleConfig, state: LossScaleState | None = None) -> dict[str, Any]:
    """The portable, JSON-able state of a loss scaler, the same in every backend.

    Returns:
        ``{"format": "unimp.loss_scale/1", "config": config.to_dict(), "state":
        state.to_dict()}``; before the first step ``state`` is the initial state.
    """
    s = config.initial_state() if state is None else state
    return {"format": STATE_FORMAT, "config": config.to_dict(), "state": s.to_dict()}


def from_state_dict(d: Mapping[str, Any]) -> tuple[LossScaleConfig, LossScaleState]:
    """Inverse of :func:`state_dict`: validates everything before returning.

    Raises:
        ValueError: not a dict, a missing or foreign ``format`` (e.g. a torch GradScaler
            state_dict, which has ``"scale"`` and ``"_growth_tracker"`` keys), or a bad config or
            state; the message names the key.
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"a loss-scale state_dict must be a dict, got {type(d).__name__}.")
    fmt = d.get("format")
    if fmt != STATE_FORMAT:
        if "_growth_tracker" in d or "growth_tracker" in d:
            hint = (
                " This looks like a torch.amp.GradScaler state_dict; load it with "
                "unimp.backends.torch.GradScaler.load_state_dict, which converts it."
            )
        else:
            hint = " Save it with unimp's state_dict() to get the portable format."
        raise ValueError(f"state_dict 'format' must be {STATE_FORMAT!r}, got {fmt!r}.{hint}")
    extra = sorted(set(d) - {"format", "config", "state"})
    if extra:
        raise ValueError(
            f"unknown key(s) {extra} in loss-scale state_dict; expected format, config, state."
        )
    if "config" not in d or "state" not in d:
        raise ValueError("loss-scale state_dict needs both 'config' and 'state' keys.")
    config = loss_scale_from_dict(d["config"])
    state = LossScaleState.from_dict(d["state"])
    if config.dynamic:
        if not state.counter < config.growth_interval:
            raise ValueError(
                f"loss-scale state 'counter' ({int(state.counter)}) must be < growth_interval "
                f"({config.growth_interval})."
            )
        hi = config.max_scale if config.max_scale is not None else _F32_MAX
        if not config.floor <= float(state.scale) <= hi:
            raise ValueError(
                f"loss-scale state 'scale' ({float(state.scale)}) is outside [min_scale, max_scale] "
                f"= [{config.floor}, {config.max_scale}]."
            )
    elif float(state.scale) != config.initial_scale():
        raise ValueError(
            f"loss-scale state 'scale' ({float(state.scale)}) must equal the {config.kind} scale "
            f"({config.initial_scale()})."
        )
    if state.consecutive_skips > state.total_skips:
        raise ValueError("loss-scale state 'consecutive_skips' cannot exceed 'total_skips'.")
    return config, state
