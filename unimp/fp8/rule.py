"""The FP8 scaling rule and the quantize-dequantize rule, written once over an array namespace,
and their NumPy reference."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from unimp.fp8.config import (
    _F32_MAX,
    MAX_SCALE,
    STATE_FIELDS,
    CurrentScaling,
    DelayedScaling,
    FP8Config,
    FP8State,
)

#: torchao ``amax_to_scale`` clamps the amax at ``EPS = 1e-12`` (a float64) before dividing.
_TORCHAO_EPS = 1e-12


def _f32_at_least(x: float) -> float:
    """The smallest float32 >= the float64 ``x``: ``a < x`` iff ``a < this`` for float32 ``a``."""
    f = np.float32(x)
    return float(f if float(f) >= x else np.nextafter(f, np.float32(np.inf)))


class NumpyOps:
    """The array namespace of the reference: NumPy float32 arrays, ml_dtypes float8.

    A backend provides the same names on its own tensors (see ``unimp/backends/*/fp8.py``).
    """

    where = staticmethod(np.where)
    isfinite = staticmethod(np.isfinite)
    isnan = staticmethod(np.isnan)
    isinf = staticmethod(np.isinf)
    abs = staticmethod(np.abs)
    floor = staticmethod(np.floor)
    log2 = staticmethod(np.log2)
    exp2 = staticmethod(np.exp2)

    @staticmethod
    def f32(x: Any) -> Any:
        return np.asarray(x, np.float32) if isinstance(x, np.ndarray) else np.float32(x)

    @staticmethod
    def reciprocal(x: Any) -> Any:
        """``1 / x`` in float32, IEEE-rounded, subnormals kept (NumPy does not flush them).
        Namespaces whose framework flushes subnormals to 0 (XLA and TensorFlow on CPU and
        GPU) use :func:`ieee_reciprocal` instead: the same bits."""
        with np.errstate(divide="ignore", over="ignore"):
            return np.float32(1.0) / np.asarray(x, np.float32)[()]

    @staticmethod
    def amax(x: Any) -> Any:
        """Max over every element, NaN-propagating (as np.max, torch.max, tf.reduce_max); 0
        over no element (an empty batch: amax is max(abs(x)) with initial 0), in every backend."""
        return np.float32(np.max(x)) if np.size(x) else np.float32(0)

    @staticmethod
    def push(history: Any, amax: Any) -> Any:
        """``[amax, history[0], ..., history[L-2]]``: newest first, the oldest dropped."""
        return np.concatenate([np.reshape(np.float32(amax), (1,)), history[:-1]])

    @staticmethod
    def clip(x: Any, lo: float, hi: float) -> Any:
        return np.clip(x, np.float32(lo), np.float32(hi))  # NaN stays NaN

    @staticmethod
    def pow2_floor(x: Any) -> Any:
        """Clears the 23 mantissa bits of a float32 (TE: ``scale_bits &= 0xFF800000``)."""
        bits = np.asarray(x, np.float32).view(np.int32) & np.int32(-0x800000)
        return bits.view(np.float32)[()] if np.ndim(x) == 0 else bits.view(np.float32)

    @staticmethod
    def to_fp8(x: Any, dtype: str) -> Any:
        import ml_dtypes  # NumPy's float8 dtypes (a dependency; imported when first needed)

        return np.asarray(x, np.float32).astype(getattr(ml_dtypes, dtype))

    @staticmethod
    def to_f32(x: Any) -> Any:
        return np.asarray(x).astype(np.float32)

    @staticmethod
    def round_fp8(x: Any, dtype: str) -> Any:
        """``x`` (float32, within the format's range) rounded to the nearest ``dtype`` value,
        ties to even, as float32: ``to_f32(to_fp8(x))``. A backend whose compiler may delete a
        ``float32 -> float8 -> float32`` cast pair (XLA's excess-precision simplification on
        GPU, openxla/xla#41605) writes the rounding in ops that it keeps."""
        return NumpyOps.to_f32(NumpyOps.to_fp8(x, dtype))

    @staticmethod
    def bits(x: Any) -> Any:
        return np.asarray(x, np.float32).view(np.int32)

    @staticmethod
    def round(x: Any) -> Any:
        """Round half to even (np.round, torch.round, tf.round, jnp.round alike)."""
        return np.round(x)

    @staticmethod
    def reshape(x: Any, shape: tuple[int, ...]) -> Any:
        return np.reshape(x, shape)

    @staticmethod
    def amax_axes(x: Any, axes: tuple[int, ...]) -> Any:
        """The NaN-propagating max over ``axes``, kept (a 2-D tile's amax, for its scale)."""
        return np.max(x, axis=tuple(axes), keepdims=True)

    @staticmethod
    def sum(x: Any) -> Any:
        """The sum of every element, 0-d, in ``x``'s dtype (a share or an error over a tensor)."""
        return np.sum(x)

    @staticmethod
    def concat(xs: Any, axis: int) -> Any:
        """The arrays ``xs`` joined along their existing ``axis`` (the Hadamard transform's
        butterflies)."""
        return np.concatenate(xs, axis=axis)

    @staticmethod
    def from_bits(b: Any) -> Any:
        return np.asarray(b, np.int32).view(np.float32)

    @staticmethod
    def to_i32(x: Any) -> Any:
        return np.asarray(x).astype(np.int32)

    @staticmethod
    def cast_like(x: Any, like: Any) -> Any:
        return np.asarray(x).astype(np.asarray(like).dtype)


def ieee_reciprocal(ops: Any, x: Any) -> Any:
    """``1 / x`` for float32 ``x`` (the rule's 0-d scales), rounded as IEEE 754 division rounds it, also
    where ``x`` or the result is subnormal, with no subnormal value going through arithmetic.

    XLA and TensorFlow flush subnormal results and operands to 0 (FTZ / DAZ) on CPU and GPU,
    so their ``1 / x`` of a scale above 2**126 is 0 where NumPy and torch give a subnormal
    (Transformer Engine caps an infinite scale at FLT_MAX and takes ``1 / FLT_MAX`` =
    2.938736e-39); a state saved that way is refused on load. Here a subnormal result is built
    from its bit pattern ``k = round_half_even(2**149 / x)``, found with normal-range float32
    and int32 arithmetic only (a float32 quotient, then the exact remainder through 12-bit
    halves, no product above 2**24), and a subnormal ``x`` is read through its bits ``b``:
    ``1 / x = (2**23 / b) * 2**126``. Elsewhere it is ``1 / x``, the framework's division:
    inside a ``tf.function`` TensorFlow's CPU kernels may divide a vector of 8 or more elements
    by an approximate reciprocal, an ulp off (0-d values are exact). The namespace needs ``bits``
    (float32 -> int32 bit pattern), ``from_bits`` and ``to_i32`` besides the usual names.
    """
    f, i = ops.f32, ops.to_i32
    plain = f(1.0) / x
    # a subnormal result, x in (2**126, 2**128): y = x / 2**126 in (1, 4), m its 24-bit
    # significand as an integer; the result's bit pattern is 2**s / m, s = 46 (y < 2) or 45
    big = ops.isfinite(x) & (x > f(2.0**126))
    y = ops.where(big, x, f(2.0**127)) * f(2.0**-126)
    high = y >= f(2.0)
    m = ops.where(high, y * f(2.0**22), y * f(2.0**23))
    q = ops.where(high, f(2.0**45), f(2.0**46)) / m  # in (2**21, 2**23], within 1/4 of 2**s / m
    k0 = ops.floor(q)
    kh = ops.floor(k0 * f(2.0**-12))
    kl = k0 - kh * f(4096.0)
    mh = ops.floor(m * f(2.0**-12))
    ml = m - mh * f(4096.0)
    # r = 2**s - k0 * m exactly, |r| < 2**25: 2**s = 2**(s - 24) * 2**24, the product in halves
    top = ops.where(high, i(f(2.0**21)), i(f(2.0**22)))
    part = (top - i(kh) * i(mh)) * 4096 - (i(kh) * i(ml) + i(kl) * i(mh))
    r2 = (part * 4096 - i(kl) * i(ml)) * 2
    mi = i(m)
    odd = (k0 - f(2.0) * ops.floor(k0 * f(0.5))) == f(1.0)
    up = (r2 > mi) | ((r2 == mi) & odd)  # round half to even
    k = ops.where(up, i(k0) + 1, i(k0))
    below = ops.from_bits(ops.where(big, k, 0))
    # a subnormal x (bit pattern b in 1 .. 2**23 - 1): 1 / (b * 2**-149)
    b = ops.bits(x)
    small = (b > 0) & (b < 2**23)
    above = f(2.0**23) / ops.to_f32(ops.where(small, b, 1)) * f(2.0**126)
    return ops.where(small, above, ops.where(big, below, plain))


def _valid(ops: Any, amax: Any) -> Any:
    return ops.isfinite(amax) & (amax > ops.f32(0.0))


def _delayed(ops: Any, cfg: DelayedScaling, scale: Any, scale_inv: Any, hist: Any, amax: Any, fmax: float):
    f32max = ops.f32(_F32_MAX)
    if cfg.rule in ("keras", "flax"):
        # compute_float8_scale / compute_scale: sf = (max / amax) / 2**margin, kept at
        # 1 / stored_divisor (== our scale) unless 0 < amax < inf; the divisor is 1 / sf.
        window = ops.amax(hist)
        sf = ops.f32(fmax) / window / ops.f32(2.0**cfg.margin)
        sf = ops.where(window > ops.f32(0.0), sf, scale)
        sf = ops.where(ops.isfinite(window), sf, scale)
        new_inv = ops.reciprocal(sf)
        new_scale = ops.reciprocal(new_inv)
        new_hist = ops.push(hist, amax)
        if cfg.rule == "flax":  # updated before use: quantizes with the new scale
            return (new_scale, new_inv), (new_scale, new_inv, new_hist)
        return (scale, scale_inv), (new_scale, new_inv, new_hist)  # keras: stored for next step
    scaled_max = ops.f32(float(np.float32(fmax) * np.float32(2.0 ** -cfg.margin)))
    pushed = ops.push(hist, amax)
    if cfg.rule == "transformer_engine":
        # delayed_scaling.cu kernel_bulk: a step whose amax is 0 is not recorded (no roll) and
        # keeps the scale; the window max is fmaxf from 0, which skips NaN.
        skip = amax == ops.f32(0.0)
        new_hist = ops.where(skip, hist, pushed)
        if cfg.amax_compute_algo == "max":
            window = ops.amax(ops.where(ops.isnan(pushed), ops.f32(0.0), pushed))
        else:
            window = amax
        window = ops.where(skip, ops.f32(0.0), window)
    else:
        new_hist = pushed
        window = ops.amax(pushed) if cfg.amax_compute_algo == "max" else amax
    new_scale = ops.where(_valid(ops, window), scaled_max / window, scale)
    if cfg.rule == "transformer_engine":
        new_scale = ops.where(ops.isinf(new_scale), f32max, new_scale)
    else:
        new_scale = ops.where(new_scale > ops.f32(MAX_SCALE), ops.f32(MAX_SCALE), new_scale)
    return (scale, scale_inv), (new_scale, ops.reciprocal(new_scale), new_hist)


def _current(ops: Any, cfg: CurrentScaling, amax: Any, fmax: float) -> Any:
    if cfg.rule == "torchao":
        # amax_to_scale: float64(max) / clamp(float64(amax), 1e-12), rounded to float32. The
        # float32 quotient is the same number (double rounding of a quotient is innocuous for
        # 53 >= 2 * 24 + 2 bits), so float32 arithmetic reproduces it on every backend.
        tiny = ops.f32(float(np.float32(fmax / _TORCHAO_EPS)))
        s = ops.where(amax < ops.f32(_f32_at_least(_TORCHAO_EPS)), tiny, ops.f32(fmax) / amax)
        if cfg.power_of_2_scales:
            s = ops.exp2(ops.floor(ops.log2(s)))  # _round_scale_down_to_power_of_2
        return s
    # current_scaling.cu / recipe_common.cuh compute_scale_from_amax (epsilon 0, float32 input)
    s = ops.where(_valid(ops, amax), ops.f32(fmax) / amax, ops.f32(1.0))
    if cfg.rule == "transformer_engine":
        s = ops.where(ops.isinf(s), ops.f32(_F32_MAX), s)
    else:
        s = ops.where(s > ops.f32(MAX_SCALE), ops.f32(MAX_SCALE), s)
    if cfg.power_of_2_scales:
        s = ops.pow2_floor(s)
    return s


def step_arrays(
    ops: Any, config: FP8Config, role: str, scale: Any, scale_inv: Any, amax_history: Any, amax: Any
) -> tuple[tuple[Any, Any], tuple[Any, Any, Any]]:
    """One step of one tensor's scaling, branch-free, over any array namespace.

    Python branches depend only on the (static) config, so this traces under ``jax.jit`` and
    ``tf.function``; backends call it with their own tensors.

    Args:
        ops: the array namespace (see :class:`NumpyOps` for the names it needs).
        config: a :class:`DelayedScaling` or :class:`CurrentScaling`.
        role: ``"forward"`` (inputs, weights) or ``"backward"`` (gradients): picks the format.
        scale: float32 0-d, the state before the step.
        scale_inv: float32 0-d, the state before the step.
        amax_history: float32 ``(L,)``, newest first.
        amax: float32 0-d, this step's ``max(abs(x))`` of the tensor (may be 0, inf, NaN).

    Returns:
        ``((scale, scale_inv) to quantize this step with, (scale, scale_inv, amax_history)
        after the step)``.

    Raises:
        ValueError: a state whose shapes are not 0-d scales and an ``(amax_history_len,)``
            history (a longer history would silently widen the window).
    """
    fmax = config.fp8_max(role)
    shapes = {"scale": scale, "scale_inv": scale_inv, "amax_history": amax_history}
    want = {"scale": (), "scale_inv": (), "amax_history": (config.amax_history_len,)}
    for name, x in shapes.items():  # static shapes in every framework: no sync, no retrace
        shape = tuple(getattr(x, "shape", ()))
        if None not in shape and tuple(int(d) for d in shape) != want[name]:
            raise ValueError(
                f"FP8 state {name!r} has shape {shape}, the config needs {want[name]} "
                f"(amax_history_len={config.amax_history_len}); build the state with "
                "FP8State.initial(config) or load one saved with the same config."
            )
    with _scope(ops, "fp8_scale_update"):
        if isinstance(config, CurrentScaling):
            s = _current(ops, config, amax, fmax)
            inv = ops.reciprocal(s)
            return (s, inv), (s, inv, ops.push(amax_history, amax))
        return _delayed(ops, config, scale, scale_inv, amax_history, amax, fmax)


def _scope(ops: Any, name: str) -> Any:
    """``ops.scope(name)`` where the namespace has one (a backend naming the rule's ops for
    its trace: ``fp8_amax``, ``fp8_scale_update``), else a no-op context."""
    import contextlib

    scope = getattr(ops, "scope", None)
    return contextlib.nullcontext() if scope is None else scope(name)


def qdq_arrays(ops: Any, x: Any, scale: Any, scale_inv: Any, dtype: str, fmax: float) -> Any:
    """Quantize-dequantize: ``float8(clip(float32(x) * scale, -max, max)) * scale_inv``.

    The product is rounded once in float32, clipped (saturation; NaN stays NaN), rounded to
    nearest even into ``dtype``, widened back and multiplied by ``scale_inv``, then cast to
    ``x``'s dtype. Only multiplications: XLA rewrites ``x / s`` as ``x * (1 / s)``, so a rule
    that divides cannot be matched bit for bit under JAX; this one is, in every framework.

    Args:
        x: any floating array; scale, scale_inv: float32 0-d.
        dtype: ``"float8_e4m3fn"`` or ``"float8_e5m2"``; fmax: its largest finite value.

    Returns:
        An array of ``x``'s shape and dtype.
    """
    return ops.cast_like(quantize_arrays(ops, x, scale, dtype, fmax) * scale_inv, x)


def quantize_arrays(ops: Any, x: Any, scale: Any, dtype: str, fmax: float) -> Any:
    """The float8 values of ``x`` as float32: ``float32(float8(clip(float32(x) * scale)))``.

    The emulated float8 matmul (every backend's FP8 layer) multiplies these exactly-representable
    values and scales the float32 result once, as a float8 GEMM does
    (``D = (A_q @ B_q) * (scale_inv_a * scale_inv_b)``)::

        y  = (Q(x) @ Q(w)) * (x.scale_inv * w.scale_inv)          # forward, e4m3
        dx = (Q(g) @ Q(w)^T) * (g.scale_inv * w.scale_inv)        # backward, g in e5m2
        dw = (Q(x)^T @ Q(g)) * (x.scale_inv * g.scale_inv)

    ``g`` is the output gradient as it flows in backward: with loss scaling, the SCALED
    gradient (before unscaling), as Keras records it; its amax and its scale are taken on that
    tensor in every backend (docs/fp8.md).
    """
    return ops.round_fp8(ops.clip(ops.to_f32(x) * scale, -fmax, fmax), dtype)


def amax_of(ops: Any, x: Any, config: FP8Config | None = None) -> Any:
    """``max(abs(x))`` in float32, the amax the ``config``'s implementation records; 0 for an
    empty ``x`` (the rule then treats it as any amax 0, per preset).

    NaN-propagating (Keras, flax and torchao take ``max(abs(x))``), except under the
    ``transformer_engine`` rule: Transformer Engine's cast kernels reduce the amax with
    ``fmaxf``, which ignores NaN elements, so an all-NaN ``x`` records 0 (and its step is then
    not recorded, as every amax of 0). ``config=None`` is NaN-propagating."""
    with _scope(ops, "fp8_amax"):
        a = ops.abs(ops.to_f32(x))
        if config is not None and config.rule == "transformer_engine":
            a = ops.where(ops.isnan(a), ops.f32(0.0), a)
        return ops.amax(a)


def window_merge(ops: Any, best: tuple[FP8State, Any] | None, new: FP8State, amax: Any) -> tuple[FP8State, Any]:
    """One micro-batch of a gradient-accumulation window, folded into the window's result.

    The convention of every backend: under ``grad_accum_steps = k`` a float8 tensor's scaling
    takes ONE step per optimizer step. Every micro-batch of the window quantizes with the
    state the window started from (delayed scaling: its stored scale; current scaling: the
    micro-batch's own amax), and the state after the window is the rule run once on the
    largest amax of the window's micro-batches, each micro-batch's own (a gradient's: that
    micro-batch's own output gradient at the loss scale, not 1/k of it). All micro-batches
    start from the same state, so that state is the one of the micro-batch with the largest
    amax, which this keeps: ``best`` is ``(state, key)`` so far (``None`` before the first),
    ``new`` this micro-batch's state after the rule, ``amax`` its amax (a NaN counts as the
    largest, an inf-sized key; a tie keeps the earlier). Returns the new ``(state, key)``.
    """
    key = ops.where(ops.isnan(amax), ops.f32(float("inf")), ops.f32(amax))
    if best is None:
        return new, key
    state, best_key = best
    take = key > best_key
    merged = FP8State(*(ops.where(take, getattr(new, f), getattr(state, f)) for f in STATE_FIELDS))
    return merged, ops.where(take, key, best_key)


def recorded_amax(ops: Any, after: FP8State) -> Any:
    """The amax a step recorded, read from the state after it (for :func:`window_merge` where
    only the states are seen, as JAX's train step sees the ``model_state``): the newest
    history entry. Exact wherever the rule records every amax; under the
    ``transformer_engine`` rule an amax of 0, which it does not record, reads as the newest
    entry already there (the step left the state as it was, and a window whose other
    micro-batches are all below that entry keeps it so). A state whose scale is 0 (a layer
    that did not run: its state's "gradient" is 0) gives ``-inf``."""
    key = ops.f32(after.amax_history[0])
    return ops.where(after.scale == ops.f32(0.0), ops.f32(float("-inf")), key)


def step(config: FP8Config, state: FP8State, amax: float, role: str = "forward") -> tuple[Any, FP8State]:
    """One step of the NumPy reference.

    Returns:
        ``((scale, scale_inv) used this step, state after the step)``.
    """
    with np.errstate(all="ignore"):
        used, new = step_arrays(
            NumpyOps, config, role, np.float32(state.scale), np.float32(state.scale_inv),
            np.asarray(state.amax_history, np.float32), np.float32(amax),
        )
    sc, inv, hist = new
    return (np.float32(used[0]), np.float32(used[1])), FP8State(
        np.float32(sc), np.float32(inv), np.asarray(hist, np.float32)
    )


def simulate(
    config: FP8Config, amaxes: Iterable[float], role: str = "forward", state: FP8State | None = None
) -> list[tuple[Any, Any, FP8State]]:
    """Runs the reference over a sequence of per-step maxima.

    Args:
        amaxes: per step, the tensor's ``max(abs(x))``: real numbers >= 0, ``inf`` or ``nan``.

    Returns:
        Per step, ``(scale used, scale_inv used, state after the step)``.

    Raises:
        TypeError: an entry that is not a real number (a string, None, a bool).
        ValueError: a negative entry. Both name ``amaxes[i]``, as the CLI's ``--amaxes`` names
            its entries; nothing is run.

    Example:
        >>> out = simulate(DelayedScaling(amax_history_len=2), [4.0, 0.0, 8.0])
        >>> [float(s) for s, _, _ in out]
        [1.0, 112.0, 112.0]
    """
    values = _amaxes(amaxes)
    s = FP8State.initial(config) if state is None else state
    out = []
    for a in values:
        (sc, inv), s = step(config, s, a, role)
        out.append((sc, inv, s))
    return out


def _amaxes(amaxes: Iterable[Any]) -> list[float]:
    """``amaxes`` as floats, each a real number >= 0 (or inf / NaN, an amax the rule handles)."""
    out = []
    for i, a in enumerate(amaxes):
        v = np.asarray(a) if not isinstance(a, str) else None
        if v is None or v.ndim != 0 or v.dtype.kind not in "fiu":  # bool, str, None, arrays
            raise TypeError(f"simulate: amaxes[{i}] must be a number (0, inf, nan, 3.5, ...), got "
                            f"{type(a).__name__} {a!r}.")
        if v < 0:
            raise ValueError(f"simulate: amaxes[{i}] is negative ({a!r}): an amax is max(abs(x)) >= 0.")
        out.append(float(v))
    return out


def quantize_dequantize(x: Any, scale: float, scale_inv: float, dtype: str) -> np.ndarray:
    """The NumPy reference of :func:`qdq_arrays` (``dtype``: a float8 dtype name).

    Raises:
        ValueError: ``dtype`` is not ``"float8_e4m3fn"`` or ``"float8_e5m2"`` (the closest named).
    """
    from unimp.fp8.config import FP8_MAX, _choice

    dtype = _choice("quantize_dequantize", "dtype", dtype, tuple(FP8_MAX))

    with np.errstate(all="ignore"):
        return qdq_arrays(NumpyOps, np.asarray(x), np.float32(scale), np.float32(scale_inv), dtype, FP8_MAX[dtype])
