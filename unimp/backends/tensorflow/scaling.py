"""TensorFlow loss scaling: :func:`unimp.loss_scale.update_arrays`'s array namespace over TF
tensors, unscaling in float32 (dense and ``IndexedSlices``), and which config fields a traced
graph builds in.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from unimp.loss_scale import (
    DynamicLossScale,
    LossScaleConfig,
    loss_scale_from_dict,
)


class _TFOps:
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


def _resolve_loss_scale(value: Any) -> LossScaleConfig:
    if value is None:
        return DynamicLossScale()
    return loss_scale_from_dict(value)


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
