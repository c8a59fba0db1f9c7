"""JAX FP8: :mod:`unimp.fp8`'s scaling and quantize-dequantize rules on ``jnp`` arrays (they
trace under ``jax.jit``), and :func:`fp8_dot_general`, a float8 ``dot_general``: emulated by
default, with an opt-in native path (float8 operands for XLA's cuBLASLt float8 GEMM).

XLA:CPU's max reduction flushes float32 subnormals to zero: an amax below 2**-126 is recorded as
0 here on CPU, as TensorFlow records it, where NumPy and torch record the subnormal (docs/fp8.md).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from unimp import fp8 as _fp8
from unimp.backends.jax.devices import _capability
from unimp.dtypes import device_support
from unimp.fp8 import LAYER_TENSORS, STATE_FIELDS, FP8State

# FP8State is a pytree (every field an array leaf), derived from dataclasses.fields, so it
# passes through jax.jit, lax.scan and optax states.
jax.tree_util.register_dataclass(
    FP8State, data_fields=list(STATE_FIELDS), meta_fields=[]
)

_FP8_DTYPES = {"float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2}


class FP8Ops:
    """The FP8 rule's array namespace over ``jnp`` arrays."""

    scope = staticmethod(jax.named_scope)  # names the amax and scale-update ops in traces
    where = staticmethod(jnp.where)
    isfinite = staticmethod(jnp.isfinite)
    isnan = staticmethod(jnp.isnan)
    isinf = staticmethod(jnp.isinf)
    abs = staticmethod(jnp.abs)
    floor = staticmethod(jnp.floor)
    log2 = staticmethod(jnp.log2)
    exp2 = staticmethod(jnp.exp2)

    @staticmethod
    def f32(x: Any) -> jax.Array:
        return jnp.asarray(x, jnp.float32)

    @staticmethod
    def reciprocal(x: jax.Array) -> jax.Array:
        # XLA flushes subnormals (FTZ / DAZ): the exact rule, from bits (unimp.fp8.rule)
        return _fp8.ieee_reciprocal(FP8Ops, x)

    @staticmethod
    def bits(x: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)

    @staticmethod
    def from_bits(b: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(jnp.asarray(b, jnp.int32), jnp.float32)

    @staticmethod
    def to_i32(x: jax.Array) -> jax.Array:
        return jnp.asarray(x).astype(jnp.int32)

    @staticmethod
    def amax(x: jax.Array) -> jax.Array:
        # NaN-propagating (by hand: XLA's CPU reduce-max drops NaN in reductions of a few
        # thousand elements); 0 over no element, as the reference (jnp.max raises there; the
        # size is static under jit)
        if not jnp.size(x):
            return jnp.zeros((), jnp.asarray(x).dtype)
        return jnp.reshape(_max_keeping_nan(x, None), ())

    @staticmethod
    def push(history: jax.Array, amax: jax.Array) -> jax.Array:
        return jnp.concatenate([jnp.reshape(amax, (1,)).astype(history.dtype), history[:-1]])

    @staticmethod
    def clip(x: jax.Array, lo: float, hi: float) -> jax.Array:
        return jnp.clip(x, lo, hi)

    @staticmethod
    def pow2_floor(x: jax.Array) -> jax.Array:
        bits = jax.lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(-0x800000)
        return jax.lax.bitcast_convert_type(bits, jnp.float32)

    @staticmethod
    def to_fp8(x: jax.Array, dtype: str) -> jax.Array:
        return x.astype(_FP8_DTYPES[dtype])

    @staticmethod
    def to_f32(x: jax.Array) -> jax.Array:
        # a float16 / bfloat16 value rounded to its dtype again, in ops XLA keeps: inside jit
        # XLA may hold an earlier op's half result in float32 and drop its rounding (the
        # excess-precision simplification of round_fp8's note), so a bfloat16 layer's output
        # reached the amax unrounded (8.2099 where torch and TensorFlow read 8.1875)
        x = jnp.asarray(x)
        wide = x.astype(jnp.float32)
        if x.dtype == jnp.bfloat16:  # float32's exponent: reduce-precision keeps subnormals
            return jax.lax.reduce_precision(wide, exponent_bits=8, mantissa_bits=7)
        if x.dtype == jnp.float16:  # subnormals by their spacing (reduce-precision flushes them)
            normal = jax.lax.reduce_precision(wide, exponent_bits=5, mantissa_bits=10)
            return jnp.where(jnp.abs(wide) >= 2.0**-14, normal, jnp.round(wide * 2.0**24) * 2.0**-24)
        return wide

    @staticmethod
    def round_fp8(x: jax.Array, dtype: str) -> jax.Array:
        return round_fp8(x, dtype)

    @staticmethod
    def cast_like(x: jax.Array, like: jax.Array) -> jax.Array:
        return x.astype(jnp.asarray(like).dtype)

    # the block-scaled formats' names (unimp.blockscale)
    @staticmethod
    def round(x: jax.Array) -> jax.Array:
        return jnp.round(x)  # half to even

    @staticmethod
    def reshape(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        return jnp.reshape(x, shape)

    @staticmethod
    def amax_axes(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
        return _max_keeping_nan(x, tuple(axes))

    @staticmethod
    def sum(x: jax.Array) -> jax.Array:
        return jnp.sum(x)

    @staticmethod
    def concat(xs: Any, axis: int) -> jax.Array:
        return jnp.concatenate(xs, axis=axis)


def _max_keeping_nan(x: jax.Array, axes: tuple[int, ...] | None) -> jax.Array:
    """The max over ``axes`` (``None``: all), kept, NaN wherever a NaN was reduced: XLA's CPU
    reduce-max drops NaN in large reductions (jax 0.10: a row of 1,024, or 128x2x128 over two
    axes)."""
    m = jnp.max(x, axis=axes, keepdims=True)
    return jnp.where(jnp.any(jnp.isnan(x), axis=axes, keepdims=True), jnp.asarray(jnp.nan, m.dtype), m)


#: Per float8 dtype: (exponent bits, mantissa bits, smallest normal, subnormal spacing, whether
#: the format has no infinities and so reaches one exponent further (e4m3fn: 448 = 1.75 * 2**8)).
_ROUNDING = {
    "float8_e4m3fn": (4, 3, 2.0**-6, 2.0**-9, True),
    "float8_e5m2": (5, 2, 2.0**-14, 2.0**-16, False),
}


def round_fp8(x: jax.Array, dtype: str) -> jax.Array:
    """``x`` (float32, within the format's range: callers clip first) rounded to the nearest
    ``dtype`` value, ties to even, in float32: the values of ``x.astype(dtype).astype(float32)``,
    bit for bit, in ops XLA keeps.

    Why not the casts: XLA's excess-precision simplification deletes ``f32 -> f8 -> f32`` (and
    ``f32 -> bf16 -> f32``) cast pairs in jitted code on GPU (openxla/xla#41605), so an
    emulated float8 matmul would silently run unrounded. ``lax.reduce_precision`` is an op XLA
    never drops; it models IEEE formats and flushes their subnormals, so: normal values
    through it (e4m3fn, which has no inf and reaches 448, at half the value, where the IEEE
    4-bit exponent still holds it: scaling by 2 is exact); subnormals as ``round(x / s) * s``
    with the spacing ``s`` (exact, ties to even); NaN stays NaN, -0.0 stays -0.0.
    """
    e, m, normal, spacing, finite_only = _ROUNDING[dtype]
    a = jnp.abs(x)
    # one reduce-precision per rounding (a trace shows it as the float8 quantize): e4m3fn's
    # values from 2 * normal on are rounded at half their value (the top exponent is finite)
    factor = jnp.where(a >= 2.0 * normal, 2.0, 1.0) if finite_only else 1.0
    rounded = jax.lax.reduce_precision(x / factor, exponent_bits=e, mantissa_bits=m) * factor
    sub = jnp.round(x * (1.0 / spacing)) * spacing
    return jnp.where(a >= normal, rounded, sub)


def fp8_initial_state(config: _fp8.FP8Config, device: Any = None) -> FP8State:
    """Scale 1, zero history: an :class:`unimp.fp8.FP8State` of float32 arrays."""
    return fp8_state_from_numpy(FP8State.initial(config), device)


def fp8_state_from_numpy(state: FP8State, device: Any = None) -> FP8State:
    """The same state as ``jnp`` float32 arrays (placed on ``device`` when given)."""
    vals = [jnp.asarray(np.asarray(v, np.float32)) for v in (state.scale, state.scale_inv, state.amax_history)]
    if device is not None:
        vals = [jax.device_put(v, device) for v in vals]
    return FP8State(*vals)


def fp8_state_to_numpy(state: FP8State) -> FP8State:
    """The state as NumPy float32 (for :func:`unimp.fp8.state_dict`); one host copy."""
    return FP8State(*(np.asarray(v, np.float32) for v in (state.scale, state.scale_inv, state.amax_history)))


def fp8_amax(x: jax.Array, config: _fp8.FP8Config | None = None) -> jax.Array:
    """``max(abs(x))`` as a float32 0-d array (NaN-propagating; NaN elements ignored under the ``transformer_engine`` rule of ``config``, as :func:`unimp.fp8.amax_of`)."""
    return _fp8.amax_of(FP8Ops, x, config)


def fp8_step(
    config: _fp8.FP8Config, state: FP8State, amax: jax.Array, role: str = "forward"
) -> tuple[tuple[jax.Array, jax.Array], FP8State]:
    """One step of :func:`unimp.fp8.step_arrays` on ``jnp`` arrays (jit-able; ``config`` and
    ``role`` static).

    Returns:
        ``((scale, scale_inv) to quantize this step with, state after the step)``.
    """
    used, new = _fp8.step_arrays(
        FP8Ops, config, role, state.scale, state.scale_inv, state.amax_history, FP8Ops.f32(amax)
    )
    return used, FP8State(*new)


def fp8_quantize_dequantize(x: jax.Array, scale: jax.Array, scale_inv: jax.Array, dtype: str) -> jax.Array:
    """:func:`unimp.fp8.qdq_arrays` on an array: same shape and dtype as ``x``."""
    return _fp8.qdq_arrays(FP8Ops, x, scale, scale_inv, dtype, _fp8.FP8_MAX[dtype])


def native_fp8_supported(device: Any = None) -> bool:
    """Whether ``device`` (default: JAX's default device) has float8 units: a CUDA GPU of
    compute capability 8.9 or later, where XLA's ``gemm_rewriter`` turns a ``dot_general`` of
    float8 operands into a cuBLASLt float8 GEMM ("FP8 Custom Calls require Ada, Hopper, or
    later architectures"). Elsewhere XLA converts the operands to float32 (XLA:CPU, observed
    in the optimized HLO, jax 0.10.2): the native path runs, emulated."""
    device = device if device is not None else jax.devices()[0]
    if device.platform != "gpu":
        return False
    return bool(device_support("gpu", _capability(device))["float8"])  # one rule: unimp.dtypes


#: layers already warned that they run emulated though native was asked (once per layer)
_FALLBACK_WARNED: set[str] = set()


def _native_refusal(dn: Any, lhs: Any, rhs: Any) -> str | None:
    """Why this ``dot_general`` cannot run native: not a Dense product (lhs ``(..., K)`` by a
    kernel ``(K, N)``, one contracting dimension, no batch), or the core's shape rule."""
    (lc, rc), (lb, rb) = dn
    if lb or rb or tuple(rc) != (0,) or jnp.ndim(rhs) != 2 or tuple(lc) != (jnp.ndim(lhs) - 1,):
        return (f"its dimension numbers {dn} are not a Dense product (lhs (..., K) by a kernel "
                "(K, N)), the one the float8 GEMM (XLA's cuBLASLt rewrite) takes here")
    return _fp8.native_refusal(rhs.shape[0], rhs.shape[1], "XLA's cuBLASLt float8 GEMM")


def fp8_dot_general(
    config: _fp8.FP8Config, input_state: FP8State, kernel_state: FP8State, grad_state: FP8State,
    native: bool | None = None, name: str | None = None,
) -> Any:
    """A float8 ``dot_general`` for plain JAX and for flax modules (``dot_general=``).

    ``lhs`` (the input) and ``rhs`` (the kernel) are quantized to the forward format with their
    own states, the output gradient to the backward format in the backward pass; the
    ``dot_general`` multiplies the float8 values and scales the float32 result once
    (:func:`unimp.fp8.quantize_arrays`). JAX is functional, so the states after the step come
    out as the *gradients* of the three state arguments (flax's fp8_ops does the same with its
    ``_overwrite_with_gradient`` collection): differentiate with respect to the states too and
    replace them with their "gradients". A forward-only call leaves the states alone.

    Emulated by default: the three GEMMs multiply the float8 values held in float32. With
    ``native`` they take the float8 arrays themselves (``jax.lax.dot_general(...,
    preferred_element_type=float32)``, e4m3 x e4m3 forward, e5m2 x e4m3 for the gradient under
    ``HYBRID``), as flax's ``Fp8DirectDotGeneralOp`` passes them, and the float32 result is
    scaled as the emulated rule scales it: XLA's GPU ``gemm_rewriter`` turns each into a
    cuBLASLt float8 GEMM on sm89+ (:func:`native_fp8_supported`), XLA:CPU converts the
    operands to float32 and runs the same GEMMs as the emulated path (bit for bit, tested). The
    input is flattened to ``(M, K)`` for the GEMMs (the rewriter takes one non-contracting
    dimension per operand). A ``dot_general`` that is not a Dense product, or a kernel whose
    ``K`` or ``N`` is not a multiple of 16 (:data:`unimp.fp8.NATIVE_MULTIPLE`), runs emulated
    with one :class:`unimp.fp8.FP8NativeFallbackWarning` naming the layer. Without float8 units
    (anything but a CUDA sm89+ default device) the first call warns once per backend
    (:class:`unimp.fp8.FP8EmulationWarning`), native or not.

    Example::

        def loss(params, states, x):
            dg = fp8_dot_general(config, *states)
            return nn.Dense(8, dot_general=dg).apply(params, x).sum()
        grads, new_states = jax.grad(loss, argnums=(0, 1))(params, states, x)

    Note: ``flax.linen.Dense`` casts the kernel to its ``dtype`` before calling
    ``dot_general``; with ``dtype=bfloat16`` the kernel is then quantized from bfloat16, where
    unimp's torch and Keras layers quantize the float32 master weight.

    Args:
        config: a :class:`unimp.fp8.DelayedScaling` or :class:`unimp.fp8.CurrentScaling`.
        input_state: :class:`unimp.fp8.FP8State` of float32 arrays (or its ``to_dict()``:
            taken as one).
        kernel_state: the same, for the kernel.
        grad_state: the same, for the gradient.
        native: the float8 GEMM path; ``None`` (default) reads ``UNIMP_FP8_NATIVE`` now
            (``"1"``: on).
        name: the layer's name in warnings (default: the shapes of the product).

    Returns:
        ``dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None)``:
        the product in ``preferred_element_type`` when given (as ``lax.dot_general`` returns
        it), else in ``lhs``'s dtype; either way accumulated in float32 and scaled once, the
        rule (``precision`` is not read: the GEMMs multiply float8 values, exact in float32).
        Operands that are not floating point raise a TypeError (:func:`unimp.fp8.refuse_non_float`:
        ``lax.dot_general`` would multiply integers exactly; flax's Dense casts them first).

    Raises:
        TypeError: ``native`` is not True, False or None; ``config`` not a DelayedScaling /
            CurrentScaling (a preset name: use :func:`unimp.fp8.fp8_preset`); a state neither
            an FP8State nor its dict.
        ValueError: a state dict with other keys.
    """
    native = _fp8.native_requested(native, "fp8_dot_general")
    config = _fp8.layer_config(config, "fp8_dot_general")
    # a state's to_dict() is taken as in load_fp8_state (keys only: the values may be tracers)
    input_state, kernel_state, grad_state = (
        FP8State.coerce(st, f"fp8_dot_general {name}_state")
        for st, name in zip((input_state, kernel_state, grad_state), _fp8.LAYER_TENSORS, strict=True)
    )
    if not (native and native_fp8_supported()):
        _fp8.warn_emulated("jax", jax.default_backend())

    def dot_general(lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
                    preferred_element_type: Any = None) -> jax.Array:
        for operand in (lhs, rhs):
            if not jnp.issubdtype(jnp.result_type(operand), jnp.floating):
                # lax.dot_general would compute an exact integer product, which float8 cannot
                _fp8.refuse_non_float(jnp.result_type(operand), "fp8_dot_general",
                                      "cast it to a float dtype first, as flax's Dense does (promote_dtype)")
        out = None
        if preferred_element_type is not None:
            out = jnp.dtype(preferred_element_type)
            if not jnp.issubdtype(out, jnp.floating):
                raise TypeError(f"fp8_dot_general: preferred_element_type must be a float dtype (the "
                                f"output of a float8 matmul), got {out}.")
        dn = _hashable(dimension_numbers)
        use = native
        if use:
            why = _native_refusal(dn, lhs, rhs)
            if why is not None:
                use = False
                layer = name if name is not None else f"dot_general({jnp.shape(lhs)}, {jnp.shape(rhs)})"
                if layer not in _FALLBACK_WARNED:
                    _FALLBACK_WARNED.add(layer)
                    _fp8.warn_native_fallback("jax", layer, why)
        return _fp8_dot(config, dn, use, out, lhs, rhs, input_state, kernel_state, grad_state)

    return dot_general


def _hashable(dn: Any) -> Any:
    (lc, rc), (lb, rb) = dn
    return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


def _dot8(a: jax.Array, a_fmt: str, b: jax.Array, b_fmt: str, dn: Any) -> jax.Array:
    """``dot_general`` of ``a`` and ``b`` (float32 holding values of the float8 formats: the
    casts are exact) taken as float8 arrays, accumulated and returned in float32."""
    return jax.lax.dot_general(a.astype(_FP8_DTYPES[a_fmt]), b.astype(_FP8_DTYPES[b_fmt]), dn,
                               preferred_element_type=jnp.float32)


def _fwd(config, dn, native, out, lhs, rhs, si, sk, sg):
    dtype = config.dtype("forward")
    fmax = _fp8.FP8_MAX[dtype]
    (sx, ix), new_i = fp8_step(config, si, fp8_amax(lhs, config), "forward")
    (sw, iw), new_k = fp8_step(config, sk, fp8_amax(rhs, config), "forward")
    qx = _fp8.quantize_arrays(FP8Ops, lhs, sx, dtype, fmax)
    qw = _fp8.quantize_arrays(FP8Ops, rhs, sw, dtype, fmax)
    if native:  # (M, K) @ (K, N): the one product shape the rewriter takes
        flat = qx.reshape(-1, qx.shape[-1])
        acc = _dot8(flat, dtype, qw, dtype, (((1,), (0,)), ((), ()))).reshape(*qx.shape[:-1], qw.shape[1])
    else:
        acc = jax.lax.dot_general(qx, qw, dn)
    y = (acc * (ix * iw)).astype(lhs.dtype if out is None else out)
    marks = (jnp.zeros((), lhs.dtype), jnp.zeros((), rhs.dtype))
    return y, (qx, qw, ix, iw, new_i, new_k, sg, marks)


def _bwd(config, dn, native, out, res, g):
    qx, qw, ix, iw, new_i, new_k, sg, (lmark, rmark) = res
    dtype = config.dtype("backward")
    (sgs, ig), new_g = fp8_step(config, sg, fp8_amax(g, config), "backward")
    qg = _fp8.quantize_arrays(FP8Ops, g, sgs, dtype, _fp8.FP8_MAX[dtype])
    if native:  # the gradient first, as JAX's own transpose of dot_general puts it
        fwd = config.dtype("forward")
        g2, x2 = qg.reshape(-1, qg.shape[-1]), qx.reshape(-1, qx.shape[-1])
        dqx = _dot8(g2, dtype, qw, fwd, (((1,), (1,)), ((), ()))).reshape(qx.shape)
        dqw = _dot8(g2, dtype, x2, fwd, (((0,), (0,)), ((), ()))).T
    else:
        _, vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dn), qx, qw)
        dqx, dqw = vjp(qg)
    dx = (dqx * (ig * iw)).astype(lmark.dtype)
    dw = (dqw * (ig * ix)).astype(rmark.dtype)
    return dx, dw, new_i, new_k, new_g


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fp8_dot(config, dn, native, out, lhs, rhs, si, sk, sg):
    return _fwd(config, dn, native, out, lhs, rhs, si, sk, sg)[0]


_fp8_dot.defvjp(_fwd, _bwd)


#: flax's collection for values replaced by their "gradient" (``flax.linen.fp8_ops``'s
#: ``OVERWRITE_WITH_GRADIENT``): ``flax.training.train_state.TrainState.apply_gradients``
#: overwrites it instead of applying the optimizer.
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


@functools.cache
def _flax_dot_general_module() -> type:
    import flax.linen as nn

    class Fp8DotGeneral(nn.Module):
        """A flax ``dot_general_cls``: :func:`fp8_dot_general` with its three scaling states
        (``<input|kernel|grad>_<scale|scale_inv|amax_history>``) as variables of flax's
        ``_overwrite_with_gradient`` collection."""

        config: Any = None
        native: bool | None = None
        layer: str | None = None

        @nn.compact
        def __call__(self, lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
                     preferred_element_type: Any = None) -> jax.Array:
            init = FP8State.initial(self.config)
            states = [
                FP8State(*(self.variable(OVERWRITE_WITH_GRADIENT, f"{name}_{f}",
                                         functools.partial(jnp.asarray, getattr(init, f), jnp.float32)).value
                           for f in STATE_FIELDS))
                for name in LAYER_TENSORS
            ]
            name = self.layer if self.layer is not None else "/".join(map(str, self.path[:-1])) or None
            return fp8_dot_general(self.config, *states, native=self.native, name=name)(
                lhs, rhs, dimension_numbers, precision, preferred_element_type)

    return Fp8DotGeneral


def fp8_flax_dot_general_cls(config: _fp8.FP8Config, native: bool | None = None,
                             name: str | None = None) -> Any:
    """A flax ``dot_general_cls`` (``nn.Dense(..., dot_general_cls=...)``) running
    :func:`fp8_dot_general` with its states in flax's ``_overwrite_with_gradient`` collection,
    as flax's own ``Fp8DotGeneralOp`` keeps them: differentiate the loss with respect to the
    whole variables dict and overwrite that collection with its "gradient" (flax's
    ``TrainState.apply_gradients`` does). ``native`` and ``name`` (default: the Dense's flax
    path) as in :func:`fp8_dot_general`. Needs flax."""
    return functools.partial(_flax_dot_general_module(), config=config, native=native, layer=name)


def fp8_initial_states(config: _fp8.FP8Config, paths: Any) -> dict[str, tuple[FP8State, FP8State, FP8State]]:
    """Plain JAX: ``{path: (input, kernel, grad) states}`` (scale 1, zero history), a pytree
    to pass to the loss and to differentiate (its "gradient" is the state after the step)."""
    return {p: tuple(fp8_initial_state(config) for _ in range(3)) for p in paths}


def _is_state(x: Any) -> bool:
    return isinstance(x, FP8State)


def fp8_update(states: Any, new_states: Any) -> Any:
    """The float8 states after a step: ``new_states`` (the "gradients" of ``states``, as
    :func:`fp8_dot_general` returns them), except for a layer that did not run in the
    differentiated function (skipped by ``lax.cond``, or run only under ``stop_gradient``):
    its "gradient" is 0, which no state is (a scale is never 0), so its states are kept
    bitwise as they were. Every :class:`unimp.fp8.FP8State` node of ``states`` is taken; the
    rest of ``new_states`` is returned as it is. The train step applies it to its
    ``model_state``; a loop of one's own should too (``states = mp.fp8_update(states, g)``)."""

    if not fp8_window_states(states):  # nothing to keep (and the structure is the user's)
        return new_states

    def keep(old: Any, new: Any) -> Any:
        if not _is_state(old):
            return new
        ran = jnp.asarray(new.scale) != 0
        return FP8State(*(jnp.where(ran, getattr(new, f), getattr(old, f)) for f in STATE_FIELDS))

    return jax.tree_util.tree_map(keep, states, new_states, is_leaf=_is_state)


def fp8_window_carry(start: Any, new: Any) -> Any:
    """Gradient accumulation: the model state the next micro-batch of a window starts from,
    ``new`` with its float8 states put back to the window's ``start`` (every micro-batch
    quantizes with the states the window started from: :func:`unimp.fp8.window_merge`)."""
    if not fp8_window_states(start):
        return new
    return jax.tree_util.tree_map(lambda s, n: s if _is_state(s) else n, start, new, is_leaf=_is_state)


def fp8_window_states(new: Any) -> list[FP8State]:
    """The float8 states of one micro-batch's new model state, in tree order."""
    return [x for x in jax.tree_util.tree_leaves(new, is_leaf=_is_state) if _is_state(x)]


def fp8_window_result(start: Any, carried: Any, stacked: list[FP8State]) -> Any:
    """The model state after a window: ``carried`` (the last micro-batch's, float8 states put
    back), with each float8 state the one of the micro-batch with the largest recorded amax
    (``stacked``: per state, the window's micro-batches along axis 0; the amax read from the
    states, :func:`unimp.fp8.recorded_amax`), then :func:`fp8_update` against ``start``."""
    if not stacked:
        return carried
    merged = []
    for cand in stacked:
        best = None
        for i in range(int(jnp.shape(cand.scale)[0])):
            new = FP8State(*(getattr(cand, f)[i] for f in STATE_FIELDS))
            best = _fp8.window_merge(FP8Ops, best, new, _fp8.recorded_amax(FP8Ops, new))
        merged.append(best[0])
    leaves, treedef = jax.tree_util.tree_flatten(carried, is_leaf=_is_state)
    it = iter(merged)
    leaves = [next(it) if _is_state(x) else x for x in leaves]
    return fp8_update(start, jax.tree_util.tree_unflatten(treedef, leaves))


def fp8_matmul(config: _fp8.FP8Config, states: Any, path: str, x: jax.Array, w: jax.Array,
               native: bool | None = None) -> jax.Array:
    """Plain JAX: ``x @ w`` (``w`` of shape ``(in, out)``) as :func:`fp8_dot_general` with
    ``states[path]`` (named ``path`` in warnings; ``native`` as there) when ``path`` is in
    ``states``, else the plain matmul."""
    if path not in states:
        return x @ w
    dn = (((x.ndim - 1,), (0,)), ((), ()))
    return fp8_dot_general(config, *states[path], native=native, name=path)(x, w, dn)
