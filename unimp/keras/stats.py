"""Tensor statistics (:mod:`unimp.stats`) on any Keras backend: :func:`tensor_stats` on
``keras.ops``, and what a statistics step records (every leaf layer's outputs, the unscaled
gradients), named from the model down as torch and JAX name theirs.

The layer-recording parts (:func:`relative_path`, :func:`leaf_layers`, :class:`Collector`) are
Keras's, the same on every engine: the TensorFlow backend's statistics step uses them with its
own ``tensor_stats``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
from keras import ops

from unimp.stats import (
    TARGETS,
    THRESHOLDS,
    StepStats,
    block_error_arrays,
    block_layout,
    check_formats,
    check_scale,
    merge_block_sums,
    output_leaves,
)

__all__ = [
    "Collector",
    "grad_flags",
    "leaf_layers",
    "pending",
    "relative_path",
    "tensor_stats",
    "unique_name",
]

#: One tensor's statistics on the device: ``(counts, magnitudes, size)``, size an int32 scalar.
Entry = tuple[Any, Any, Any]


def _is_floating(x: Any) -> bool:
    return (ops.is_tensor(x) or isinstance(x, keras.Variable)) and "float" in keras.backend.standardize_dtype(x.dtype)


def tensor_stats(x: Any, scale: Any = 1.0, formats: Any = ()) -> tuple[Any, Any]:
    """The statistics of ``x`` at ``scale`` on the device (no host sync; traces under
    ``jax.jit``).

    Args:
        x: a floating tensor or ``keras.Variable`` of any shape and dtype.
        scale: a finite number > 0, or a float32 scalar tensor (the loss scale; not checked).
        formats: block formats whose quantization error to take as well
            (:func:`unimp.stats.check_formats`; none by default), on the engine's own
            ``FP8Ops`` (:func:`unimp.keras.fp8.fp8_ops`; TensorFlow's on that engine).

    Returns:
        ``(counts, magnitudes)``: ``counts`` int32 of shape
        ``(len(unimp.stats.count_fields(formats)),)`` in that order, ``magnitudes`` float32
        of shape ``(len(unimp.stats.magnitude_fields(formats)),)``: ``amax`` (NaN when an
        element is NaN, 0 for an empty tensor), ``min_nonzero`` (``inf`` when no element is
        nonzero), then the block sums. Equal to :func:`unimp.stats.reference_stats`.

    Raises:
        TypeError: ``x`` is not floating.
        ValueError: a host ``scale`` that is not a finite number > 0, or an unknown block
            format.

    Example:
        >>> from unimp.stats import COUNT_FIELDS
        >>> c, m = tensor_stats(np.array([2.0**-k for k in range(41)], np.float32), 2.0**15)
        >>> int(c[COUNT_FIELDS.index("float16_flush")]), float(m[0])
        (1, 1.0)
    """
    x = x.value if isinstance(x, keras.Variable) else ops.convert_to_tensor(x)
    if "float" not in keras.backend.standardize_dtype(x.dtype):
        raise TypeError(f"tensor_stats needs a floating tensor, got {keras.backend.standardize_dtype(x.dtype)}.")
    if not ops.is_tensor(scale):
        scale = check_scale(scale)
    formats = check_formats(formats)
    a = ops.cast(ops.reshape(ops.abs(ops.stop_gradient(x)), (-1,)), "float32")
    v = ops.multiply(a, ops.cast(scale, "float32")) if ops.is_tensor(scale) or scale != 1.0 else a

    def count(mask: Any) -> Any:
        return ops.sum(ops.cast(mask, "int32"))

    # the reference's comparisons, literally (see the torch backend's tensor_stats)
    positive = ops.greater(a, 0.0)
    size = ops.cast(ops.size(a), "int32")
    raw = [count(ops.equal(a, 0.0)), ops.subtract(size, count(ops.isfinite(a)))]
    for t in TARGETS:
        overflow_at, subnormal_below, flush_at = (float(np.float32(c)) for c in THRESHOLDS[t])
        raw.append(count(ops.greater_equal(v, overflow_at)))
        raw.append(count(ops.logical_and(ops.greater(v, flush_at), ops.less(v, subnormal_below))))
        raw.append(count(ops.logical_and(positive, ops.less_equal(v, flush_at))))
    # NaN wins, written out (XLA's CPU reduce-max on TensorFlow drops it); the maximum with 0
    # makes an empty tensor's 0
    nan = ops.any(ops.isnan(a))
    top = ops.max(ops.concatenate([a, ops.zeros((1,), "float32")]))
    amax = ops.where(nan, float("nan"), top)
    min_nonzero = ops.min(ops.concatenate([ops.where(positive, a, math.inf), ops.full((1,), math.inf, "float32")]))
    mags = [amax, min_nonzero]
    if formats:
        rows, cols, padded = block_layout(x.shape)
        blocks = ops.pad(ops.reshape(a, (rows, cols)), [[0, 0], [0, padded - cols]])
        block_counts, block_sums = block_error_arrays(blocks, formats, _block_ops(blocks))
        raw += [ops.cast(c, "int32") for c in block_counts]
        mags += block_sums
    return ops.stack(raw), ops.stack(mags)


def _block_ops(like: Any) -> Any:
    """The engine's array namespace for the block formats: :func:`unimp.keras.fp8.fp8_ops`
    (JAX's and torch's ``FP8Ops``), TensorFlow's on the TensorFlow engine."""
    if keras.backend.backend() == "tensorflow":
        from unimp.backends.tensorflow.fp8 import FP8Ops

        return FP8Ops
    from unimp.keras.fp8 import fp8_ops

    return fp8_ops(like)


def _entry(x: Any, scale: Any = 1.0, formats: tuple[str, ...] = ()) -> Entry:
    counts, mags = tensor_stats(x, scale, formats)
    return counts, mags, ops.cast(ops.size(x), "int32")


def _merge(a: Entry, b: Entry) -> Entry:
    """The statistics of two tensors taken together (one layer called twice, or on every
    micro-batch): sizes and counts add, the larger ``amax`` (NaN wins), the smaller
    ``min_nonzero``, the block sums in the larger unit (:func:`unimp.stats.merge_block_sums`)."""
    (ca, ma, na), (cb, mb, nb) = a, b
    amax = ops.where(ops.logical_or(ops.isnan(ma[0]), ops.isnan(mb[0])), float("nan"), ops.maximum(ma[0], mb[0]))
    mags = [ops.reshape(amax, (1,)), ops.reshape(ops.minimum(ma[1], mb[1]), (1,))]
    if ops.shape(ma)[0] > 2:
        mags += merge_block_sums(ma[2:3], ma[3:], mb[2:3], mb[3:], ops.where)
    return ops.add(ca, cb), ops.concatenate(mags), ops.add(na, nb)


def relative_path(model: Any, path: str) -> str:
    """A ``variable.path`` or ``layer.path`` relative to ``model``: without the model's own
    name, which Keras puts first in a Sequential's and a subclassed model's paths but not in a
    functional model's (``"sequential/l1/kernel"`` -> ``"l1/kernel"``). Statistics and step logs
    name Keras tensors so, as torch names them from the model down (``"l1.weight"``).

    Example:
        >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="l1")])
        >>> [relative_path(m, v.path) for v in m.weights]
        ['l1/kernel', 'l1/bias']
    """
    head = f"{model.name}/"
    return path[len(head):] if path.startswith(head) else path


def leaf_layers(model: Any) -> list[tuple[str, Any]]:
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


def unique_name(name: str, taken: Any) -> str:
    """``name``, or ``name#2``, ``name#3``, ... when taken: two variables with one path (a
    Keras model can have them) keep both, in the statistics and in the finite flags alike."""
    key, i = name, 1
    while key in taken:
        i += 1
        key = f"{name}#{i}"
    return key


class Collector:
    """What a statistics step records: the outputs of every leaf layer (at scale 1, every call
    merged) and the unscaled gradients (at the step's scale), as device tensors (graph tensors
    while a step traces).

    Args:
        entry: ``entry(x, scale, formats) -> (counts, magnitudes, size)``, the backend's
            statistics of one tensor (default: this module's, on ``keras.ops``).
        merge: two entries taken together (default: this module's).
        is_floating: the backend's test for a floating output tensor.
        formats: the block formats measured on every tensor (the step's ``stats_formats``).
    """

    def __init__(
        self,
        entry: Callable[..., Entry] = _entry,
        merge: Callable[[Entry, Entry], Entry] = _merge,
        is_floating: Callable[[Any], bool] = _is_floating,
        formats: tuple[str, ...] = (),
    ) -> None:
        self.activations: dict[str, Entry] = {}
        self.gradients: dict[str, Entry] = {}
        self._entry, self._merge, self._is_floating = entry, merge, is_floating
        self.formats = check_formats(formats)

    def add_activation(self, name: str, out: Any) -> None:
        for key, t in output_leaves(out, name, self._is_floating):
            entry = self._entry(t, 1.0, self.formats)
            old = self.activations.get(key)
            self.activations[key] = entry if old is None else self._merge(old, entry)

    def add_gradients(self, named: list[tuple[str, Any]], scale: Any) -> None:
        for name, g in named:
            self.gradients[unique_name(name, self.gradients)] = self._entry(g, scale, self.formats)

    @contextlib.contextmanager
    def recording(self, model: Any) -> Iterator[None]:
        """Wraps ``call`` of every leaf layer of ``model`` (an instance attribute, over
        whatever ``call`` the layer has: a prepared model's output cast included) so each
        output is recorded; the layers get their own ``call`` back on exit."""
        saved = []
        try:
            for name, layer in leaf_layers(model):
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

    def order(self) -> tuple[list[str], list[str]]:
        """The names in the order they were recorded (the model's), for :func:`pending`."""
        return list(self.gradients), list(self.activations)


def grad_flags(named: list[tuple[str, Any]]) -> tuple[list[str], Any]:
    """One finite flag per gradient (a bool vector, in the order of ``named``, named as the
    statistics name them): which gradient went non-finite first, on a logged step."""
    names: list[str] = []
    flags = []
    for name, g in named:
        names.append(unique_name(name, names))
        flags.append(ops.all(ops.isfinite(g)))
    return names, ops.stack(flags) if flags else ops.zeros((0,), "bool")


def pending(
    step: int, scale: Any, arrays: dict[str, dict[str, Entry]], order: Any,
    to_numpy: Callable[[Any], Any] = ops.convert_to_numpy, formats: tuple[str, ...] = (),
) -> Callable[[], StepStats]:  # fmt: skip
    """A function building the :class:`unimp.stats.StepStats` from the step's output tensors
    when called (the read back to the host happens then).

    Args:
        step: the step's index.
        scale: the step's loss scale (a device scalar).
        arrays: what :meth:`Collector.outputs` returned (after the step ran).
        order: :meth:`Collector.order`.
        to_numpy: the backend's device-to-host read.
        formats: the block formats the arrays hold (:attr:`Collector.formats`).
    """

    def build() -> StepStats:
        s = float(np.asarray(to_numpy(scale)))

        def host(group: dict[str, Entry], at: float) -> dict[str, Any]:
            return {
                n: (int(np.asarray(to_numpy(z))), at, np.asarray(to_numpy(c)), np.asarray(to_numpy(m)))
                for n, (c, m, z) in group.items()
            }

        return StepStats.from_arrays(
            step, host(arrays["gradients"], s), host(arrays["activations"], 1.0), order=order, formats=formats
        )

    return build
