"""TensorFlow tensor statistics: :func:`tensor_stats` on the tensor's device (eager or traced, no
host sync), and the layer-call recording a statistics step traces with.

The definitions are :mod:`unimp.stats`'s: ``v = |x|`` as float32 times the scale as float32,
compared with the float32 constants of :data:`unimp.stats.THRESHOLDS`. TensorFlow on the CPU
reads float32 subnormals as zero (see :mod:`unimp.stats`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from unimp.backends.tensorflow.fp8 import _max_keeping_nan
from unimp.stats import TARGETS, THRESHOLDS, StepStats, check_scale, output_leaves

#: One tensor's statistics on the device: ``(counts, magnitudes, size)``, size an int32 scalar.
Entry = tuple[tf.Tensor, tf.Tensor, tf.Tensor]


def tensor_stats(x: Any, scale: Any = 1.0) -> tuple[tf.Tensor, tf.Tensor]:
    """The statistics of ``x`` at ``scale``, computed on the device without a host sync (in
    eager mode, inside a ``tf.function`` and under ``jit_compile``).

    Args:
        x: a floating tensor or variable of any shape and dtype (float16, bfloat16, float32,
            float64); a ``tf.IndexedSlices`` is taken densely.
        scale: a finite number > 0, or a float32 scalar tensor (the loss scale; not checked, so
            nothing is read from the device).

    Returns:
        ``(counts, magnitudes)``: ``counts`` int32 of shape ``(len(unimp.stats.COUNT_FIELDS),)``
        in that order, ``magnitudes`` float32 of shape ``(2,)``: ``amax`` (NaN when an element
        is NaN, 0 for an empty tensor) and ``min_nonzero`` (``inf`` when no element is
        nonzero). Equal to :func:`unimp.stats.reference_stats`.

    Raises:
        TypeError: ``x`` is not floating.
        ValueError: a host ``scale`` that is not a finite number > 0.

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
        counts = tf.stack(raw)
        # NaN wins (under jit_compile XLA's CPU reduce-max drops it: the FP8 amax's helper);
        # reduce_max of an empty tensor is -inf: the maximum with 0 makes it 0 (NaN stays NaN)
        amax = tf.maximum(tf.reshape(_max_keeping_nan(a, None), []), 0.0)
        min_nonzero = tf.reduce_min(tf.where(positive, a, math.inf))
        return counts, tf.stack([amax, min_nonzero])


def _entry(x: Any, scale: Any = 1.0) -> Entry:
    x = tf.convert_to_tensor(x)
    counts, mags = tensor_stats(x, scale)
    return counts, mags, tf.size(x, out_type=tf.int32)


def _merge(a: Entry, b: Entry) -> Entry:
    """The statistics of two tensors taken together (one layer called twice, or on every
    micro-batch): sizes and counts add, the larger ``amax`` (NaN wins), the smaller
    ``min_nonzero``."""
    (ca, ma, na), (cb, mb, nb) = a, b
    mags = tf.stack([tf.maximum(ma[0], mb[0]), tf.minimum(ma[1], mb[1])])
    return ca + cb, mags, na + nb


def _floating_leaves(out: Any, name: str) -> Iterator[tuple[str, Any]]:
    """:func:`unimp.stats.output_leaves` with this framework's floating test."""
    return output_leaves(out, name, lambda t: tf.is_tensor(t) and not isinstance(t, tf.SparseTensor) and t.dtype.is_floating)


def relative_path(model: Any, path: str) -> str:
    """A ``variable.path`` or ``layer.path`` relative to ``model``: without the model's own
    name, which Keras puts first in a Sequential's and a subclassed model's paths but not in a
    functional model's (``"sequential/l1/kernel"`` -> ``"l1/kernel"``). Statistics and step logs
    name Keras tensors so, as torch names them from the model down (``"l1.weight"``).

    Example:
        >>> import keras
        >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="l1")])
        >>> [relative_path(m, v.path) for v in m.weights]
        ['l1/kernel', 'l1/bias']
    """
    head = f"{model.name}/"
    return path[len(head):] if path.startswith(head) else path


def _leaf_layers(model: Any) -> list[tuple[str, Any]]:
    """``(path, layer)`` for every layer of ``model`` without sublayers (the model itself when
    it has none), each once, in the model's order.

    The path joins the layer names from the model down, without the model's own name, so a
    layer's outputs are named as its weights are by :func:`relative_path` (``"dense"``,
    ``"inner/dense"`` in a nested model), in a Sequential, a subclassed and a functional model
    alike, as torch's module names and JAX's pytree paths are.
    """
    out, seen = [], set()

    def walk(layer: Any, path: str) -> None:
        if id(layer) in seen:
            return
        seen.add(id(layer))
        subs = list(layer._flatten_layers(include_self=False, recursive=False))
        if not subs:
            out.append((path or layer.name, layer))
        for sub in subs:
            walk(sub, f"{path}/{sub.name}" if path else sub.name)

    walk(model, "")
    return out


class _Collector:
    """What a statistics step's trace records: the outputs of every leaf layer (at scale 1,
    every call merged) and the unscaled gradients (at the step's scale), as graph tensors."""

    def __init__(self) -> None:
        self.activations: dict[str, Entry] = {}
        self.gradients: dict[str, Entry] = {}

    def add_activation(self, name: str, out: Any) -> None:
        for key, t in _floating_leaves(out, name):
            entry = _entry(t)
            old = self.activations.get(key)
            self.activations[key] = entry if old is None else _merge(old, entry)

    def add_gradients(self, named: list[tuple[str, Any]], scale: tf.Tensor) -> None:
        for name, g in named:
            self.gradients[_unique(name, self.gradients)] = _entry(g, scale)

    @contextlib.contextmanager
    def recording(self, model: Any) -> Iterator[None]:
        """Wraps ``call`` of every leaf layer of ``model`` (an instance attribute, over
        whatever ``call`` the layer has: a prepared model's output cast included) so each
        output is recorded; the layers get their own ``call`` back on exit."""
        saved = []
        try:
            for name, layer in _leaf_layers(model):
                own = layer.__dict__.get("call")
                saved.append((layer, own))
                layer.call = self._recorded(name, layer.call)
            yield
        finally:
            for layer, own in reversed(saved):
                if own is None:
                    layer.__dict__.pop("call", None)
                else:
                    layer.call = own

    def _recorded(self, name: str, call: Any) -> Any:
        def recorded_call(*args: Any, **kwargs: Any) -> Any:
            out = call(*args, **kwargs)
            self.add_activation(name, out)
            return out

        return recorded_call

    def outputs(self) -> dict[str, dict[str, Entry]]:
        """The tensors the statistics step returns (dicts come back sorted by name)."""
        return {"gradients": dict(self.gradients), "activations": dict(self.activations)}


@tf.autograph.experimental.do_not_convert
def _unique(name: str, taken: Any) -> str:
    """``name``, or ``name#2``, ``name#3``, ... when taken: two variables with one path (a
    Keras model can have them) keep both, in the statistics and in the finite flags alike.

    Python on names only, so AutoGraph leaves it as it is: converted, its while loop once
    failed a conformance run (``tf___unique() missing 1 required positional argument``) in one
    test order only."""
    key, i = name, 1
    while key in taken:
        i += 1
        key = f"{name}#{i}"
    return key


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


def _pending(step: int, scale: tf.Tensor, arrays: dict[str, dict[str, Entry]], order: Any) -> Any:
    """A function building the :class:`unimp.stats.StepStats` from the step's output tensors
    when called (the read back to the host happens then)."""

    def build() -> StepStats:
        s = float(scale.numpy())

        def host(group: dict[str, Entry], at: float) -> dict[str, Any]:
            return {n: (int(z.numpy()), at, c.numpy(), m.numpy()) for n, (c, m, z) in group.items()}

        return StepStats.from_arrays(
            step, host(arrays["gradients"], s), host(arrays["activations"], 1.0), order=order
        )

    return build

