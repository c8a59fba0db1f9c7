"""The portable loss-scale state_dict format, the same in every backend."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from unimp.loss_scale.config import (
    _F32_MAX,
    EXTRA_FIELDS,
    LossScaleConfig,
    LossScaleState,
    loss_scale_from_dict,
)
from unimp.loss_scale.rule import fields_in_use

#: Version tag of the portable state_dict format, the same in every backend.
STATE_FORMAT = "unimp.loss_scale/1"


def check_scale_value(config: LossScaleConfig, scale: float, what: str) -> None:
    """``scale`` (a Python float) is a scale ``config`` can hold: inside ``[min_scale,
    max_scale]`` (float32's max without a cap) for a dynamic config, equal to its scale for a
    static or absent one. The one check of a loaded state and of an explicit new scale
    (``GradScaler.update(new_scale)``).

    Raises:
        ValueError: naming ``what``, the value and the allowed range or value.
    """
    if config.dynamic:
        hi = config.max_scale if config.max_scale is not None else _F32_MAX
        if not (math.isfinite(scale) and config.floor <= scale <= hi):
            raise ValueError(
                f"{what} ({scale!r}) is outside [min_scale, max_scale] = [{config.floor}, {config.max_scale}]."
            )
    elif scale != config.initial_scale():
        raise ValueError(
            f"{what} ({scale!r}) must equal the {config.kind} scale ({config.initial_scale()}): a "
            f"{config.kind} loss scale cannot change; use a DynamicLossScale to let the scale move."
        )


def state_dict(config: LossScaleConfig, state: LossScaleState | None = None) -> dict[str, Any]:
    """The portable, JSON-able state of a loss scaler, the same in every backend.

    Returns:
        ``{"format": "unimp.loss_scale/1", "config": config.to_dict(), "state":
        state.to_dict()}``, every field of both; before the first step ``state`` is the
        initial state.
    """
    s = config.initial_state() if state is None else state
    return {"format": STATE_FORMAT, "config": config.to_dict(), "state": s.to_dict()}


def from_state_dict(
    d: Mapping[str, Any], current: LossScaleConfig | None = None
) -> tuple[LossScaleConfig, LossScaleState]:
    """Inverse of :func:`state_dict`: validates everything before returning.

    Args:
        d: the portable state dict.
        current: the config of the scaler that loads it (every backend's ``load_state_dict``
            passes its own): a state without loss scaling (``kind: "none"``, saved by a
            bfloat16 or float32 run) is refused for a scaler that scales, as
            ``torch.amp.GradScaler.load_state_dict`` refuses the empty state of a disabled
            scaler: loading it would run float16 unscaled from then on, silently.

    Raises:
        ValueError: not a dict, a missing or foreign ``format`` (e.g. a torch GradScaler
            state_dict, which has ``"scale"`` and ``"_growth_tracker"`` keys), a bad config or
            state, or a state without loss scaling for a scaler that scales; the message names
            the key or the fix.
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
        elif isinstance(fmt, str) and fmt.startswith("unimp.loss_scale/"):
            hint = (
                f" unimp has one state format, {STATE_FORMAT!r}, with every config and state "
                "field; save the state again with this version's state_dict()."
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
    if not isinstance(d["config"], Mapping):
        raise ValueError(
            f"loss-scale state_dict 'config' must be a dict (the config's to_dict()), got "
            f"{type(d['config']).__name__}."
        )
    config = loss_scale_from_dict(d["config"])
    state = LossScaleState.from_dict(d["state"])
    if config.dynamic:
        if not state.counter < config.growth_at:
            raise ValueError(
                f"loss-scale state 'counter' ({int(state.counter)}) must be < growth_interval "
                f"({config.growth_interval})" + (" + 1 (delayed_first_growth)." if config.delayed_first_growth else ".")
            )
        if not state.hysteresis_used < config.hysteresis:
            raise ValueError(
                f"loss-scale state 'hysteresis_used' ({int(state.hysteresis_used)}) must be < "
                f"hysteresis ({config.hysteresis})."
            )
    check_scale_value(config, float(state.scale), "loss-scale state 'scale'")
    in_use = fields_in_use(config)  # the rule keeps the others at 0 (the scale is checked above)
    unused = [n for n in ("counter", *EXTRA_FIELDS) if n not in in_use and int(getattr(state, n))]
    if unused:
        raise ValueError(
            f"loss-scale state {unused} must be 0 with this config {config.to_dict()} (its rule "
            "never counts them; a backend would drop them): save the state with the config it "
            "was counted under."
        )
    if state.consecutive_skips > state.total_skips:
        raise ValueError("loss-scale state 'consecutive_skips' cannot exceed 'total_skips'.")
    if current is not None and config.kind == "none" and current.kind != "none":
        raise ValueError(
            f"this loss-scale state_dict was saved by a run without loss scaling (kind 'none': "
            f"a bfloat16 or float32 recipe such as mixed_bfloat16, or loss_scale='none'), and "
            f"this step scales its loss ({current.kind}: a float16 recipe such as "
            f"mixed_float16); loading it would turn loss scaling off. Load a state saved by a "
            f"loss-scaled run, or build the step with loss_scale='none' to train without it. "
            f"Nothing was changed."
        )
    return config, state
