"""TensorFlow loss scaling: :func:`unimp.loss_scale.update_arrays`'s array namespace over TF
tensors, unscaling in float32 (dense and ``IndexedSlices``) and which config fields a traced
graph builds in. The arguments the optimizer takes are read in the core
(:mod:`unimp.loss_scale.keras_args`), once for every Keras optimizer unimp has.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from unimp.loss_scale import (
    EXTRA_FIELDS,
    LossScaleConfig,
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
