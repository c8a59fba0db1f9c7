"""JAX loss scaling: :class:`LossScale`, one immutable pytree for every loss-scale config (a
:class:`unimp.LossScaleState` of ``jnp`` scalars and the static config, with jmp's method
names), whose ``adjust`` is :func:`unimp.loss_scale.update_arrays` over ``jnp`` arrays.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from unimp import loss_scale as core
from unimp.backends.jax.casting import _is_floating_array
from unimp.backends.jax.overflow import check_pred
from unimp.loss_scale.portable import check_scale_value


class LossScaleOps:
    """The array namespace :func:`unimp.loss_scale.update_arrays` runs on: jnp scalars."""

    where = staticmethod(jnp.where)
    minimum = staticmethod(jnp.minimum)
    maximum = staticmethod(jnp.maximum)
    isfinite = staticmethod(jnp.isfinite)

    @staticmethod
    def f32(x: Any) -> jax.Array:
        return jnp.asarray(x, jnp.float32)

    @staticmethod
    def i32(x: Any) -> jax.Array:
        return jnp.asarray(x, jnp.int32)


STATIC_FIELDS = {"static": True}


def replace_unchecked(obj: Any, **changes: Any) -> Any:
    """A copy of a frozen dataclass with fields replaced, skipping ``__init__``: no validation
    and no host sync (for values an update computed, possibly tracers)."""
    new = object.__new__(type(obj))
    for name in _field_names(type(obj)):
        object.__setattr__(new, name, changes.get(name, getattr(obj, name)))
    return new


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """``cls``'s dataclass field names, read once per class (each step replaces fields)."""
    return tuple(f.name for f in dataclasses.fields(cls))


def pytree_from_fields(cls: type) -> type:
    """Registers a frozen dataclass as a pytree, fields read from ``dataclasses.fields``
    (never a hand-written list: jmp lost ``min_loss_scale`` through ``jit`` that way).

    Fields with ``metadata={"static": True}`` are auxiliary data (hashable, part of the jit
    cache key); every other field is a child. Unflattening bypasses ``__init__`` so JAX's
    placeholder leaves (``object()``, tracers) are never validated or converted. Used by
    :class:`unimp.LossScaleState` and :class:`LossScale` here and by the jmp and flax shims
    (``unimp.compat``).
    """
    fields = dataclasses.fields(cls)
    data = tuple(f.name for f in fields if not f.metadata.get("static"))
    meta = tuple(f.name for f in fields if f.metadata.get("static"))
    keys = tuple(jax.tree_util.GetAttrKey(n) for n in data)

    def flatten_with_keys(obj: Any) -> tuple[Any, Any]:
        return [(k, getattr(obj, n)) for k, n in zip(keys, data, strict=True)], tuple(
            getattr(obj, n) for n in meta
        )

    def flatten(obj: Any) -> tuple[Any, Any]:
        return [getattr(obj, n) for n in data], tuple(getattr(obj, n) for n in meta)

    def unflatten(aux: Any, children: Any) -> Any:
        obj = object.__new__(cls)
        for n, v in zip(data, children, strict=True):
            object.__setattr__(obj, n, v)
        for n, v in zip(meta, aux, strict=True):
            object.__setattr__(obj, n, v)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


# The core's record is the state's pytree: its leaves are its fields, in field order, under their
# names; a loss scale's leaves are the leaves of its state.
pytree_from_fields(core.LossScaleState)

_STATE_FIELDS = _field_names(core.LossScaleState)


def _scalar(value: Any, dtype: Any, name: str) -> jax.Array:
    if isinstance(value, (bool, np.bool_)) or (
        hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.bool_)
    ):
        raise TypeError(f"LossScale.state.{name} must be a number, got a bool.")
    try:
        arr = jnp.asarray(value)
    except TypeError:
        raise TypeError(
            f"LossScale.state.{name} must be a number or a scalar array, got {type(value).__name__}."
        ) from None
    if arr.shape != ():
        raise ValueError(f"LossScale.state.{name} must be a scalar, got shape {arr.shape}.")
    if not (jnp.issubdtype(arr.dtype, jnp.floating) or jnp.issubdtype(arr.dtype, jnp.integer)):
        raise TypeError(f"LossScale.state.{name} must be real, got dtype {arr.dtype}.")
    return arr.astype(dtype)


def _concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _is_float_leaf(x: Any) -> bool:
    return _is_floating_array(x) or (isinstance(x, float) and not isinstance(x, bool))


@dataclass(frozen=True, eq=False)
class LossScale:
    """The loss scale as an immutable pytree: a :class:`unimp.LossScaleState` of ``jnp`` scalars
    and the config it follows, with jmp's method names (``loss_scale``, ``scale``, ``unscale``,
    ``adjust``).

    One class for every config, as torch's one ``GradScaler`` and Keras's one
    ``LossScaleOptimizer``: the config decides the rule. A :class:`unimp.DynamicLossScale`
    follows unimp's reference algorithm (:func:`unimp.loss_scale.update_arrays`): matches
    torch.amp.GradScaler and jmp.DynamicLossScale (grows on the growth_interval-th consecutive
    finite step, backs off on overflow and restarts the count), plus a floor, a cap, skip
    counters and the forward-overflow rule; ``LossScale.preset("flax")`` reproduces flax's
    DynamicScale and ``preset("jmp")`` jmp's. A :class:`unimp.StaticLossScale` never changes
    its scale, and with :class:`unimp.NoLossScale` ``scale`` / ``unscale`` return the tree
    unchanged; both still count skipped steps. jmp's own classes and constructors are
    :mod:`unimp.compat.jmp`'s.

    The pytree's leaves are the state's fields (the config is static data, part of ``jit``'s
    cache key), so every field survives flatten / unflatten, ``jit``, ``lax.scan`` and
    :meth:`state_dict`, and the state is float32 / int32 whatever dtypes it is given in.

    Attributes:
        config: the loss-scale config (static).
        state: the :class:`unimp.LossScaleState`, float32 ``scale`` and int32 counters as
            ``jnp`` scalars (tracers under ``jit``); reading one on the host synchronizes.

    Args:
        config: a :class:`unimp.DynamicLossScale`, :class:`unimp.StaticLossScale` or
            :class:`unimp.NoLossScale`; :meth:`from_config` also reads specs (``"dynamic"``, a
            number, a dict).
        state: where to start, a :class:`unimp.LossScaleState` (any real scalars: a float16
            ``2**15`` included); ``config.initial_state()`` when omitted. Host values follow
            the rules of a loaded state (:func:`unimp.loss_scale.from_state_dict`); of device
            arrays only a concrete scale is read, here, never in a step.

    Raises:
        TypeError: ``config`` is not a loss-scale config (jmp's positional arguments
            included), or a state field is a bool or not a real number.
        ValueError: a non-scalar state field, or a state the config cannot hold (a scale
            outside ``[min_scale, max_scale]``, a static scale other than the config's, a
            counter past ``growth_interval``, ...), naming the field.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import unimp
        >>> ls = LossScale(unimp.DynamicLossScale(init_scale=4.0, min_scale=0.25))
        >>> step = jax.jit(lambda s: s.adjust(jnp.array(False)))
        >>> for _ in range(4):
        ...     ls = step(ls)
        >>> float(ls.loss_scale), ls.config.min_scale
        (0.25, 0.25)
    """

    config: core.LossScaleConfig = field(metadata=STATIC_FIELDS)
    state: core.LossScaleState = None  # type: ignore[assignment]  # None: config.initial_state()

    def __post_init__(self) -> None:
        cfg = self.config
        if not isinstance(cfg, core.LossScaleConfig):
            raise TypeError(
                f"LossScale takes a loss-scale config (unimp.DynamicLossScale(...), "
                f"unimp.StaticLossScale(...), unimp.NoLossScale()), got {type(cfg).__name__}; "
                "LossScale.from_config reads a spec ('dynamic', a number, a dict). jmp's "
                "DynamicLossScale(loss_scale, counter, period, factor, min_loss_scale) is "
                "unimp.compat.jmp.DynamicLossScale, or here LossScale(unimp.DynamicLossScale."
                "preset('jmp', growth_interval=period, growth_factor=factor, min_scale="
                "min_loss_scale), unimp.LossScaleState(loss_scale, counter, 0, 0))."
            )
        s = cfg.initial_state() if self.state is None else self.state
        if not isinstance(s, core.LossScaleState):
            raise TypeError(
                f"LossScale.state must be a unimp.LossScaleState, got {type(s).__name__}."
            )
        held = {
            n: _scalar(getattr(s, n), jnp.float32 if n == "scale" else jnp.int32, n)
            for n in _STATE_FIELDS
        }
        if all(isinstance(getattr(s, n), np.generic) for n in _STATE_FIELDS):
            # host values follow the rules of a loaded state_dict (the other backends' way in)
            core.from_state_dict({"format": core.STATE_FORMAT, "config": cfg.to_dict(), "state": s.to_dict()})
        elif _concrete(held["scale"]):
            check_scale_value(cfg, float(held["scale"]), "LossScale.state.scale")
        object.__setattr__(self, "state", replace_unchecked(s, **held))

    @classmethod
    def from_config(cls, config: Any = "dynamic", state: core.LossScaleState | None = None) -> LossScale:
        """The loss scale for any config or spec.

        Args:
            config: a core config, or anything :func:`unimp.loss_scale.loss_scale_from_dict`
                accepts (``"dynamic"``, ``"none"``, ``"preset:jmp"``, a number, a dict).
            state: an optional :class:`unimp.LossScaleState` to start from.

        Raises:
            ValueError: an unknown loss-scale spec, or a state the config cannot hold.
        """
        return cls(core.loss_scale_from_dict(config), state)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LossScale:
        """The loss scale of :meth:`unimp.DynamicLossScale.preset` (``"jmp"``, ``"flax"``,
        ``"torch"``, ...), in its initial state.

        Raises:
            ValueError: unknown preset name or bad override.
        """
        return cls(core.DynamicLossScale.preset(name, **overrides))

    # -- jmp's interface ------------------------------------------------------------------

    @property
    def loss_scale(self) -> jax.Array:
        """jmp's name for the current scale, ``state.scale`` (a float32 scalar)."""
        return self.state.scale

    def scale(self, tree: Any) -> Any:
        """Multiplies the floating leaves of ``tree`` (usually the loss) by the loss scale.

        Leaves are multiplied by the float32 scale with JAX's type promotion, so a float16
        loss comes back float32 (2**16 does not fit in float16), as in jmp. Non-floating
        leaves pass through; without loss scaling (:class:`unimp.NoLossScale`) ``tree`` is
        returned unchanged.
        """
        if not self.config.enabled:
            return tree
        s = self.state.scale
        return jax.tree_util.tree_map(lambda x: x * s if _is_float_leaf(x) else x, tree)

    def unscale(self, tree: Any) -> Any:
        """Multiplies the floating leaves of ``tree`` (the gradients) by ``1 / loss_scale``.

        The reciprocal is taken in float32 and multiplied in, as torch.amp.GradScaler and jmp
        do; results are at least float32. Non-floating leaves pass through; without loss
        scaling ``tree`` is returned unchanged.
        """
        if not self.config.enabled:
            return tree
        inv = jnp.float32(1.0) / self.state.scale
        return jax.tree_util.tree_map(lambda x: x * inv if _is_float_leaf(x) else x, tree)

    def adjust(self, grads_finite: Any, loss_finite: Any = True) -> LossScale:
        """The loss scale after one step, by :func:`unimp.loss_scale.update_arrays`.

        Branch-free (``jnp.where``), so it traces under ``jit``, ``vmap``, ``lax.scan`` and
        ``shard_map``. A non-finite step is counted as skipped; a dynamic scale backs off on
        non-finite gradients, grows after ``growth_interval`` finite steps in a row, and is
        left alone when the loss itself is not finite (a forward overflow).

        Args:
            grads_finite: bool scalar, every unscaled gradient element is finite.
            loss_finite: bool scalar, the unscaled loss is finite (default True).

        Returns:
            A new loss scale; ``self`` is unchanged.

        Raises:
            ValueError: a flag is not a bool scalar.
        """
        g = check_pred(grads_finite, "LossScale.adjust(grads_finite)")
        lf = check_pred(loss_finite, "LossScale.adjust(loss_finite)")
        s, cfg = self.state, self.config
        extra = tuple(getattr(s, n) for n in core.EXTRA_FIELDS) if core.tracks_extra(cfg) else None
        out = core.update_arrays(
            LossScaleOps, cfg, s.scale, s.counter, s.consecutive_skips, s.total_skips, g, lf, extra=extra
        )
        # the values come from update_arrays, already float32 / int32 scalars: no checks
        new = replace_unchecked(s, **dict(zip(_STATE_FIELDS, out, strict=False)))
        return replace_unchecked(self, state=new)

    # -- conversions ------------------------------------------------------------------------

    def _host_state(self) -> core.LossScaleState:
        """The state as a host :class:`unimp.LossScaleState` (synchronizes)."""
        return core.LossScaleState(*jax.device_get(jax.tree_util.tree_leaves(self.state)))

    def state_dict(self) -> dict[str, Any]:
        """The portable state (:func:`unimp.loss_scale.state_dict`), the same in every backend.

        Raises:
            TypeError: called on traced values inside ``jit``; call it outside.
        """
        if not all(_concrete(x) for x in jax.tree_util.tree_leaves(self.state)):
            raise TypeError("state_dict() needs concrete values; call it outside jit / scan.")
        return core.state_dict(self.config, self._host_state())

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any], current: core.LossScaleConfig | None = None) -> LossScale:
        """Inverse of :meth:`state_dict`; also reads a state saved by another backend.

        Args:
            d: the portable state dict.
            current: the config of the loss scale it replaces, if any (see
                :func:`unimp.loss_scale.from_state_dict`: a state without loss scaling is
                refused for one that scales).

        Raises:
            ValueError: a bad or foreign state dict (see :func:`unimp.loss_scale.from_state_dict`);
                the message names the key.
        """
        return cls(*core.from_state_dict(d, current))

    def check(self) -> None:
        """Raises :class:`unimp.LossScaleError` past ``max_consecutive_skips`` or at a floor hit
        with ``floor_action="raise"`` (warns with "warn"); synchronizes."""
        core.check_state(self.config, self._host_state())


pytree_from_fields(LossScale)


def _changed_fields(ls: LossScale, forward: bool) -> dict[str, Any]:
    """The state fields of ``ls`` (after ``adjust``) that the update may have changed, by name:
    all of them, or with ``forward`` (the state given to the step is still valid after it, i.e.
    not donated) those not in :func:`unimp.loss_scale.unchanged_fields`, which the caller takes
    from that state (:func:`_rejoin`) instead of a copy XLA makes of an input it returns."""
    same = core.unchanged_fields(ls.config) if forward else ()
    return {n: getattr(ls.state, n) for n in _STATE_FIELDS if n not in same}


def _rejoin(old: LossScale, changed: Mapping[str, Any]) -> LossScale:
    """``old`` with the state fields :func:`_changed_fields` returned."""
    return replace_unchecked(old, state=replace_unchecked(old.state, **changed))
