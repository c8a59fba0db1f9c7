"""TensorFlow overflow detection: ``all_finite`` (dense tensors and ``IndexedSlices``), and the
warning when replicas' loss-scale states differ.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from unimp.backends.tensorflow.casting import _is_floating_array
from unimp.loss_scale import warn_replica_desync
from unimp.trainstep import NORM_RESCALE_ABOVE


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
        >>> import tensorflow as tf
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


def _norm_rescale(amax: tf.Tensor) -> tf.Tensor:
    """The global norm's factor ``s`` for ``amax`` (float32 0-d), as
    :data:`unimp.trainstep.NORM_RESCALE_ABOVE` defines it: a power of two from ``amax``'s
    exponent bits where ``amax`` is finite and above the threshold, else 1."""
    bits = tf.bitwise.bitwise_and(tf.bitcast(amax, tf.int32), tf.constant(0x7F800000, tf.int32))
    power = tf.bitcast(bits, tf.float32)  # 2**floor(log2 amax)
    big = tf.logical_and(tf.math.is_finite(amax), amax > NORM_RESCALE_ABOVE)
    return tf.where(big, tf.math.divide_no_nan(tf.constant(NORM_RESCALE_ABOVE, tf.float32), power), 1.0)


def _global_norm(grads: list[Any]) -> tuple[tf.Tensor, tf.Tensor]:
    """``(norm, s)``: the global L2 norm (float32) of the gradients (``None`` skipped; 0 for
    no gradients), rescaled by :data:`unimp.trainstep.NORM_RESCALE_ABOVE`'s rule so that
    finite gradients never overflow it, and the rule's factor ``s`` (for the clip)."""
    wide = [tf.cast(tf.convert_to_tensor(g), tf.float32) for g in grads if g is not None]
    if not wide:
        return tf.constant(0.0, tf.float32), tf.constant(1.0, tf.float32)
    amax = tf.reduce_max(tf.stack([tf.reduce_max(tf.abs(g)) for g in wide]))
    s = _norm_rescale(amax)
    return tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(g * s)) for g in wide])) / s, s


def _clip(g: Any, clip: tf.Tensor, s: tf.Tensor, factor: tf.Tensor) -> Any:
    """``(g * s) * factor`` multiplied in float32 and rounded once to ``g``'s dtype where
    ``clip``, else ``g`` (``None`` and ``tf.IndexedSlices`` handled), as torch's in-place
    multiply of a half tensor by a float32 scalar rounds (``s`` and ``factor``:
    :data:`unimp.trainstep.NORM_RESCALE_ABOVE`'s rescaled clip; JAX's ``_clip`` is the same)."""
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(_clip(g.values, clip, s, factor), g.indices, g.dense_shape)
    product = tf.cast(tf.cast(g, tf.float32) * s * factor, g.dtype)
    return tf.where(clip, product, g)
