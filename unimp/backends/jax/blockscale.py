"""JAX block-scaled linear layers: :mod:`unimp.blockscale_linear`'s rule (MXFP8, block FP8,
NVFP4, MXFP4) on ``jnp`` arrays, as a custom-gradient matmul (:func:`block_scaled_matmul`, a
``jax.custom_vjp``; it traces under ``jax.jit``), :func:`block_scaled_dot_general`, a flax
``dot_general``, and :func:`block_flax_dot_general_cls`, a flax ``dot_general_cls`` keeping
the stochastic rounding's step counter. Emulated: the operands are quantized and dequantized to float32 and
multiplied in float32; the result is cast to the input's dtype (the compute dtype).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from unimp import blockscale_linear as _bl
from unimp.backends.jax.fp8 import OVERWRITE_WITH_GRADIENT, FP8Ops
from unimp.backends.jax.optimizer import UpdateOps
from unimp.fp8 import refuse_non_float


class BlockOps(FP8Ops):
    """:mod:`unimp.blockscale_linear`'s namespace over ``jnp`` arrays: the FP8 rule's
    ``FP8Ops`` plus ``matmul`` and ``transpose``."""

    @staticmethod
    def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
        # HIGHEST: float32 products of the dequantized values, never a bfloat16 pass (the
        # default precision may be lowered on an accelerator)
        return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)

    @staticmethod
    def transpose(a: jax.Array) -> jax.Array:
        return jnp.transpose(a)


def _fwd(rule, layout, seed, x, w, step):
    x2 = x.reshape(-1, x.shape[-1])
    y, saved = _bl.linear_forward(BlockOps, x2, w, rule, layout)
    y = y.reshape(*x.shape[:-1], y.shape[-1]).astype(x.dtype)
    marks = (jnp.zeros(x.shape, x.dtype)[..., :0], jnp.zeros((), w.dtype))  # shapes and dtypes only
    return y, (saved, step, marks)


def _bwd(rule, layout, seed, res, g):
    saved, step, (xmark, wmark) = res
    g2 = g.reshape(-1, g.shape[-1])
    bits = _bl.gradient_bits(UpdateOps, seed, step, *g2.shape) if rule.stochastic("gradient") else None
    dx, dw = _bl.linear_backward(BlockOps, saved, g2, rule, layout, bits)
    return dx.reshape(*xmark.shape[:-1], dx.shape[-1]).astype(xmark.dtype), dw.astype(wmark.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _matmul(rule, layout, seed, x, w, step):
    # undifferentiated (inference): the forward GEMM alone, no columnwise copies
    y, _ = _bl.linear_forward(BlockOps, x.reshape(-1, x.shape[-1]), w, rule, layout, backward=False)
    return y.reshape(*x.shape[:-1], y.shape[-1]).astype(x.dtype)


_matmul.defvjp(_fwd, _bwd)


def block_scaled_matmul(x: jax.Array, w: jax.Array, rule: Any, layout: str = "in_out",
                        seed: int = 0, step: Any = 0) -> jax.Array:
    """``x @ W`` as an emulated block-scaled GEMM with its gradients by the same rule
    (:data:`unimp.blockscale_linear.GEMMS`); the contract is the torch backend's
    ``block_scaled_matmul``. ``step`` may be a traced int32 counter (a jitted train step's);
    ``seed`` and the rule are static. Shapes are static under ``jit``. Not differentiated
    (inference), only the forward GEMM runs and the batch rows need not split into blocks.

    Raises:
        TypeError: a non-floating ``x`` or ``w`` (``jnp.matmul`` would multiply integers
            exactly, which a block-scaled GEMM cannot).
        ValueError: an unknown rule or layout, or sizes that do not split into the rule's blocks.
    """
    rule = _bl.block_linear_rule(rule)
    for name, a in (("x", x), ("w", w)):
        if not jnp.issubdtype(jnp.result_type(a), jnp.floating):
            refuse_non_float(jnp.result_type(a), f"block_scaled_matmul {name}", "cast it to a float dtype first")
    return _matmul(rule, layout, int(seed), jnp.asarray(x), jnp.asarray(w), jnp.asarray(step, jnp.int32))


def block_scaled_dot_general(rule: Any, seed: int = 0, step: Any = 0) -> Any:
    """A flax ``dot_general`` (``nn.Dense(..., dot_general=...)``) running
    :func:`block_scaled_matmul` on a Dense product (lhs ``(..., K)`` by a kernel ``(K, N)``).

    Raises:
        ValueError: (when called) dimension numbers of any other product.
    """
    rule = _bl.block_linear_rule(rule)

    def dot_general(lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
                    preferred_element_type: Any = None) -> jax.Array:
        (lc, rc), (lb, rb) = dimension_numbers
        if lb or rb or tuple(rc) != (0,) or jnp.ndim(rhs) != 2 or tuple(lc) != (jnp.ndim(lhs) - 1,):
            raise ValueError(f"block_scaled_dot_general: dimension numbers {dimension_numbers} are not a "
                             "Dense product (lhs (..., K) by a kernel (K, N)); use it as a Dense's dot_general.")
        y = block_scaled_matmul(lhs, rhs, rule, "in_out", seed, step)
        return y if preferred_element_type is None else y.astype(preferred_element_type)

    return dot_general


@jax.custom_vjp
def _counted(counter: jax.Array, y: jax.Array) -> jax.Array:
    """``y``; the "gradient" of ``counter`` is ``counter + 1`` (the next step's value)."""
    return y


_counted.defvjp(lambda counter, y: (y, counter), lambda counter, g: (counter + 1, g))


@functools.cache
def _flax_block_module() -> type:
    import flax.linen as nn

    class BlockDotGeneral(nn.Module):
        """A flax ``dot_general_cls``: :func:`block_scaled_dot_general` at the step held in
        ``step`` (float32, from 0), a variable of flax's ``_overwrite_with_gradient``
        collection whose "gradient" is ``step + 1``."""

        rule: Any = None
        seed: int = 0

        @nn.compact
        def __call__(self, lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
                     preferred_element_type: Any = None) -> jax.Array:
            counter = self.variable(OVERWRITE_WITH_GRADIENT, "step", jnp.zeros, (), jnp.float32).value
            step = jax.lax.stop_gradient(counter).astype(jnp.int32)
            y = block_scaled_dot_general(self.rule, self.seed, step)(
                lhs, rhs, dimension_numbers, precision, preferred_element_type)
            return _counted(counter, y)

    return BlockDotGeneral


def block_flax_dot_general_cls(rule: Any, seed: int = 0) -> Any:
    """A flax ``dot_general_cls`` (``nn.Dense(..., dot_general_cls=...)``) running
    :func:`block_scaled_dot_general` with its stochastic rounding's step counter kept in flax's
    ``_overwrite_with_gradient`` collection, as the float8 ``dot_general_cls`` keeps its
    scaling states (:func:`unimp.backends.jax.fp8.fp8_flax_dot_general_cls`): the Dense's
    ``BlockDotGeneral_0/step``, float32, 0 after ``init``. A call quantizes its gradient with
    the bits of ``(seed, step)`` and returns ``step + 1`` as the counter's "gradient":
    differentiate the loss with respect to the whole variables dict and overwrite that
    collection with its gradient (flax's ``TrainState.apply_gradients`` does), and each step
    draws fresh bits; the same seed and step give the same bits. Counted exactly up to 2**24
    steps (float32); a layer that did not run in the differentiated function gets 0, as the
    float8 states do. Needs flax.

    Raises:
        ValueError: an unknown rule.
    """
    return functools.partial(_flax_block_module(), rule=_bl.block_linear_rule(rule), seed=int(seed))


def block_matmul(recipe: Any, selected: Any, path: str, x: jax.Array, w: jax.Array, step: Any = 0) -> jax.Array:
    """Plain JAX: ``x @ w`` (``w`` of shape ``(in, out)``) as :func:`block_scaled_matmul` with
    ``recipe``'s rule and seed (an :class:`unimp.blockscale_recipe.BlockRecipe`) when ``path`` is
    in ``selected`` (its :meth:`~unimp.blockscale_recipe.BlockRecipe.select` of the model's
    ``(path, kind)`` pairs), else the plain matmul; ``step`` is the stochastic rounding's
    counter (a traced int32 is fine)."""
    if path not in selected:
        return x @ w
    return block_scaled_matmul(x, w, recipe.rule, "in_out", recipe.seed, step)
