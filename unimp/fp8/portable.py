"""The portable FP8 state_dict format, the same in every backend (separate from the loss scale's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unimp.fp8.config import FP8Config, FP8State, fp8_from_dict

#: Version tag of the portable FP8 state_dict format.
STATE_FORMAT = "unimp.fp8/1"


def state_dict(config: FP8Config, tensors: Mapping[str, FP8State]) -> dict[str, Any]:
    """The portable, JSON-able FP8 scaling state of a model.

    Args:
        config: the scaling config.
        tensors: per quantized tensor, its state; keys are the tensor's name, by convention
            ``"<layer path>/<input|kernel|grad>"``.

    Returns:
        ``{"format": "unimp.fp8/1", "config": config.to_dict(), "tensors": {name:
        {"scale": float, "scale_inv": float, "amax_history": [float, ...]}}}`` (the tensor keys
        are :class:`FP8State`'s dataclass fields).
    """
    return {
        "format": STATE_FORMAT,
        "config": config.to_dict(),
        "tensors": {str(k): v.to_dict() for k, v in tensors.items()},
    }


def from_state_dict(d: Mapping[str, Any]) -> tuple[FP8Config, dict[str, FP8State]]:
    """Inverse of :func:`state_dict`; validates everything before returning.

    Raises:
        ValueError: not a dict, a missing or foreign ``format``, an unknown key, a bad config or
            tensor state (the message names the key).
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"an FP8 state_dict must be a dict, got {type(d).__name__}.")
    if d.get("format") != STATE_FORMAT:
        raise ValueError(
            f"FP8 state_dict 'format' must be {STATE_FORMAT!r}, got {d.get('format')!r}. Save it "
            "with unimp.fp8.state_dict (a loss-scale state_dict is 'unimp.loss_scale/...')."
        )
    extra = sorted(set(d) - {"format", "config", "tensors"})
    if extra or "config" not in d or "tensors" not in d:
        raise ValueError(
            f"an FP8 state_dict has exactly the keys format, config, tensors; got {sorted(d)}."
        )
    config = fp8_from_dict(d["config"])
    if not isinstance(d["tensors"], Mapping):
        raise ValueError(f"FP8 state_dict 'tensors' must be a dict, got {type(d['tensors']).__name__}.")
    tensors = {}
    for name, t in d["tensors"].items():
        try:
            tensors[name] = FP8State.from_dict(t, config)
        except ValueError as e:
            raise ValueError(f"FP8 state_dict tensors[{name!r}]: {e}") from None
    return config, tensors
