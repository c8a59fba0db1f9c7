"""TensorFlow tensor statistics: :func:`tensor_stats` on the tensor's device (eager or traced, no
host sync), and the layer-call recording a statistics step traces with.

The definitions are :mod:`unimp.stats`'s: ``v = |x|`` as float32 times the scale as float32,
compared with the float32 constants of :data:`unimp.stats.THRESHOLDS`; the block formats'
errors are :func:`unimp.stats.block_error_arrays` on :class:`FP8Ops` tensors. TensorFlow on the
CPU reads float32 subnormals as zero (see :mod:`unimp.stats`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import tensorflow as tf

from unimp.backends.tensorflow.fp8 import FP8Ops, _max_keeping_nan
from unimp.keras.stats import Collector, pending, unique_name
from unimp.stats import (
    TARGETS,
    THRESHOLDS,
    block_error_arrays,
    block_layout,
    check_formats,
    check_scale,
    merge_block_sums,
)

#: One tensor's statistics on the device: ``(counts, magnitudes, size)``, size an int32 scalar.
Entry = tuple[tf.Tensor, tf.Tensor, tf.Tensor]


def tensor_stats(x: Any, scale: Any = 1.0, formats: Any = ()) -> tuple[tf.Tensor, tf.Tensor]:
    """The statistics of ``x`` at ``scale``, computed on the device without a host sync (in
    eager mode, inside a ``tf.function`` and under ``jit_compile``).

    Args:
        x: a floating tensor or variable of any shape and dtype (float16, bfloat16, float32,
            float64); a ``tf.IndexedSlices`` is taken densely.
        scale: a finite number > 0, or a float32 scalar tensor (the loss scale; not checked, so
            nothing is read from the device).
        formats: block formats whose quantization error to take as well
            (:func:`unimp.stats.check_formats`; none by default); they need ``x``'s static
            shape.

    Returns:
        ``(counts, magnitudes)``: ``counts`` int32 of shape
        ``(len(unimp.stats.count_fields(formats)),)`` in that order, ``magnitudes`` float32
        of shape ``(len(unimp.stats.magnitude_fields(formats)),)``: ``amax`` (NaN when an
        element is NaN, 0 for an empty tensor), ``min_nonzero`` (``inf`` when no element is
        nonzero), then the block sums. Equal to :func:`unimp.stats.reference_stats`.

    Raises:
        TypeError: ``x`` is not floating.
        ValueError: a host ``scale`` that is not a finite number > 0, an unknown block
            format, or block formats on a tensor without a static shape.

    Example:
        >>> import tensorflow as tf
        >>> from unimp.stats import COUNT_FIELDS
        >>> c, m = tensor_stats(tf.constant([2.0**-k for k in range(41)]), 2.0**15)
        >>> int(c[COUNT_FIELDS.index("float16_flush")]), float(m[0])
        (1, 1.0)
    """
    x = tf.convert_to_tensor(x)
    if not x.dtype.is_floating:
        raise TypeError(f"tensor_stats needs a floating tensor, got {x.dtype.name}.")
    if not tf.is_tensor(scale):
        scale = check_scale(scale)
    formats = check_formats(formats)
    with tf.name_scope("unimp_stats"):
        a = tf.reshape(tf.abs(tf.stop_gradient(x)), [-1])
        if a.dtype != tf.float32:
            a = tf.cast(a, tf.float32)
        if tf.is_tensor(scale):
            v = a * tf.cast(scale, tf.float32)
        else:
            v = a if scale == 1.0 else a * np.float32(scale)
        def count(mask: tf.Tensor) -> tf.Tensor:
            return tf.reduce_sum(tf.cast(mask, tf.int32))

        # the reference's comparisons, literally (see the torch backend's tensor_stats)
        positive = a > 0
        raw = [count(tf.equal(a, 0.0)), tf.size(a, out_type=tf.int32) - count(tf.math.is_finite(a))]
        for t in TARGETS:
            overflow_at, subnormal_below, flush_at = (np.float32(c) for c in THRESHOLDS[t])
            raw.append(count(v >= overflow_at))
            raw.append(count(tf.logical_and(v > flush_at, v < subnormal_below)))
            raw.append(count(tf.logical_and(positive, v <= flush_at)))
        # NaN wins (under jit_compile XLA's CPU reduce-max drops it: the FP8 amax's helper);
        # reduce_max of an empty tensor is -inf: the maximum with 0 makes it 0 (NaN stays NaN)
        amax = tf.maximum(tf.reshape(_max_keeping_nan(a, None), []), 0.0)
        mags = [amax, tf.reduce_min(tf.where(positive, a, math.inf))]
        if formats:
            rows, cols, padded = block_layout(x.shape)
            blocks = tf.pad(tf.reshape(a, [rows, cols]), [[0, 0], [0, padded - cols]])
            block_counts, block_sums = block_error_arrays(blocks, formats, FP8Ops)
            raw += block_counts
            mags += block_sums
        return tf.stack(raw), tf.stack(mags)


def _entry(x: Any, scale: Any = 1.0, formats: tuple[str, ...] = ()) -> Entry:
    x = tf.convert_to_tensor(x)
    counts, mags = tensor_stats(x, scale, formats)
    return counts, mags, tf.size(x, out_type=tf.int32)


def _merge(a: Entry, b: Entry) -> Entry:
    """The statistics of two tensors taken together (one layer called twice, or on every
    micro-batch): sizes and counts add, the larger ``amax`` (NaN wins), the smaller
    ``min_nonzero``, the block sums in the larger unit (:func:`unimp.stats.merge_block_sums`)."""
    (ca, ma, na), (cb, mb, nb) = a, b
    mags = [tf.reshape(tf.maximum(ma[0], mb[0]), [1]), tf.reshape(tf.minimum(ma[1], mb[1]), [1])]
    if ma.shape[0] > 2:
        mags += merge_block_sums(ma[2:3], ma[3:], mb[2:3], mb[3:], tf.where)
    return ca + cb, tf.concat(mags, 0), na + nb


def _is_floating(t: Any) -> bool:
    return tf.is_tensor(t) and not isinstance(t, tf.SparseTensor) and t.dtype.is_floating


def _collector(formats: tuple[str, ...] = ()) -> Collector:
    """:class:`unimp.keras.stats.Collector` (Keras's layer recording) with TensorFlow's
    statistics of one tensor, with the block ``formats``."""
    return Collector(_entry, _merge, _is_floating, formats)


# Python on names only, so AutoGraph leaves it as it is (it runs while a step traces)
_unique = tf.autograph.experimental.do_not_convert(unique_name)


def _grad_flags(named: list[tuple[str, Any]]) -> tuple[list[str], tf.Tensor]:
    """One finite flag per gradient (a bool vector, in the order of ``named``, named as the
    statistics name them): which gradient went non-finite first, on a logged step."""
    names: list[str] = []
    flags = []
    for name, g in named:
        names.append(_unique(name, names))
        values = g.values if isinstance(g, tf.IndexedSlices) else g
        flags.append(tf.reduce_all(tf.math.is_finite(values)))
    return names, tf.stack(flags) if flags else tf.zeros([0], tf.bool)


def _pending(
    step: int, scale: tf.Tensor, arrays: dict[str, dict[str, Entry]], order: Any, formats: tuple[str, ...] = ()
) -> Any:
    """A function building the :class:`unimp.stats.StepStats` from the step's output tensors
    when called (the read back to the host happens then)."""
    return pending(step, scale, arrays, order, to_numpy=lambda t: t.numpy(), formats=formats)
