"""JAX loss scaling: the loss-scale pytrees (:class:`DynamicLossScale`, :class:`StaticLossScale`,
:class:`NoOpLossScale`, jmp's method names) whose ``adjust`` is
:func:`unimp.loss_scale.update_arrays` over ``jnp`` arrays.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from unimp import loss_scale as core
from unimp.backends.jax.casting import _is_floating_array
from unimp.backends.jax.overflow import check_pred


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


def _register_pytree(cls: type) -> type:
    """The loss-scale pytrees: :func:`pytree_from_fields`, and only ``loss_scale`` and
    ``counter`` positional (:func:`_refuse_jmp_positional`)."""
    pytree_from_fields(cls)
    _refuse_jmp_positional(cls)
    return cls


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
    placeholder leaves (``object()``, tracers) are never validated or converted. Used by the
    loss-scale pytrees here and by the jmp and flax shims (``unimp.compat``).
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


def _refuse_jmp_positional(cls: type) -> None:
    """Only ``loss_scale`` and ``counter`` may be positional. jmp's positional order is
    ``(loss_scale, counter, period, factor, min_loss_scale)``: read by field order, jmp code
    ``DynamicLossScale(s, c, 100, 4)`` would silently become ``consecutive_skips=100,
    total_skips=4`` and run with another rule than it says."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > 2:
            raise TypeError(
                f"{cls.__name__} takes at most 2 positional arguments (loss_scale, counter), got "
                f"{len(args)}; pass consecutive_skips=, total_skips= and config= by keyword. jmp's "
                "positional (period, factor, min_loss_scale) are a config here: "
                f"{cls.__name__}(loss_scale, counter, config=unimp.DynamicLossScale.preset('jmp', "
                "growth_interval=period, growth_factor=factor, min_scale=min_loss_scale))."
            )
        init(self, *args, **kwargs)

    cls.__init__ = __init__


def _scalar(value: Any, dtype: Any, cls: str, name: str) -> jax.Array:
    if isinstance(value, (bool, np.bool_)) or (
        hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.bool_)
    ):
        raise TypeError(f"{cls}.{name} must be a number, got a bool.")
    try:
        arr = jnp.asarray(value)
    except TypeError:
        raise TypeError(
            f"{cls}.{name} must be a number or a scalar array, got {type(value).__name__}."
        ) from None
    if arr.shape != ():
        raise ValueError(f"{cls}.{name} must be a scalar, got shape {arr.shape}.")
    if not (jnp.issubdtype(arr.dtype, jnp.floating) or jnp.issubdtype(arr.dtype, jnp.integer)):
        raise TypeError(f"{cls}.{name} must be real, got dtype {arr.dtype}.")
    return arr.astype(dtype)


def _concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


@dataclass(frozen=True, eq=False)
class _LossScale:
    """Shared fields and methods of the loss-scale pytrees (see :class:`DynamicLossScale`).

    ``eq=False``: the fields are arrays, so equality and hashing are by identity (a generated
    ``__eq__`` would be ambiguous and a generated ``__hash__`` would fail on arrays).
    """

    loss_scale: Any = None
    counter: Any = 0
    consecutive_skips: Any = 0
    total_skips: Any = 0
    hysteresis_used: Any = 0  # the extra fields (unimp.loss_scale.EXTRA_FIELDS)
    overflows_since_rescale: Any = 0
    steps_since_rescale: Any = 0
    floor_hits: Any = 0
    config: Any = field(default=None, metadata=STATIC_FIELDS)

    _config_cls: ClassVar[type] = core.DynamicLossScale

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.loss_scale is not None:  # shape and type errors before any config is derived
            _scalar(self.loss_scale, jnp.float32, name, "loss_scale")
        cfg = self.config
        if cfg is None:
            cfg = self._default_config()
        elif not isinstance(cfg, self._config_cls):
            raise TypeError(
                f"{name}.config must be a unimp.{self._config_cls.__name__}, got "
                f"{type(cfg).__name__}; build a loss scale of any kind with "
                "unimp.backends.jax.loss_scale_from_config(config)."
            )
        scale = cfg.initial_scale() if self.loss_scale is None else self.loss_scale
        scale_arr = _scalar(scale, jnp.float32, name, "loss_scale")
        self._check_scale(cfg, scale_arr)
        ints = ("counter", "consecutive_skips", "total_skips", *core.EXTRA_FIELDS)
        self._check_host_state(cfg, (scale, *(getattr(self, n) for n in ints)))
        values = {"loss_scale": scale_arr}
        values.update({n: _scalar(getattr(self, n), jnp.int32, name, n) for n in ints})
        for k, v in values.items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "config", cfg)

    def _default_config(self) -> Any:
        return self._config_cls()

    @staticmethod
    def _check_host_state(cfg: Any, raw: tuple) -> None:
        """Host values (Python or NumPy numbers) follow the core's state rules, as a loaded
        state_dict does: counter in [0, growth_interval), consecutive <= total skips, int32
        counters, scale within the config. Device arrays and tracers (the values ``adjust``
        passes) are not read: that would be a host sync per step."""
        host = (int, float, np.number, np.ndarray)
        if not all(isinstance(v, host) and not isinstance(v, (bool, np.bool_)) for v in raw):
            return
        names = [f.name for f in dataclasses.fields(core.LossScaleState)]
        state = dict(zip(names, (np.asarray(v).item() for v in raw), strict=True))
        core.from_state_dict({"format": core.STATE_FORMAT, "config": cfg.to_dict(), "state": state})

    def _check_scale(self, cfg: Any, scale: jax.Array) -> None:
        pass

    # -- jmp's interface ------------------------------------------------------------------

    def scale(self, tree: Any) -> Any:
        """Multiplies the floating leaves of ``tree`` (usually the loss) by the loss scale.

        Leaves are multiplied by the float32 scale with JAX's type promotion, so a float16
        loss comes back float32 (2**16 does not fit in float16), as in jmp. Non-floating
        leaves pass through.
        """
        s = self.loss_scale
        return jax.tree_util.tree_map(lambda x: x * s if _is_float_leaf(x) else x, tree)

    def unscale(self, tree: Any) -> Any:
        """Multiplies the floating leaves of ``tree`` (the gradients) by ``1 / loss_scale``.

        The reciprocal is taken in float32 and multiplied in, as torch.amp.GradScaler and jmp
        do; results are at least float32. Non-floating leaves pass through.
        """
        inv = jnp.float32(1.0) / self.loss_scale
        return jax.tree_util.tree_map(lambda x: x * inv if _is_float_leaf(x) else x, tree)

    def adjust(self, grads_finite: Any, loss_finite: Any = True) -> Any:
        """The state after one step, by :func:`unimp.loss_scale.update_arrays`.

        Branch-free (``jnp.where``), so it traces under ``jit``, ``vmap``, ``lax.scan`` and
        ``shard_map``. A non-finite step is counted as skipped; a dynamic scale backs off on
        non-finite gradients, grows after ``growth_interval`` finite steps in a row, and is
        left alone when the loss itself is not finite (a forward overflow).

        Args:
            grads_finite: bool scalar, every unscaled gradient element is finite.
            loss_finite: bool scalar, the unscaled loss is finite (default True).

        Returns:
            A new loss scale of the same class; ``self`` is unchanged.

        Raises:
            ValueError: a flag is not a bool scalar.
        """
        g = check_pred(grads_finite, f"{type(self).__name__}.adjust(grads_finite)")
        lf = check_pred(loss_finite, f"{type(self).__name__}.adjust(loss_finite)")
        extra = tuple(getattr(self, n) for n in core.EXTRA_FIELDS) if core.tracks_extra(self.config) else None
        out = core.update_arrays(
            LossScaleOps, self.config, *self._held()[:4], g, lf, extra=extra
        )
        names = [f.name for f in dataclasses.fields(core.LossScaleState)]
        return self._evolve(loss_scale=out[0], **dict(zip(names[1:len(out)], out[1:], strict=True)))

    def _held(self) -> tuple[Any, ...]:
        """The state's arrays, in :class:`unimp.LossScaleState` field order."""
        return (self.loss_scale,) + tuple(
            getattr(self, f.name) for f in dataclasses.fields(core.LossScaleState)[1:]
        )

    def _evolve(self, **changes: Any) -> Any:
        """A copy with fields replaced, skipping ``__init__`` (the values come from
        update_arrays, already float32 / int32 scalars)."""
        return replace_unchecked(self, **changes)

    # -- conversions ------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: Any, state: core.LossScaleState | None = None) -> Any:
        """Builds the loss scale from a core config (and optionally a core state).

        Raises:
            TypeError: the config is of another kind (use :func:`loss_scale_from_config`).
        """
        s = config.initial_state() if state is None else state
        names = [f.name for f in dataclasses.fields(core.LossScaleState)[2:]]
        return cls(s.scale, s.counter, config=config, **{n: getattr(s, n) for n in names})

    @property
    def state(self) -> core.LossScaleState:
        """The state as a host :class:`unimp.LossScaleState` (synchronizes)."""
        return core.LossScaleState(*jax.device_get(self._held()))

    def state_dict(self) -> dict[str, Any]:
        """The portable state (:func:`unimp.loss_scale.state_dict`), the same in every backend.

        Raises:
            TypeError: called on traced values inside ``jit``; call it outside.
        """
        if not all(_concrete(x) for x in self._held()):
            raise TypeError("state_dict() needs concrete values; call it outside jit / scan.")
        return core.state_dict(self.config, self.state)

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any]) -> Any:
        """Inverse of :meth:`state_dict`; also reads a state saved by another backend.

        Raises:
            ValueError: a bad or foreign state dict (see :func:`unimp.loss_scale.from_state_dict`),
                or one of another kind than ``cls`` (the message names the right class).
        """
        config, state = core.from_state_dict(d)
        if not isinstance(config, cls._config_cls):
            right = _PYTREE_FOR[type(config)].__name__
            raise ValueError(
                f"this state_dict holds a {config.kind!r} loss scale; load it with {right}.from_state_dict "
                "or loss_scale_from_state_dict."
            )
        return cls.from_config(config, state)

    def check(self) -> None:
        """Raises :class:`unimp.LossScaleError` past ``max_consecutive_skips`` or at a floor hit
        with ``floor_action="raise"`` (warns with "warn"); synchronizes."""
        core.check_state(self.config, self.state)


def _is_float_leaf(x: Any) -> bool:
    return _is_floating_array(x) or (isinstance(x, float) and not isinstance(x, bool))


@_register_pytree
@dataclass(frozen=True, eq=False)
class DynamicLossScale(_LossScale):
    """A dynamic loss scale as an immutable pytree, with jmp's method names.

    Follows unimp's reference algorithm (:func:`unimp.loss_scale.update_arrays`): matches
    torch.amp.GradScaler and jmp.DynamicLossScale (grows on the growth_interval-th consecutive
    finite step, backs off on overflow and restarts the count), plus a floor, a cap, skip
    counters and the forward-overflow rule. ``DynamicLossScale.preset("flax")`` reproduces
    flax's DynamicScale and ``preset("jmp")`` jmp's.

    Unlike jmp, every field survives flatten/unflatten, ``jit``, ``lax.scan`` and
    ``state_dict`` (the config is static pytree data), and the state is float32 / int32
    whatever dtypes are passed in.

    Attributes:
        loss_scale: float32 scalar, the current scale.
        counter: int32 scalar, consecutive finite steps since the last growth or overflow.
        consecutive_skips: int32 scalar, skipped steps in a row.
        total_skips: int32 scalar, skipped steps since the start.
        config: the :class:`unimp.DynamicLossScale` config (static).

    Args:
        loss_scale: the current scale, any real scalar (a float16 ``2**15`` included); defaults
            to ``config.init_scale``. Given without ``config``, it becomes the config's
            ``init_scale``.
        counter, consecutive_skips, total_skips: integer scalars, default 0.
        config: a :class:`unimp.DynamicLossScale`; unimp's defaults when omitted.

    Raises:
        TypeError: a config of another kind, or a bool / non-real value.
        ValueError: a non-scalar value, or a concrete scale outside ``[min_scale, max_scale]``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import unimp
        >>> ls = DynamicLossScale.from_config(unimp.DynamicLossScale(init_scale=4.0, min_scale=0.25))
        >>> step = jax.jit(lambda s: s.adjust(jnp.array(False)))
        >>> for _ in range(4):
        ...     ls = step(ls)
        >>> float(ls.loss_scale), ls.config.min_scale
        (0.25, 0.25)
    """

    config: core.DynamicLossScale = field(default=None, metadata=STATIC_FIELDS)

    _config_cls: ClassVar[type] = core.DynamicLossScale

    def _default_config(self) -> core.DynamicLossScale:
        if self.loss_scale is not None and _concrete(self.loss_scale):
            return core.DynamicLossScale(init_scale=float(np.asarray(self.loss_scale, np.float64)))
        return core.DynamicLossScale()

    def _check_scale(self, cfg: Any, scale: jax.Array) -> None:
        if not _concrete(scale):
            return
        value = float(scale)
        hi = cfg.max_scale if cfg.max_scale is not None else float(np.finfo(np.float32).max)
        if not cfg.floor <= value <= hi:
            raise ValueError(
                f"DynamicLossScale.loss_scale ({value}) must be in [min_scale, max_scale] = "
                f"[{cfg.floor}, {cfg.max_scale}]; change the config or the scale."
            )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> DynamicLossScale:
        """The loss scale of :meth:`unimp.DynamicLossScale.preset` (``"jmp"``, ``"flax"``,
        ``"torch"``, ...), in its initial state.

        Raises:
            ValueError: unknown preset name or bad override.
        """
        return cls.from_config(core.DynamicLossScale.preset(name, **overrides))

    # jmp's names for the config, read-only.
    @property
    def period(self) -> int:
        """jmp's name for ``config.growth_interval``."""
        return self.config.growth_interval

    @property
    def factor(self) -> float:
        """jmp's name for ``config.growth_factor``."""
        return self.config.growth_factor

    @property
    def min_loss_scale(self) -> float:
        """jmp's name for the floor (``config.floor``)."""
        return self.config.floor


@_register_pytree
@dataclass(frozen=True, eq=False)
class StaticLossScale(_LossScale):
    """A fixed loss scale as a pytree (jmp.StaticLossScale), counting skipped steps.

    ``adjust`` never changes the scale; it counts non-finite steps (they are still skipped).

    Args:
        loss_scale: the scale; given without ``config`` it becomes ``config.scale``.
        counter, consecutive_skips, total_skips: integer scalars, default 0.
        config: a :class:`unimp.StaticLossScale`.

    Raises:
        TypeError: a config of another kind, or a bool / non-real value.
        ValueError: a concrete ``loss_scale`` different from ``config.scale``.
    """

    config: core.StaticLossScale = field(default=None, metadata=STATIC_FIELDS)

    _config_cls: ClassVar[type] = core.StaticLossScale

    def _default_config(self) -> core.StaticLossScale:
        if self.loss_scale is None:
            return core.StaticLossScale()
        if not _concrete(self.loss_scale):
            raise TypeError("StaticLossScale needs config= when built from a traced value.")
        return core.StaticLossScale(float(np.asarray(self.loss_scale, np.float64)))

    def _check_scale(self, cfg: Any, scale: jax.Array) -> None:
        if _concrete(scale) and float(scale) != cfg.scale:
            raise ValueError(
                f"StaticLossScale.loss_scale ({float(scale)}) must equal config.scale ({cfg.scale})."
            )


@_register_pytree
@dataclass(frozen=True, eq=False)
class NoOpLossScale(_LossScale):
    """No loss scaling (jmp.NoOpLossScale): ``scale``/``unscale`` return the tree unchanged,
    ``loss_scale`` is 1.0 (float32), and ``adjust`` still counts skipped steps.

    Args:
        loss_scale: must be 1 when given.
        counter, consecutive_skips, total_skips: integer scalars, default 0.
        config: a :class:`unimp.NoLossScale`.
    """

    config: core.NoLossScale = field(default=None, metadata=STATIC_FIELDS)

    _config_cls: ClassVar[type] = core.NoLossScale

    def _check_scale(self, cfg: Any, scale: jax.Array) -> None:
        if _concrete(scale) and float(scale) != 1.0:
            raise ValueError(f"NoOpLossScale.loss_scale must be 1.0, got {float(scale)}.")

    def scale(self, tree: Any) -> Any:
        """Returns ``tree`` unchanged."""
        return tree

    def unscale(self, tree: Any) -> Any:
        """Returns ``tree`` unchanged."""
        return tree


_PYTREE_FOR: dict[type, type] = {
    core.DynamicLossScale: DynamicLossScale,
    core.StaticLossScale: StaticLossScale,
    core.NoLossScale: NoOpLossScale,
}


LossScale = DynamicLossScale | StaticLossScale | NoOpLossScale


def loss_scale_from_config(
    config: Any = "dynamic", state: core.LossScaleState | None = None
) -> LossScale:
    """The loss-scale pytree for any core config.

    Args:
        config: a core config, or anything :func:`unimp.loss_scale.loss_scale_from_dict`
            accepts (``"dynamic"``, ``"none"``, a number, a dict); a loss-scale pytree is
            returned unchanged.
        state: an optional :class:`unimp.LossScaleState` to start from.

    Raises:
        ValueError: an unknown loss-scale spec.
    """
    if isinstance(config, _LossScale):
        return config
    cfg = core.loss_scale_from_dict(config)
    return _PYTREE_FOR[type(cfg)].from_config(cfg, state)


def loss_scale_from_state_dict(d: Mapping[str, Any], current: Any = None) -> LossScale:
    """The loss-scale pytree of the right kind for a portable state dict (from any backend).

    Args:
        d: the portable state dict.
        current: the config of the scaler it replaces, if any (see
            :func:`unimp.loss_scale.from_state_dict`: a state without loss scaling is refused
            for one that scales).

    Raises:
        ValueError: a bad or foreign state dict; the message names the key.
    """
    config, state = core.from_state_dict(d, current)
    return _PYTREE_FOR[type(config)].from_config(config, state)


def _changed_fields(ls: LossScale, forward: bool) -> dict[str, Any]:
    """The fields of ``ls`` (after ``adjust``) that the update may have changed, by name: all of
    them, or with ``forward`` (the state given to the step is still valid after it, i.e. not
    donated) those not in :func:`unimp.loss_scale.unchanged_fields`, which the caller takes
    from that state (:func:`_rejoin`) instead of a copy XLA makes of an input it returns."""
    same = core.unchanged_fields(ls.config) if forward else ()
    names = [f.name for f in dataclasses.fields(ls) if not f.metadata.get("static")]
    return {n: getattr(ls, n) for n in names if (n if n != "loss_scale" else "scale") not in same}


def _rejoin(old: LossScale, changed: Mapping[str, Any]) -> LossScale:
    """``old`` with the fields :func:`_changed_fields` returned."""
    return replace_unchecked(old, **changed)
