"""JAX tensor statistics: :func:`tensor_stats` (traceable, no host sync), :func:`observe` to name
an activation for a statistics step, and what that step records while it traces (observed
values and flax linen module outputs).

The definitions are :mod:`unimp.stats`'s: ``v = |x|`` as float32 times the scale as float32,
compared with the float32 constants of :data:`unimp.stats.THRESHOLDS`; the block formats'
errors are :func:`unimp.stats.block_error_arrays` on :class:`FP8Ops` arrays. XLA on the CPU
reads float32 subnormals as zero (see :mod:`unimp.stats`).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from unimp.backends.jax.fp8 import FP8Ops, _max_keeping_nan
from unimp.stats import (
    TARGETS,
    THRESHOLDS,
    StepStats,
    block_error_arrays,
    block_layout,
    check_formats,
    check_scale,
    merge_block_sums,
)

#: One tensor's statistics: ``(counts, magnitudes, size)``, size an int32 scalar array.
Entry = tuple[jax.Array, jax.Array, jax.Array]


def tensor_stats(x: Any, scale: Any = 1.0, formats: Any = ()) -> tuple[jax.Array, jax.Array]:
    """The statistics of ``x`` at ``scale``, as arrays (traceable under ``jit``, ``grad``,
    ``vmap``; no host sync).

    Args:
        x: a floating array of any shape and dtype (float16, bfloat16, float32, float64).
        scale: a finite number > 0, or a float32 scalar array (the loss scale; not checked, so
            nothing is read from the device).
        formats: block formats whose quantization error to take as well
            (:func:`unimp.stats.check_formats`; none by default).

    Returns:
        ``(counts, magnitudes)``: ``counts`` int32 of shape
        ``(len(unimp.stats.count_fields(formats)),)`` in that order, ``magnitudes`` float32
        of shape ``(len(unimp.stats.magnitude_fields(formats)),)``: ``amax`` (NaN when an
        element is NaN, 0 for an empty array), ``min_nonzero`` (``inf`` when no element is
        nonzero), then the block sums. Equal to :func:`unimp.stats.reference_stats`.

    Raises:
        TypeError: ``x`` is not floating.
        ValueError: a host ``scale`` that is not a finite number > 0, or an unknown block
            format.

    Example:
        >>> import jax.numpy as jnp
        >>> from unimp.stats import COUNT_FIELDS
        >>> c, m = tensor_stats(jnp.array([65519.0, 65520.0, 0.0]))
        >>> int(c[COUNT_FIELDS.index("float16_overflow")]), int(c[COUNT_FIELDS.index("zeros")])
        (1, 1)
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"tensor_stats needs a floating array, got {x.dtype}.")
    if not isinstance(scale, jax.Array):  # a host number (tracers are jax.Array too)
        scale = check_scale(scale)
    formats = check_formats(formats)
    a = jnp.abs(jax.lax.stop_gradient(x)).reshape(-1).astype(jnp.float32)
    if isinstance(scale, jax.Array):
        v = a * scale.astype(jnp.float32)
    else:
        v = a if scale == 1.0 else a * np.float32(scale)
    def count(mask: jax.Array) -> jax.Array:
        return jnp.sum(mask, dtype=jnp.int32)

    # the reference's comparisons, literally (see the torch backend's tensor_stats)
    positive = a > 0
    raw = [count(a == 0), a.size - count(jnp.isfinite(a))]
    for t in TARGETS:
        overflow_at, subnormal_below, flush_at = (np.float32(c) for c in THRESHOLDS[t])
        raw.append(count(v >= overflow_at))
        raw.append(count((v > flush_at) & (v < subnormal_below)))
        raw.append(count(positive & (v <= flush_at)))
    # NaN wins (XLA's CPU reduce-max drops it: the FP8 amax's helper); 0 for an empty array
    amax = jnp.reshape(_max_keeping_nan(a, None), ()) if a.size else jnp.float32(0.0)
    mags = [amax, jnp.min(jnp.where(positive, a, jnp.float32(math.inf)), initial=math.inf)]
    if formats:
        rows, cols, padded = block_layout(x.shape)
        blocks = jnp.pad(a.reshape(rows, cols), ((0, 0), (0, padded - cols)))
        block_counts, block_sums = block_error_arrays(blocks, formats, FP8Ops)
        raw += block_counts
        mags += block_sums
    return jnp.stack(raw).astype(jnp.int32), jnp.stack(mags).astype(jnp.float32)


def _entry(x: Any, scale: Any = 1.0, formats: tuple[str, ...] = ()) -> Entry:
    counts, mags = tensor_stats(x, scale, formats)
    return counts, mags, jnp.int32(np.size(x))


def _merge(a: Entry, b: Entry) -> Entry:
    """The statistics of two tensors taken together (one name observed twice): sizes and
    counts add, the larger ``amax`` (NaN wins), the smaller ``min_nonzero``, the block sums in
    the larger unit (:func:`unimp.stats.merge_block_sums`)."""
    (ca, ma, na), (cb, mb, nb) = a, b
    mags = [jnp.maximum(ma[0], mb[0])[None], jnp.minimum(ma[1], mb[1])[None]]
    if ma.shape[0] > 2:
        mags += merge_block_sums(ma[2:3], ma[3:], mb[2:3], mb[3:], jnp.where)
    return ca + cb, jnp.concatenate(mags), na + nb


def _merge_stacked(entry: Entry) -> Entry:
    """:func:`_merge` over a leading axis (one entry per micro-batch, from ``lax.scan``), in
    micro-batch order."""
    counts, mags, size = entry
    out = (counts[0], mags[0], size[0])
    for i in range(1, counts.shape[0]):
        out = _merge(out, (counts[i], mags[i], size[i]))
    return out


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_name(path: tuple[Any, ...]) -> str:
    """A pytree path as a name: its keys joined with ``/`` (``{"l1": {"kernel": w}}`` gives
    ``"l1/kernel"``; list items by index, the root leaf ``""``)."""
    return "/".join(_key_name(k) for k in path)


def _gradient_stats(grads: Any, scale: Any, formats: tuple[str, ...] = ()) -> dict[str, Entry]:
    """The statistics of every floating leaf of ``grads`` at ``scale``, with the block
    ``formats``, by path name."""
    out: dict[str, Entry] = {}
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        if jnp.issubdtype(jnp.result_type(g), jnp.floating):
            out[path_name(path)] = _entry(g, scale, formats)
    return out


def _grad_flags(grads: Any) -> tuple[list[str], jax.Array]:
    """One finite flag per floating leaf of ``grads`` (a bool vector, named and ordered as
    :func:`_gradient_stats` names them): which gradient went non-finite first, on a logged step."""
    names, flags = [], []
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        if jnp.issubdtype(jnp.result_type(g), jnp.floating):
            names.append(path_name(path))
            flags.append(jnp.all(jnp.isfinite(g)))
    return names, jnp.stack(flags) if flags else jnp.zeros((0,), bool)


# -- what a statistics step's trace records ----------------------------------------------------

_ACTIVE = threading.local()


def _current_trace() -> Any:
    """JAX's current trace (what a value traced right now belongs to), or None where this
    JAX does not expose it (then nothing is checked)."""
    from jax._src import core

    ctx = getattr(core, "trace_ctx", None)
    return getattr(ctx, "trace", None)


class _Collector:
    """The activations recorded while the loss function of a statistics step traces, at the
    trace level of the loss function itself (values inside a transformation the loss function
    applies, such as ``lax.scan`` or ``jax.checkpoint``, cannot leave it), with the block
    ``formats``."""

    def __init__(self, formats: tuple[str, ...] = ()) -> None:
        self.entries: dict[str, Entry] = {}
        self.formats = formats
        self._trace = _current_trace()

    def at_loss_level(self) -> bool:
        return self._trace is None or _current_trace() is self._trace

    def record(self, name: str, x: Any) -> None:
        leaves = jax.tree_util.tree_flatten_with_path(x)[0]
        for path, leaf in leaves:
            if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
                continue
            # the output-naming rule of every backend (unimp.stats.output_leaves): name.0, name.key
            key = ".".join([name, *(_key_name(k) for k in path)])
            entry = _entry(leaf, 1.0, self.formats)
            old = self.entries.get(key)
            self.entries[key] = entry if old is None else _merge(old, entry)


@contextlib.contextmanager
def _collecting(formats: tuple[str, ...] = ()) -> Iterator[_Collector]:
    """Activates a collector for :func:`observe` (and flax linen's module outputs, when flax is
    in use) while the loss function of a statistics step traces."""
    collector = _Collector(formats)
    stack = getattr(_ACTIVE, "stack", None)
    if stack is None:
        stack = _ACTIVE.stack = []
    stack.append(collector)
    try:
        with _flax_outputs(collector):
            yield collector
    finally:
        stack.pop()


def observe(name: str, x: Any) -> Any:
    """Names ``x`` (an activation) for the statistics of a JAX ``train_step(...,
    stats_every=k)``; returns ``x`` unchanged.

    Like flax's ``sow``: call it in ``loss_fn`` (or in the model code it calls) on what you
    want to see, e.g. ``h = observe("hidden", jax.nn.relu(x @ w1))``. On a statistics step
    the values observed while the step traces come back in ``result.stats.activations[name]``
    (at scale 1; a name observed more than once, or on every micro-batch, gets the statistics
    of all its values together; the leaves of a pytree are named ``name.0`` / ``name.key``,
    as torch and Keras name the items of a layer's tuple or dict output). Everywhere
    else, plain steps included, it is the identity and adds nothing to the computation.

    Args:
        name: the name in :attr:`unimp.stats.StepStats.activations`.
        x: an array or a pytree of arrays (non-floating leaves are ignored).

    Returns:
        ``x``.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: called, during a statistics step, inside a transformation the loss
            function applies itself (``lax.scan``, ``vmap``, ``jax.checkpoint``, ``nn.scan``):
            its values cannot leave it; observe the transformation's output instead.

    Example:
        >>> import jax.numpy as jnp
        >>> observe("h", jnp.ones(2))  # outside a statistics step: the identity
        Array([1., 1.], dtype=float32)
    """
    if not isinstance(name, str):
        raise TypeError(f"observe(name, x) takes a string name, got {type(name).__name__}.")
    stack = getattr(_ACTIVE, "stack", None)
    if stack:
        collector = stack[-1]
        if not collector.at_loss_level():
            raise ValueError(
                f"observe({name!r}, x) was called inside a transformation of the loss function "
                "(lax.scan, vmap, jax.checkpoint, nn.scan, ...) whose values cannot leave it: "
                "observe the transformation's output in the loss function instead."
            )
        collector.record(name, x)
    return x


@contextlib.contextmanager
def _flax_outputs(collector: _Collector) -> Iterator[None]:
    """While inside, the outputs of every flax linen module without submodules are recorded
    under their path (``"Dense_0"``, ``"Block_0/LayerNorm_0"``; the root module under its
    class name), when flax is already imported. Modules called inside a lifted transformation
    (``nn.scan``, ``nn.vmap``, ``nn.remat``) are left out. nnx modules are not seen: use
    :func:`observe`."""
    linen = sys.modules.get("flax.linen")
    intercept = getattr(linen, "intercept_methods", None)
    if intercept is None:
        yield
        return

    def interceptor(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        out = next_fun(*args, **kwargs)
        module = context.module
        if context.method_name == "__call__" and collector.at_loss_level():
            children = getattr(getattr(module, "_state", None), "children", {}) or {}
            if not any(isinstance(c, linen.Module) for c in children.values()):
                scope = getattr(module, "scope", None)
                path = tuple(getattr(scope, "path", ()) or ())
                collector.record("/".join(path) or type(module).__name__, out)
        return out

    with intercept(interceptor):
        yield


def _pending(step: int, arrays: dict[str, dict[str, Entry]], order: Any, formats: tuple[str, ...] = ()) -> Any:
    """A function building the :class:`unimp.stats.StepStats` from the step's output arrays
    when called (one ``jax.device_get`` of them all then)."""

    def build() -> StepStats:
        host = jax.device_get(arrays)
        s = float(host["scale"])

        def group(entries: dict[str, Any], at: float) -> dict[str, Any]:
            return {n: (int(z), at, c, m) for n, (c, m, z) in entries.items()}

        return StepStats.from_arrays(
            step, group(host["gradients"], s), group(host["activations"], 1.0), order=order, formats=formats
        )

    return build
