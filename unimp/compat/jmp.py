"""jmp's public API on unimp's JAX backend: change ``import jmp`` to
``import unimp.compat.jmp as jmp`` and a jmp script runs unchanged.

Names: :class:`Policy`, :func:`get_policy`, :func:`cast_to_full`, :func:`cast_to_half`,
:func:`half_dtype`, :class:`NoOpLossScale`, :class:`StaticLossScale`,
:class:`DynamicLossScale` (``loss_scale, counter, period, factor, min_loss_scale``, jmp's
positional order, with jmp's pytree children ``(loss_scale, counter)``), :func:`all_finite`,
:func:`select_tree`, and the ``LossScale`` union.

Where jmp 0.0.4 is unsafe, the shim follows unimp's rule instead (each is tested against jmp):

* The loss scale is held in float32 whatever dtype it is given in: jmp keeps a float16 scale,
  which overflows at 65536 (scaling a loss by ``inf``) and rounds every other growth.
* ``min_loss_scale`` survives ``jit``, ``tree_map`` and every other flatten / unflatten: jmp's
  flatten leaves it out and unflatten restores the default 1.0, so a floor of 2**-4 becomes 1
  inside a jitted step.
* ``adjust`` is unimp's reference rule (:func:`unimp.loss_scale.update_arrays`, the
  ``DynamicLossScale.preset("jmp")`` timing: growth on the ``period``-th finite step in a row,
  back-off by ``factor`` floored at ``min_loss_scale``); a growth past float32's range keeps the
  old scale, as jmp. The back-off multiplies by ``1 / factor`` where jmp divides by ``factor``:
  the same for a power-of-two factor (jmp's default 2); otherwise each back-off may differ by
  an ulp, and repeated back-offs by a few. Invalid arguments (a non-bool flag, ``factor <= 1``, ``period < 1``) are a
  ``ValueError`` rather than an ``assert`` that ``python -O`` removes.
* ``StaticLossScale`` holds a Python number as given (weakly typed: a float16 loss scaled by
  it stays float16, as in jmp) and an array as a NumPy float32 scalar (hashable, so it can be
  a static argument of ``jit``; results are float32, as with jmp's float32 array).

The counter and scale follow the same sequence as jmp's otherwise (tested step for step).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

from unimp import loss_scale as core
from unimp.backends.jax.casting import cast_tree
from unimp.backends.jax.overflow import all_finite as _all_finite
from unimp.backends.jax.overflow import check_pred
from unimp.backends.jax.overflow import select_tree as _select_tree
from unimp.backends.jax.scaling import (
    STATIC_FIELDS,
    LossScaleOps,
    pytree_from_fields,
    replace_unchecked,
)
from unimp.dtypes import canonical_dtype
from unimp.policy import get_policy as _get_policy

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "cast_to_full",
    "cast_to_half",
    "get_policy",
    "half_dtype",
    "select_tree",
]

T = TypeVar("T")

_SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "full", "float64": "f64"}


def _jnp_dtype(value: Any) -> Any:
    """A dtype as jmp holds it (``jnp.float16``, ...), from any spelling unimp reads."""
    return {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32,
            "float64": jnp.float64}[canonical_dtype(value)]


@dataclasses.dataclass(frozen=True)
class Policy:
    """jmp's ``Policy``: the dtypes of params, computation and outputs (``jnp`` dtypes).

    Casting touches floating array leaves only, as jmp (and :func:`unimp.backends.jax.cast_tree`).

    Raises:
        ValueError: a dtype unimp does not support (the message lists the names).
    """

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any

    def __post_init__(self) -> None:
        for f in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, f, _jnp_dtype(getattr(self, f)))

    def cast_to_param(self, x: T) -> T:
        """Floating leaves of ``x`` in the param dtype."""
        return cast_tree(x, self.param_dtype)

    def cast_to_compute(self, x: T) -> T:
        """Floating leaves of ``x`` in the compute dtype."""
        return cast_tree(x, self.compute_dtype)

    def cast_to_output(self, x: T) -> T:
        """Floating leaves of ``x`` in the output dtype."""
        return cast_tree(x, self.output_dtype)

    def with_output_dtype(self, output_dtype: Any) -> Policy:
        """A copy with another output dtype."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        names = [_SHORT[canonical_dtype(d)] for d in (self.param_dtype, self.compute_dtype, self.output_dtype)]
        return "p={},c={},o={}".format(*names)


def get_policy(policy_name: str) -> Policy:
    """jmp's ``get_policy``: ``"params=float32,compute=float16,output=float32"``, ``"c=f16"``
    (params float32, output follows compute), ``"half"``, a dtype name ... by jmp's defaulting
    rules (read by :func:`unimp.get_policy`).

    Raises:
        ValueError: an unknown key or dtype (names the accepted ones).
    """
    p = _get_policy(policy_name)
    return Policy(p.param_dtype, p.compute_dtype, p.output_dtype)


def half_dtype() -> Any:
    """``jnp.bfloat16`` on a TPU, ``jnp.float16`` elsewhere (as jmp)."""
    return jnp.bfloat16 if jax.local_devices()[0].platform == "tpu" else jnp.float16


def cast_to_full(tree: T) -> T:
    """Floating leaves of ``tree`` in float32."""
    return cast_tree(tree, jnp.float32)


def cast_to_half(tree: T) -> T:
    """Floating leaves of ``tree`` in :func:`half_dtype`."""
    return cast_tree(tree, half_dtype())


def all_finite(tree: Any) -> jax.Array:
    """A bool scalar: every floating element of ``tree`` is finite (no host sync)."""
    return _all_finite(tree)


def select_tree(pred: Any, a: T, b: T) -> T:
    """``a`` where ``pred`` (a bool scalar) else ``b``, leaf by leaf.

    Raises:
        ValueError: ``pred`` is not a bool scalar; the trees differ in structure.
    """
    return _select_tree(pred, a, b)


def _scale_tree(tree: Any, factor: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x * factor, tree)


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """No loss scaling (jmp's): ``scale`` and ``unscale`` return their input."""

    @property
    def loss_scale(self) -> int:
        return 1

    def scale(self, tree: T) -> T:
        return tree

    def unscale(self, tree: T) -> T:
        return tree

    def adjust(self, grads_finite: Any) -> NoOpLossScale:
        return self


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """A fixed loss scale (jmp's): a Python number as given, an array as a NumPy float32."""

    loss_scale: Any

    def __post_init__(self) -> None:
        raw = self.loss_scale
        core.StaticLossScale(float(np.float32(np.asarray(raw, np.float64))))  # finite and > 0
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            # a Python number stays weakly typed, as in jmp: a float16 loss stays float16
            object.__setattr__(self, "loss_scale", float(raw))
        else:
            object.__setattr__(self, "loss_scale", np.float32(np.asarray(raw, np.float64)))

    def scale(self, tree: T) -> T:
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        inv = 1.0 / self.loss_scale if isinstance(self.loss_scale, float) else np.float32(1.0) / self.loss_scale
        return _scale_tree(tree, inv)

    def adjust(self, grads_finite: Any) -> StaticLossScale:
        return self


def _empty_pytree(cls: type) -> None:
    jax.tree_util.register_pytree_node(cls, lambda x: ((), x), lambda x, _: x)


_empty_pytree(NoOpLossScale)
_empty_pytree(StaticLossScale)


@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale:
    """jmp's ``DynamicLossScale(loss_scale, counter=0, period=2000, factor=2,
    min_loss_scale=1.0)`` on unimp's rule (see the module docstring for the differences).

    Args:
        loss_scale: the initial scale (any float dtype; held as a float32 scalar).
        counter: finite steps in a row since the last change (int32 scalar).
        period: grow after this many finite steps in a row (int >= 1).
        factor: growth and back-off factor (> 1).
        min_loss_scale: the floor of the back-off (float32 scalar, kept through ``jit``).

    Raises:
        ValueError: a bad period, factor or floor (named), or a non-scalar state.
    """

    loss_scale: Any
    counter: Any = 0
    period: int = dataclasses.field(default=2000, metadata=STATIC_FIELDS)
    factor: Any = dataclasses.field(default=2, metadata=STATIC_FIELDS)
    min_loss_scale: Any = dataclasses.field(default=1.0, metadata=STATIC_FIELDS)

    def __post_init__(self) -> None:
        self.config  # validates period, factor and floor before anything is used  # noqa: B018
        # static (aux) data must hash: the floor is kept as a float32-rounded Python float
        object.__setattr__(
            self, "min_loss_scale", float(np.float32(np.asarray(self.min_loss_scale, np.float64)))
        )
        for name, dtype in (("loss_scale", jnp.float32), ("counter", jnp.int32)):
            v = jnp.asarray(getattr(self, name), dtype)
            if jnp.shape(v) != ():
                raise ValueError(f"DynamicLossScale.{name} must be a scalar, got shape {jnp.shape(v)}.")
            object.__setattr__(self, name, v)

    @property
    def config(self) -> core.DynamicLossScale:
        """The unimp rule this loss scale follows (``DynamicLossScale.preset("jmp", ...)``)."""
        floor = float(np.float32(np.asarray(self.min_loss_scale, np.float64)))
        return core.DynamicLossScale.preset(
            "jmp",
            init_scale=floor,  # not used: the state is this object's
            growth_interval=int(self.period),
            growth_factor=float(self.factor),
            backoff_factor=1.0 / float(self.factor),
            min_scale=floor,
        )

    def scale(self, tree: T) -> T:
        """Floating leaves of ``tree`` times the float32 scale (a float16 loss becomes float32)."""
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """``tree`` times ``1 / loss_scale`` (the reciprocal in float32)."""
        return _scale_tree(tree, jnp.float32(1.0) / self.loss_scale)

    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """The next state: grow on the ``period``-th finite step in a row, back off (floored)
        on a non-finite one.

        Raises:
            ValueError: ``grads_finite`` is not a bool scalar.
        """
        g = check_pred(grads_finite, "DynamicLossScale.adjust(grads_finite)")
        zero = jnp.int32(0)
        scale, counter, _, _ = core.update_arrays(
            LossScaleOps, self.config, self.loss_scale, self.counter, zero, zero, g, jnp.array(True)
        )
        return replace_unchecked(self, loss_scale=scale, counter=counter)


# jmp's children (loss_scale, counter); the floor travels with period and factor as static
# data, read from the dataclass fields (jmp's hand-written flatten dropped it)
pytree_from_fields(DynamicLossScale)

LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]  # noqa: UP007 (jmp's name)
