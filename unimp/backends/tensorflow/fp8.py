"""TensorFlow FP8: :mod:`unimp.fp8`'s scaling and quantize-dequantize rules on TensorFlow
tensors (they trace under ``tf.function``), and :class:`FP8Dense`, an emulated float8 Keras
Dense layer.

TensorFlow flushes float32 subnormals to zero on CPU: an amax below 2**-126 is recorded as 0
here (see docs/fp8.md); unimp's own rules keep every scale and ``scale_inv`` normal.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import tensorflow as tf

from unimp import fp8 as _fp8
from unimp.fp8 import FP8State

_FP8_DTYPES = {
    "float8_e4m3fn": tf.dtypes.experimental.float8_e4m3fn,
    "float8_e5m2": tf.dtypes.experimental.float8_e5m2,
}


class Fp8Ops:
    """The FP8 rule's array namespace over TensorFlow tensors."""

    where = staticmethod(tf.where)
    isfinite = staticmethod(tf.math.is_finite)
    isnan = staticmethod(tf.math.is_nan)
    isinf = staticmethod(tf.math.is_inf)
    abs = staticmethod(tf.abs)
    floor = staticmethod(tf.floor)
    exp2 = staticmethod(tf.experimental.numpy.exp2)
    log2 = staticmethod(tf.experimental.numpy.log2)

    @staticmethod
    def f32(x: Any) -> tf.Tensor:
        return tf.cast(x, tf.float32)

    @staticmethod
    def amax(x: tf.Tensor) -> tf.Tensor:
        return tf.reduce_max(x)  # NaN-propagating (observed on CPU, tf 2.21)

    @staticmethod
    def push(history: tf.Tensor, amax: tf.Tensor) -> tf.Tensor:
        return tf.concat([tf.reshape(tf.cast(amax, history.dtype), [1]), history[:-1]], 0)

    @staticmethod
    def clip(x: tf.Tensor, lo: float, hi: float) -> tf.Tensor:
        return tf.clip_by_value(x, lo, hi)  # NaN stays NaN

    @staticmethod
    def pow2_floor(x: tf.Tensor) -> tf.Tensor:
        bits = tf.bitwise.bitwise_and(tf.bitcast(x, tf.int32), tf.constant(-0x800000, tf.int32))
        return tf.bitcast(bits, tf.float32)

    @staticmethod
    def to_fp8(x: tf.Tensor, dtype: str) -> tf.Tensor:
        return tf.cast(x, _FP8_DTYPES[dtype])

    @staticmethod
    def to_f32(x: Any) -> tf.Tensor:
        return tf.cast(x, tf.float32)

    @staticmethod
    def cast_like(x: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
        return tf.cast(x, like.dtype)


def fp8_initial_state(config: _fp8.Fp8Config, device: Any = None) -> FP8State:
    """Scale 1, zero history: an :class:`unimp.fp8.FP8State` of float32 tensors."""
    return fp8_state_from_numpy(FP8State.initial(config), device)


def fp8_state_from_numpy(state: FP8State, device: Any = None) -> FP8State:
    """The same state as float32 tensors (on ``device`` when given)."""
    with tf.device(device) if device is not None else contextlib.nullcontext():
        return FP8State(*(tf.constant(np.asarray(v, np.float32)) for v in
                          (state.scale, state.scale_inv, state.amax_history)))


def fp8_state_to_numpy(state: FP8State) -> FP8State:
    """The state as NumPy float32 (for :func:`unimp.fp8.state_dict`); one host copy."""
    return FP8State(*(np.asarray(tf.convert_to_tensor(v).numpy(), np.float32) for v in
                      (state.scale, state.scale_inv, state.amax_history)))


def fp8_amax(x: tf.Tensor) -> tf.Tensor:
    """``max(abs(x))`` as a float32 0-d tensor (NaN-propagating)."""
    return _fp8.amax_of(Fp8Ops, tf.convert_to_tensor(x))


def fp8_step(
    config: _fp8.Fp8Config, state: FP8State, amax: tf.Tensor, role: str = "forward"
) -> tuple[tuple[tf.Tensor, tf.Tensor], FP8State]:
    """One step of :func:`unimp.fp8.step_arrays` on tensors (traces under ``tf.function``).

    Returns:
        ``((scale, scale_inv) to quantize this step with, state after the step)``.
    """
    vals = [tf.convert_to_tensor(v) for v in (state.scale, state.scale_inv, state.amax_history)]
    used, new = _fp8.step_arrays(Fp8Ops, config, role, *vals, Fp8Ops.f32(amax))
    return used, FP8State(*new)


def fp8_quantize_dequantize(x: tf.Tensor, scale: tf.Tensor, scale_inv: tf.Tensor, dtype: str) -> tf.Tensor:
    """:func:`unimp.fp8.qdq_arrays` on a tensor: same shape and dtype as ``x``."""
    return _fp8.qdq_arrays(Fp8Ops, tf.convert_to_tensor(x), scale, scale_inv, dtype, _fp8.FP8_MAX[dtype])

