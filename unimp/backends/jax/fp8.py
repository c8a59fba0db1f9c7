"""JAX FP8: :mod:`unimp.fp8`'s scaling and quantize-dequantize rules on ``jnp`` arrays (they
trace under ``jax.jit``), and :func:`fp8_dot_general`, an emulated float8 ``dot_general``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from unimp import fp8 as _fp8
from unimp.fp8 import LAYER_TENSORS, STATE_FIELDS, FP8State

# FP8State is a pytree (every field an array leaf), derived from dataclasses.fields, so it
# passes through jax.jit, lax.scan and optax states.
jax.tree_util.register_dataclass(
    FP8State, data_fields=list(STATE_FIELDS), meta_fields=[]
)

_FP8_DTYPES = {"float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2}


class Fp8Ops:
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
    def amax(x: jax.Array) -> jax.Array:
        return jnp.max(x)  # NaN-propagating

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
        return jnp.asarray(x).astype(jnp.float32)

    @staticmethod
    def cast_like(x: jax.Array, like: jax.Array) -> jax.Array:
        return x.astype(jnp.asarray(like).dtype)


def fp8_initial_state(config: _fp8.Fp8Config, device: Any = None) -> FP8State:
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


def fp8_amax(x: jax.Array) -> jax.Array:
    """``max(abs(x))`` as a float32 0-d array (NaN-propagating)."""
    return _fp8.amax_of(Fp8Ops, x)


def fp8_step(
    config: _fp8.Fp8Config, state: FP8State, amax: jax.Array, role: str = "forward"
) -> tuple[tuple[jax.Array, jax.Array], FP8State]:
    """One step of :func:`unimp.fp8.step_arrays` on ``jnp`` arrays (jit-able; ``config`` and
    ``role`` static).

    Returns:
        ``((scale, scale_inv) to quantize this step with, state after the step)``.
    """
    used, new = _fp8.step_arrays(
        Fp8Ops, config, role, state.scale, state.scale_inv, state.amax_history, Fp8Ops.f32(amax)
    )
    return used, FP8State(*new)


def fp8_quantize_dequantize(x: jax.Array, scale: jax.Array, scale_inv: jax.Array, dtype: str) -> jax.Array:
    """:func:`unimp.fp8.qdq_arrays` on an array: same shape and dtype as ``x``."""
    return _fp8.qdq_arrays(Fp8Ops, x, scale, scale_inv, dtype, _fp8.FP8_MAX[dtype])


def fp8_dot_general(
    config: _fp8.Fp8Config, input_state: FP8State, kernel_state: FP8State, grad_state: FP8State
) -> Any:
    """An emulated float8 ``dot_general`` for plain JAX and for flax modules (``dot_general=``).

    ``lhs`` (the input) and ``rhs`` (the kernel) are quantized to the forward format with their
    own states, the output gradient to the backward format in the backward pass; the
    ``dot_general`` multiplies the float8 values and scales the float32 result once
    (:func:`unimp.fp8.quantize_arrays`). JAX is functional, so the states after the step come
    out as the *gradients* of the three state arguments (flax's fp8_ops does the same with its
    ``_overwrite_with_gradient`` collection): differentiate with respect to the states too and
    replace them with their "gradients". A forward-only call leaves the states alone.

    Example::

        def loss(params, states, x):
            dg = fp8_dot_general(config, *states)
            return nn.Dense(8, dot_general=dg).apply(params, x).sum()
        grads, new_states = jax.grad(loss, argnums=(0, 1))(params, states, x)

    Note: ``flax.linen.Dense`` casts the kernel to its ``dtype`` before calling
    ``dot_general``; with ``dtype=bfloat16`` the kernel is then quantized from bfloat16, where
    unimp's torch and Keras layers quantize the float32 master weight.

    Returns:
        ``dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None)``.
    """
    _fp8.warn_emulated("jax", jax.default_backend())

    def dot_general(lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
                    preferred_element_type: Any = None) -> jax.Array:
        return _fp8_dot(config, _hashable(dimension_numbers), lhs, rhs, input_state, kernel_state, grad_state)

    return dot_general


def _hashable(dn: Any) -> Any:
    (lc, rc), (lb, rb) = dn
    return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


def _fwd(config, dn, lhs, rhs, si, sk, sg):
    dtype = config.dtype("forward")
    fmax = _fp8.FP8_MAX[dtype]
    (sx, ix), new_i = fp8_step(config, si, fp8_amax(lhs), "forward")
    (sw, iw), new_k = fp8_step(config, sk, fp8_amax(rhs), "forward")
    qx = _fp8.quantize_arrays(Fp8Ops, lhs, sx, dtype, fmax)
    qw = _fp8.quantize_arrays(Fp8Ops, rhs, sw, dtype, fmax)
    y = (jax.lax.dot_general(qx, qw, dn) * (ix * iw)).astype(lhs.dtype)
    marks = (jnp.zeros((), lhs.dtype), jnp.zeros((), rhs.dtype))
    return y, (qx, qw, ix, iw, new_i, new_k, sg, marks)


def _bwd(config, dn, res, g):
    qx, qw, ix, iw, new_i, new_k, sg, (lmark, rmark) = res
    dtype = config.dtype("backward")
    (sgs, ig), new_g = fp8_step(config, sg, fp8_amax(g), "backward")
    qg = _fp8.quantize_arrays(Fp8Ops, g, sgs, dtype, _fp8.FP8_MAX[dtype])
    _, vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dn), qx, qw)
    dqx, dqw = vjp(qg)
    dx = (dqx * (ig * iw)).astype(lmark.dtype)
    dw = (dqw * (ig * ix)).astype(rmark.dtype)
    return dx, dw, new_i, new_k, new_g


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_dot(config, dn, lhs, rhs, si, sk, sg):
    return _fwd(config, dn, lhs, rhs, si, sk, sg)[0]


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
            return fp8_dot_general(self.config, *states)(lhs, rhs, dimension_numbers)

    return Fp8DotGeneral


def fp8_flax_dot_general_cls(config: _fp8.Fp8Config) -> Any:
    """A flax ``dot_general_cls`` (``nn.Dense(..., dot_general_cls=...)``) running
    :func:`fp8_dot_general` with its states in flax's ``_overwrite_with_gradient`` collection,
    as flax's own ``Fp8DotGeneralOp`` keeps them: differentiate the loss with respect to the
    whole variables dict and overwrite that collection with its "gradient" (flax's
    ``TrainState.apply_gradients`` does). Needs flax."""
    return functools.partial(_flax_dot_general_module(), config=config)


def fp8_initial_states(config: _fp8.Fp8Config, paths: Any) -> dict[str, tuple[FP8State, FP8State, FP8State]]:
    """Plain JAX: ``{path: (input, kernel, grad) states}`` (scale 1, zero history), a pytree
    to pass to the loss and to differentiate (its "gradient" is the state after the step)."""
    return {p: tuple(fp8_initial_state(config) for _ in range(3)) for p in paths}


def fp8_matmul(config: _fp8.Fp8Config, states: Any, path: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """Plain JAX: ``x @ w`` (``w`` of shape ``(in, out)``) as :func:`fp8_dot_general` with
    ``states[path]`` when ``path`` is in ``states``, else the plain matmul."""
    if path not in states:
        return x @ w
    dn = (((x.ndim - 1,), (0,)), ((), ()))
    return fp8_dot_general(config, *states[path])(x, w, dn)
