"""TensorFlow loss scaling: :func:`unimp.loss_scale.update_arrays`'s array namespace over TF
tensors, unscaling in float32 (dense and ``IndexedSlices``), which config fields a traced
graph builds in, and the loss-scale arguments :class:`~unimp.backends.tensorflow.LossScaleOptimizer` takes (unimp's ``loss_scale``,
Keras's ``initial_scale`` / ``dynamic_growth_steps`` / ``dynamic`` and base-optimizer keys).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from unimp.loss_scale import (
    EXTRA_FIELDS,
    DynamicLossScale,
    LossScaleConfig,
    loss_scale_from_dict,
    tracks_extra,
)


class LossScaleOps:
    """unimp.loss_scale.update_arrays's array namespace over TensorFlow tensors."""

    where = staticmethod(tf.where)
    minimum = staticmethod(tf.minimum)
    maximum = staticmethod(tf.maximum)
    isfinite = staticmethod(tf.math.is_finite)

    @staticmethod
    def f32(x: Any) -> tf.Tensor:
        return tf.cast(x, tf.float32)

    @staticmethod
    def i32(x: Any) -> tf.Tensor:
        return tf.cast(x, tf.int32)


def _extra(optimizer: Any) -> tuple[tf.Tensor, ...] | None:
    """The extra loss-scale fields (``EXTRA_FIELDS``) of a LossScaleOptimizer as int32
    tensors, or None where it holds none (a config whose rule does not need them)."""
    v = getattr(optimizer, "loss_scale_extra", None)
    return None if v is None else tuple(tf.unstack(tf.convert_to_tensor(v), num=len(EXTRA_FIELDS)))


def _ensure_extra(optimizer: Any, config: LossScaleConfig) -> None:
    """Creates the optimizer's ``loss_scale_extra`` int32 vector (the extra fields, in
    ``EXTRA_FIELDS`` order) when ``config``'s rule needs it; only then, so an optimizer whose
    rule counts none of them holds (and saves in ``.keras`` files) no variable for them."""
    if tracks_extra(config) and getattr(optimizer, "loss_scale_extra", None) is None:
        optimizer.loss_scale_extra = optimizer.add_variable(
            shape=(len(EXTRA_FIELDS),), dtype="int32", name="loss_scale_extra"
        )


def _count_skipped(optimizer: Any) -> None:
    """A skipped step's effect on the inner optimizer: none with ``schedule_counts="applied"``
    (the default), ``iterations += 1`` with ``"attempted"`` (see ``unimp.step.SCHEDULE_COUNTS``)."""
    if getattr(optimizer, "schedule_counts", "applied") == "attempted":
        optimizer.inner_optimizer.iterations.assign_add(1)


def _divide(x: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
    """x / scale computed in float32 (float64 for float64 x), returned in x's dtype."""
    if x.dtype == tf.float32:
        return x / scale
    if x.dtype == tf.float64:
        return x / tf.cast(scale, tf.float64)
    return tf.cast(tf.cast(x, tf.float32) / scale, x.dtype)


def _unscale(g: Any, scale: tf.Tensor) -> Any:
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(_divide(g.values, scale), g.indices, g.dense_shape)
    return _divide(tf.convert_to_tensor(g), scale)


def _resolve_loss_scale(
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


def _check_keras_arguments(kwargs: dict[str, Any]) -> None:
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


def _traced_fields(config: LossScaleConfig) -> dict[str, Any]:
    """The parts of a config that a traced update has built in: the kind and the dynamic
    rule's factors, interval and bounds. Not ``init_scale`` (only the start state) nor
    ``max_consecutive_skips`` (checked on the host), nor a static scale's value (the update
    reads the scale variable)."""
    d = config.to_dict()
    for key in ("init_scale", "max_consecutive_skips", "scale"):
        d.pop(key, None)
    return d


def _to_host(x: Any) -> Any:
    return x.numpy() if hasattr(x, "numpy") else x


def _positional(args: tuple, loss_scale: Any, name: Any) -> tuple[Any, Any]:
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
