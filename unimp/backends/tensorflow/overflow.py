"""TensorFlow overflow detection: ``all_finite`` (dense tensors and ``IndexedSlices``), and the
warning when replicas' loss-scale states differ.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from unimp.backends.tensorflow.casting import _is_floating_array
from unimp.loss_scale import warn_replica_desync


def _finite_leaf(x: Any) -> tf.Tensor:
    if isinstance(x, tf.IndexedSlices):
        x = x.values
    return tf.reduce_all(tf.math.is_finite(x))


def all_finite(tree: Any) -> tf.Tensor:
    """A device bool scalar: every element of every floating leaf is finite.

    Non-floating leaves and ``None`` are ignored; an empty tree gives ``True``. Nothing is
    copied to the host.

    Args:
        tree: a nest of tensors, variables or arrays.

    Returns:
        ``tf.bool`` scalar tensor.

    Example:
        >>> bool(all_finite([tf.constant([1.0, float("inf")]), tf.constant([3])]))
        False
    """
    flags = [_finite_leaf(x) for x in tf.nest.flatten(tree) if _is_floating_array(x)]
    if not flags:
        return tf.constant(True)
    if len(flags) == 1:
        return flags[0]
    return tf.reduce_all(tf.stack(flags))


def _warn_resync() -> None:
    warn_replica_desync("Restore the loss-scale state on every worker (or under strategy.scope())")


def _global_norm(grads: list[Any]) -> tf.Tensor:
    """Global L2 norm (float32) of the gradients (``None`` skipped); 0 for no gradients."""
    squares = [
        tf.reduce_sum(tf.square(tf.cast(tf.convert_to_tensor(g), tf.float32)))
        for g in grads
        if g is not None
    ]
    if not squares:
        return tf.constant(0.0, tf.float32)
    return tf.sqrt(tf.add_n(squares))
