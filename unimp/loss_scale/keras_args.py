"""The arguments Keras's ``LossScaleOptimizer`` takes, read by Keras's rules: one reading for
every Keras optimizer unimp has (:class:`unimp.backends.tensorflow.LossScaleOptimizer` and
:class:`unimp.keras.LossScaleOptimizer`). Framework-free: Keras's conventions, not Keras.

Matches ``keras.optimizers.LossScaleOptimizer`` (Keras 3.0-3.16): ``initial_scale`` and
``dynamic_growth_steps`` mean its dynamic rule (``DynamicLossScale.preset("keras")``),
``dynamic=False`` is refused, and the base-optimizer arguments older configs hold pass at their
defaults only, with Keras's own words in the error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from unimp.loss_scale.config import DynamicLossScale, LossScaleConfig, loss_scale_from_dict

__all__ = ["check_keras_arguments", "keras_positional", "resolve_keras_loss_scale"]


def resolve_keras_loss_scale(
    value: Any, initial_scale: float | None = None, dynamic_growth_steps: int | None = None
) -> LossScaleConfig:
    """The config LossScaleOptimizer's arguments mean: unimp's ``loss_scale`` (``None``:
    ``DynamicLossScale()``), or Keras's ``initial_scale`` / ``dynamic_growth_steps`` (the
    ``keras`` preset with those values), not both.

    Raises:
        ValueError: both kinds of argument, or a bad config.
    """
    if initial_scale is None and dynamic_growth_steps is None:
        return DynamicLossScale() if value is None else loss_scale_from_dict(value)
    if value is not None:
        raise ValueError(
            "give either loss_scale= or Keras's initial_scale=/dynamic_growth_steps=, not both."
        )
    overrides: dict[str, Any] = {}
    if initial_scale is not None:
        overrides["init_scale"] = initial_scale
    if dynamic_growth_steps is not None:
        overrides["growth_interval"] = dynamic_growth_steps
    return DynamicLossScale.preset("keras", **overrides)


#: The base-optimizer arguments Keras 3.0-3.11 wrote into a LossScaleOptimizer's config, with the
#: defaults Keras's LossScaleOptimizer accepts them at (anything else it refuses, naming the fix).
_KERAS_BASE_DEFAULTS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


def check_keras_arguments(kwargs: dict[str, Any]) -> None:
    """Keras's LossScaleOptimizer's extra arguments, by its rules: ``dynamic=True`` and
    base-optimizer arguments at their defaults pass; the rest is a ValueError naming the fix."""
    kwargs = dict(kwargs)
    # Keras's own words come first (code that catches its errors matches on them), unimp's fix
    # after them
    if not kwargs.pop("dynamic", True):
        raise ValueError(
            "LossScaleOptimizer no longer supports `dynamic=False`. Instead, simply set "
            "`loss_scale_factor` directly on the `inner_optimizer`. With unimp, give a static "
            "scale instead, e.g. LossScaleOptimizer(opt, loss_scale=1024.0), or "
            "loss_scale='none'."
        )
    for arg, default in _KERAS_BASE_DEFAULTS.items():
        if arg in kwargs and kwargs.pop(arg) != default:
            raise ValueError(
                f"LossScaleOptimizer does not support `{arg}`. Instead, set `{arg}` on the "
                f"`inner_optimizer`. E.g. keras.optimizers.Adam(..., {arg}=...)."
            )
    if kwargs:
        raise ValueError(
            f"LossScaleOptimizer does not support arguments: `{'`, `'.join(kwargs)}`. Set "
            "options such as learning_rate or clipnorm on the inner optimizer."
        )


def keras_positional(args: tuple, loss_scale: Any, name: Any) -> tuple[Any, Any]:
    """``LossScaleOptimizer(inner, loss_scale, name)`` read positionally, refusing what Keras's
    positional order ``(inner_optimizer, initial_scale, dynamic_growth_steps, name)`` would read
    otherwise: a number second (Keras: a dynamic scale starting there; unimp: a static one) or
    a non-string third (Keras: the growth interval)."""
    if len(args) > 2:
        raise TypeError(
            f"LossScaleOptimizer takes at most 3 positional arguments (inner_optimizer, "
            f"loss_scale, name), got {1 + len(args)}; pass the others by keyword."
        )
    if args:
        first = args[0]
        if isinstance(first, (int, float, np.number)) and not isinstance(first, (bool, np.bool_)):
            raise ValueError(
                f"LossScaleOptimizer(opt, {first!r}) is ambiguous: Keras reads a second positional "
                "argument as initial_scale (a dynamic scale starting there), unimp as loss_scale. "
                f"Write initial_scale={first!r} (Keras's meaning) or loss_scale={first!r} (a static "
                "scale)."
            )
        if loss_scale is not None:
            raise TypeError("LossScaleOptimizer got loss_scale twice (positionally and by keyword).")
        loss_scale = first
    if len(args) == 2:
        if not isinstance(args[1], str):
            raise ValueError(
                f"LossScaleOptimizer's third positional argument is name (a string), got "
                f"{args[1]!r}; for Keras's dynamic_growth_steps write dynamic_growth_steps=..."
            )
        if name is not None:
            raise TypeError("LossScaleOptimizer got name twice (positionally and by keyword).")
        name = args[1]
    return loss_scale, name
