"""flax's ``DynamicScale`` on unimp's rule: change
``from flax.training.dynamic_scale import DynamicScale`` to
``from unimp.compat.flax import DynamicScale`` and a flax training step runs unchanged.

Same constructor (``growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, fin_steps=0,
scale=65536.0, minimum_scale=<float32 tiny>``), pytree children ``(fin_steps, scale)``,
``replace(...)``, flax serialization (``{"fin_steps", "scale"}``, so a ``TrainState`` holding
it saves and restores with ``flax.serialization`` as flax's does), and ``value_and_grad(fun, argnums=0, has_aux=False, axis_name=None)``
returning a :class:`DynamicScaleResult` ``(dynamic_scale, finite, aux, grad)`` with the
unscaled value (and aux) and float32 gradients, as flax.

The rule is :func:`unimp.loss_scale.update_arrays` with ``DynamicLossScale.preset("flax")``:
flax checks ``fin_steps == growth_interval`` before counting the current step, so the scale
grows on the ``growth_interval + 1``-th finite step in a row (unimp's interval
``growth_interval + 1``), backs off by ``backoff_factor`` floored at ``minimum_scale``, and
growth is clamped at the largest float32. The scale and counter follow flax's step for step
(tested against flax). Differences, where flax is unsafe:

* a non-finite loss (a forward overflow, not fixable by loss scaling) gives ``finite=False``
  but leaves the scale alone (flax backs off on the inf/NaN gradients it brings); the loss
  is judged before it is scaled, so a finite loss whose scaled copy overflows backs off as
  flax does;
* ``minimum_scale=None`` floors at the smallest normal float32 (2**-126): flax then has no
  floor, and repeated overflows drive its scale to 0 (gradients ``g / 0``);
* the scale is held in float32 and the counter in int32 whatever they are given as (a float16
  scale overflows at 65536);
* ``fin_steps`` above ``growth_interval`` (a hand-made or restored state) grows on the next
  finite step: flax checks ``==`` and never grows again;
* bad arguments (``growth_factor <= 1``, ``backoff_factor`` outside (0, 1), ``growth_interval
  < 0``) are a ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from unimp import loss_scale as core
from unimp.backends.jax.overflow import all_finite
from unimp.backends.jax.scaling import (
    STATIC_FIELDS,
    LossScaleOps,
    pytree_from_fields,
    replace_unchecked,
)

__all__ = ["DynamicScale", "DynamicScaleResult"]

_F32_TINY = float(np.finfo(np.float32).tiny)


class DynamicScaleResult(NamedTuple):
    """What ``value_and_grad``'s function returns (flax's names)."""

    dynamic_scale: DynamicScale
    finite: jax.Array
    aux: Any
    grad: Any


@dataclasses.dataclass(frozen=True, eq=False)
class DynamicScale:
    """flax's dynamic loss scale, following unimp's rule (see the module docstring).

    Args:
        growth_factor: multiply the scale by this after ``growth_interval`` finite steps (> 1).
        backoff_factor: multiply it by this on a non-finite gradient (in (0, 1)).
        growth_interval: finite steps in a row before a growth (int >= 0; 0 grows on every
            finite step, as flax).
        fin_steps: finite steps in a row so far (int32 scalar).
        scale: the current scale (float32 scalar).
        minimum_scale: the floor of the back-off; ``None``: 2**-126.

    Raises:
        ValueError: a bad factor, interval or floor (named).
    """

    growth_factor: float = dataclasses.field(default=2.0, metadata=STATIC_FIELDS)
    backoff_factor: float = dataclasses.field(default=0.5, metadata=STATIC_FIELDS)
    growth_interval: int = dataclasses.field(default=2000, metadata=STATIC_FIELDS)
    fin_steps: Any = 0
    scale: Any = 65536.0
    minimum_scale: float | None = dataclasses.field(default=_F32_TINY, metadata=STATIC_FIELDS)

    def __post_init__(self) -> None:
        self.config  # validates the rule before anything is used  # noqa: B018
        object.__setattr__(self, "fin_steps", jnp.asarray(self.fin_steps, jnp.int32))
        object.__setattr__(self, "scale", jnp.asarray(self.scale, jnp.float32))

    @property
    def config(self) -> core.DynamicLossScale:
        """The unimp rule (``DynamicLossScale.preset("flax", ...)``) this scale follows."""
        floor = None if self.minimum_scale is None else float(self.minimum_scale)
        return core.DynamicLossScale.preset(
            "flax",
            init_scale=1.0 if floor is None else max(1.0, floor),  # not used: the state is ours
            growth_factor=float(self.growth_factor),
            backoff_factor=float(self.backoff_factor),
            growth_interval=int(self.growth_interval) + 1,
            min_scale=floor,
        )

    def replace(self, **changes: Any) -> DynamicScale:
        """A copy with fields replaced (flax's ``struct.PyTreeNode.replace``)."""
        return dataclasses.replace(self, **changes)

    def value_and_grad(
        self,
        fun: Callable[..., Any],
        argnums: int | Sequence[int] = 0,
        has_aux: bool = False,
        axis_name: str | None = None,
    ) -> Callable[..., DynamicScaleResult]:
        """Like ``jax.value_and_grad(fun)``, on the loss times the scale.

        The returned function takes ``fun``'s arguments and returns ``DynamicScaleResult(
        new_dynamic_scale, finite, aux, grad)``: ``aux`` is the unscaled value (``(value,
        aux)`` with ``has_aux``), ``grad`` the unscaled float32 gradients (``lax.pmean`` over
        ``axis_name`` when given), ``finite`` whether the gradients (and the value) are
        finite, reduced over ``axis_name`` too. Apply the update only where ``finite``, as with
        flax (``jax.tree.map(partial(jnp.where, finite), new, old)``).
        """

        @functools.wraps(fun)
        def scaled(*args: Any) -> Any:
            out = fun(*args)
            loss, aux = out if has_aux else (out, None)
            return self.scale * loss, (loss, aux)  # the loss as computed, before the scale

        grad_fn = jax.value_and_grad(scaled, argnums, has_aux=True)

        def wrapped(*args: Any) -> DynamicScaleResult:
            (out, (loss, fun_aux)), grad = grad_fn(*args)
            value = out / self.scale
            aux = (value, fun_aux) if has_aux else value
            grad = jax.tree_util.tree_map(lambda g: jnp.asarray(g, jnp.float32) / self.scale, grad)
            if axis_name is not None:
                grad = lax.pmean(grad, axis_name)
            grads_finite = all_finite(grad, axis_name)
            # a forward overflow is judged on the loss as ``fun`` computed it: a finite loss
            # whose scaled copy overflows is a gradient overflow, and the scale backs off
            loss_finite = all_finite(loss, axis_name)
            zero = jnp.int32(0)
            scale, counter, _, _ = core.update_arrays(
                LossScaleOps, self.config, self.scale, self.fin_steps, zero, zero,
                grads_finite, loss_finite,
            )
            new = replace_unchecked(self, fin_steps=counter, scale=scale)
            return DynamicScaleResult(new, grads_finite & loss_finite, aux, grad)

        return wrapped


# flax's children (fin_steps, scale), the rule's constants static: read from the fields
pytree_from_fields(DynamicScale)


def _to_state_dict(ds: DynamicScale) -> dict[str, Any]:
    from flax import serialization

    return {"fin_steps": serialization.to_state_dict(ds.fin_steps),
            "scale": serialization.to_state_dict(ds.scale)}


def _from_state_dict(target: DynamicScale, state: dict[str, Any]) -> DynamicScale:
    return replace_unchecked(
        target,
        fin_steps=jnp.asarray(state["fin_steps"], jnp.int32),
        scale=jnp.asarray(state["scale"], jnp.float32),
    )


try:  # checkpoints: flax.serialization (to_bytes / from_bytes, orbax's flax handlers) as flax's
    from flax import serialization as _serialization

    _serialization.register_serialization_state(DynamicScale, _to_state_dict, _from_state_dict)
except ImportError:  # pragma: no cover - flax is in the jax extra
    pass
