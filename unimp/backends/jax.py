"""The JAX backend: jmp-style casting and loss-scale pytrees, optax and flax integration.

JAX has no autocast: a recipe is applied by casting at function and module boundaries, as jmp
and haiku do, and by passing ``dtype`` / ``param_dtype`` to flax modules. The loss scale is an
immutable pytree whose update is :func:`unimp.loss_scale.update_arrays` run on ``jnp`` arrays,
so it traces under ``jit``, ``vmap``, ``lax.scan`` and ``shard_map`` and matches the NumPy
reference bit for bit.

Pieces:

* :class:`MixedPrecision`: a recipe bound to JAX (casts, ``apply``, flax ``module_kwargs``,
  ``prepare`` and a jitted ``train_step``).
* :class:`DynamicLossScale`, :class:`StaticLossScale`, :class:`NoOpLossScale`: loss-scale
  pytrees with jmp's method names (``loss_scale``, ``scale``, ``unscale``, ``adjust``).
* :func:`loss_scaling`: an optax ``GradientTransformation`` carrying the loss scale in its
  state; :func:`get_loss_scale` reads it back; :class:`MultiSteps` is ``optax.MultiSteps``
  with the accumulator reset to exact zeros after every window.
* :func:`all_finite`, :func:`select_tree`, :func:`cast_tree`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from unimp import loss_scale as core
from unimp.backends._base import MixedPrecisionBase
from unimp.dtypes import canonical_dtype, device_support, parse_device
from unimp.loss_scale import ReplicaDesyncWarning
from unimp.step import StepResult, check_step_options, warn_half_optimizer_state

__all__ = [
    "DynamicLossScale",
    "LossScaleOptState",
    "MixedPrecision",
    "MultiSteps",
    "NoOpLossScale",
    "ReplicaDesyncWarning",
    "StaticLossScale",
    "StepResult",
    "TrainStep",
    "all_finite",
    "cast_tree",
    "device_info",
    "framework_version",
    "get_loss_scale",
    "loss_scale_from_config",
    "loss_scale_from_state_dict",
    "loss_scaling",
    "select_tree",
    "sync_loss_scale",
    "to_dtype",
]


# --------------------------------------------------------------------------------------------
# dtypes and casting
# --------------------------------------------------------------------------------------------


def framework_version() -> str:
    """The installed JAX version string, e.g. ``"0.4.35"``."""
    return jax.__version__


def to_dtype(name: Any) -> np.dtype:
    """The JAX dtype for a dtype name.

    Args:
        name: anything :func:`unimp.dtypes.canonical_dtype` accepts (``"bf16"``,
            ``jnp.float16``, ``"float32"``, ...).

    Returns:
        A NumPy dtype object as JAX uses it (``jnp.dtype("bfloat16")`` for bfloat16).

    Raises:
        ValueError: not a supported floating dtype; or ``float64`` while JAX runs in 32-bit
            mode (enable it with ``jax.config.update("jax_enable_x64", True)``).
    """
    canonical = canonical_dtype(name)
    if canonical == "float64" and not jax.config.jax_enable_x64:
        raise ValueError(
            "float64 needs JAX's 64-bit mode: call jax.config.update('jax_enable_x64', True) "
            "before creating arrays, or use a float32 policy."
        )
    return jnp.dtype(canonical)


def _is_floating_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(
        x.dtype, jnp.floating
    )


def cast_tree(tree: Any, dtype: Any) -> Any:
    """Casts the floating array leaves of a pytree; every other leaf passes through.

    Integer, boolean and complex arrays, Python scalars and non-array leaves are returned
    unchanged (as jmp's ``_cast_floating_to`` and Keras's ``_should_cast``). NumPy arrays stay
    NumPy arrays; JAX arrays (and tracers) stay JAX arrays.

    Args:
        tree: any pytree.
        dtype: the target floating dtype, anything :func:`to_dtype` accepts.

    Returns:
        A pytree of the same structure.

    Raises:
        ValueError: ``dtype`` is not a supported floating dtype.

    Example:
        >>> import jax.numpy as jnp
        >>> out = cast_tree({"w": jnp.ones(2), "step": jnp.int32(3)}, "float16")
        >>> out["w"].dtype, out["step"].dtype
        (dtype('float16'), dtype('int32'))
    """
    target = to_dtype(dtype)

    def cast(x: Any) -> Any:
        if _is_floating_array(x) and x.dtype != target:
            return x.astype(target)
        return x

    return jax.tree_util.tree_map(cast, tree)


def all_finite(tree: Any, axis_name: Any = None) -> jax.Array:
    """True when every floating element of a pytree is finite (no host sync).

    Non-floating leaves (integers, booleans, non-arrays) are ignored; an empty tree is finite.

    Args:
        tree: a pytree of arrays.
        axis_name: a mapped axis name (``pmap``, ``shard_map``, ``vmap(axis_name=...)``). When
            given, the result is reduced across that axis with ``lax.pmin`` so every replica
            takes the same skip decision: a non-finite element on any replica (a local
            gradient shard, for example) makes it False on all of them.

    Returns:
        A bool scalar array.

    Example:
        >>> import jax.numpy as jnp
        >>> bool(all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
        False
    """
    leaves = [
        x
        for x in jax.tree_util.tree_leaves(tree)
        if _is_floating_array(x) or (isinstance(x, float) and not isinstance(x, bool))
    ]
    if leaves:
        finite = jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()
    else:
        finite = jnp.array(True)
    if axis_name is not None:
        finite = lax.pmin(finite.astype(jnp.int32), axis_name) > 0
    return finite


def _check_pred(pred: Any, where: str) -> jax.Array:
    if isinstance(pred, jax.Array) or isinstance(pred, (np.ndarray, np.generic, bool)):
        p = jnp.asarray(pred)
    else:
        raise TypeError(
            f"{where}: pred must be a bool scalar (Python or array), got {type(pred).__name__}."
        )
    if p.shape != () or p.dtype != jnp.bool_:
        raise ValueError(
            f"{where}: pred must be a bool scalar, got dtype {p.dtype} shape {p.shape}; "
            "reduce it first, e.g. with all_finite(tree) or jnp.all(x)."
        )
    return p


def select_tree(pred: Any, a: Any, b: Any) -> Any:
    """Picks pytree ``a`` where ``pred`` is true, else ``b``, leaf by leaf, without a branch.

    The chosen values are returned bitwise (``lax.select``), so a skipped step leaves its
    state exactly unchanged.

    Args:
        pred: a bool scalar (array or Python bool).
        a, b: pytrees of the same structure, whose leaves have equal shapes and dtypes.

    Returns:
        A pytree like ``a``.

    Raises:
        ValueError: ``pred`` is not a bool scalar, or the trees differ in structure, shape or
            dtype (the message names the first differing leaf).
    """
    p = _check_pred(pred, "select_tree")
    sa, sb = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
    if sa != sb:
        raise ValueError(f"select_tree: a and b must have the same structure, got {sa} and {sb}.")
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(a)]
    for path, x, y in zip(paths, leaves_a, leaves_b, strict=True):
        x, y = jnp.asarray(x), jnp.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ValueError(
                f"select_tree: leaf {path or '<root>'} differs: {x.dtype}{list(x.shape)} vs "
                f"{y.dtype}{list(y.shape)}; cast both to one dtype and shape first."
            )
    return jax.tree_util.tree_map(lambda x, y: lax.select(p, jnp.asarray(x), jnp.asarray(y)), a, b)


def _keep_unless(pred: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``pred`` else ``old``, in ``old``'s dtypes (optimizer states may change
    weak types between steps); ``old`` comes back bitwise when ``pred`` is false."""
    return jax.tree_util.tree_map(
        lambda n, o: jnp.where(pred, n, o).astype(jnp.result_type(o)), new, old
    )


def _warn_resync() -> None:
    import warnings

    warnings.warn(
        "the replicas' loss-scale states differ (a checkpoint restored on one host only?); "
        "re-synchronized every replica from replica 0. Restore the loss-scale state on every "
        "process to avoid this.",
        ReplicaDesyncWarning,
        stacklevel=2,
    )


def _varying_axes(x: Any) -> frozenset:
    """The mesh axes ``x`` varies over under shard_map (JAX's variance typing, check_vma=True);
    empty where JAX does not track it."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # JAX >= 0.9
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # JAX 0.6 - 0.8


def sync_loss_scale(ls: Any, axis_name: Any) -> Any:
    """The loss-scale state of replica 0 on every replica, warning when the replicas differed.

    unimp's rule for replicas that start with different loss-scale states (a checkpoint
    restored on one host only): they are re-synchronized from replica 0 with a
    :class:`ReplicaDesyncWarning`, never silently and never by averaging. The check is one
    ``all_gather`` of four scalars per step; the warning is a ``jax.debug.callback`` that runs
    only when the states differ (no host sync otherwise). :class:`TrainStep` and
    :func:`loss_scaling` call it when given an ``axis_name``.

    Args:
        ls: a loss-scale pytree (:class:`DynamicLossScale` & co).
        axis_name: the mapped axis (``shard_map`` / ``pmap``) whose replicas must agree.

    Returns:
        A loss-scale pytree of the same class holding replica 0's values (replicated over the
        axis).
    """
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    index = lax.axis_index(axis_name)
    firsts, differs = [], []
    for x in leaves:
        x = jnp.asarray(x)
        # replica 0's value on every replica: a sum of it and zeros is exact
        firsts.append(lax.psum(jnp.where(index == 0, x, jnp.zeros_like(x)), axis_name))
        everyone = lax.all_gather(x, axis_name)
        differs.append(jnp.any(everyone != everyone[:1]))
    differ = lax.pmax(jnp.stack(differs).any().astype(jnp.int32), axis_name) > 0
    lax.cond(differ, lambda: jax.debug.callback(_warn_resync), lambda: None)
    return jax.tree_util.tree_unflatten(treedef, firsts)


def device_info() -> list[dict[str, Any]]:
    """For ``unimp info``: each JAX device with its kind, the half dtypes it runs and the
    recommended recipe, by the core rule :func:`unimp.dtypes.device_support`.

    Returns:
        ``[{"device", "kind", "float16", "bfloat16", "recommended"}, ...]``, one per
        ``jax.devices()`` entry.
    """
    out = []
    for d in jax.devices():
        platform = d.platform.lower()
        kind = "tpu" if platform == "tpu" else "cpu" if platform == "cpu" else "gpu"
        cc = None
        if kind == "gpu":
            try:
                cc = tuple(int(v) for v in str(getattr(d, "compute_capability", "")).split(".")[:2])
            except ValueError:
                cc = None
        out.append({"device": str(d), **device_support(kind, cc if cc and len(cc) == 2 else None)})
    return out


# --------------------------------------------------------------------------------------------
# loss-scale pytrees
# --------------------------------------------------------------------------------------------


class _JaxOps:
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


_STATIC = {"static": True}


def _register_pytree(cls: type) -> type:
    """Registers a frozen dataclass as a pytree, fields read from ``dataclasses.fields``.

    Fields with ``metadata={"static": True}`` are auxiliary data (hashable, part of the jit
    cache key); every other field is a child. Unflattening bypasses ``__init__`` so JAX's
    placeholder leaves (``object()``, tracers) are never validated or converted.
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
    config: Any = field(default=None, metadata=_STATIC)

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
        self._check_host_state(cfg, (scale, self.counter, self.consecutive_skips, self.total_skips))
        values = {
            "loss_scale": scale_arr,
            "counter": _scalar(self.counter, jnp.int32, name, "counter"),
            "consecutive_skips": _scalar(
                self.consecutive_skips, jnp.int32, name, "consecutive_skips"
            ),
            "total_skips": _scalar(self.total_skips, jnp.int32, name, "total_skips"),
        }
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
        g = _check_pred(grads_finite, f"{type(self).__name__}.adjust(grads_finite)")
        lf = _check_pred(loss_finite, f"{type(self).__name__}.adjust(loss_finite)")
        scale, counter, consecutive, total = core.update_arrays(
            _JaxOps,
            self.config,
            self.loss_scale,
            self.counter,
            self.consecutive_skips,
            self.total_skips,
            g,
            lf,
        )
        return self._evolve(
            loss_scale=scale, counter=counter, consecutive_skips=consecutive, total_skips=total
        )

    def _evolve(self, **changes: Any) -> Any:
        """A copy with fields replaced, skipping ``__init__``: no validation and no host sync
        (the values come from update_arrays, already float32 / int32 scalars)."""
        obj = object.__new__(type(self))
        for f in dataclasses.fields(self):
            object.__setattr__(obj, f.name, changes.get(f.name, getattr(self, f.name)))
        return obj

    # -- conversions ------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: Any, state: core.LossScaleState | None = None) -> Any:
        """Builds the loss scale from a core config (and optionally a core state).

        Raises:
            TypeError: the config is of another kind (use :func:`loss_scale_from_config`).
        """
        s = config.initial_state() if state is None else state
        return cls(s.scale, s.counter, s.consecutive_skips, s.total_skips, config=config)

    @property
    def state(self) -> core.LossScaleState:
        """The state as a host :class:`unimp.LossScaleState` (synchronizes)."""
        values = jax.device_get(
            (self.loss_scale, self.counter, self.consecutive_skips, self.total_skips)
        )
        return core.LossScaleState(*values)

    def state_dict(self) -> dict[str, Any]:
        """The portable state (:func:`unimp.loss_scale.state_dict`), the same in every backend.

        Raises:
            TypeError: called on traced values inside ``jit``; call it outside.
        """
        leaves = (self.loss_scale, self.counter, self.consecutive_skips, self.total_skips)
        if not all(_concrete(x) for x in leaves):
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
        """Raises :class:`unimp.LossScaleError` past ``max_consecutive_skips`` (synchronizes)."""
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

    config: core.DynamicLossScale = field(default=None, metadata=_STATIC)

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

    config: core.StaticLossScale = field(default=None, metadata=_STATIC)

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

    config: core.NoLossScale = field(default=None, metadata=_STATIC)

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


def loss_scale_from_state_dict(d: Mapping[str, Any]) -> LossScale:
    """The loss-scale pytree of the right kind for a portable state dict (from any backend).

    Raises:
        ValueError: a bad or foreign state dict; the message names the key.
    """
    config, state = core.from_state_dict(d)
    return _PYTREE_FOR[type(config)].from_config(config, state)


# --------------------------------------------------------------------------------------------
# optax
# --------------------------------------------------------------------------------------------


class LossScaleOptState(NamedTuple):
    """State of :func:`loss_scaling`: the loss-scale pytree and the inner optimizer's state."""

    loss_scale: Any
    inner_state: Any


def loss_scaling(
    inner: optax.GradientTransformation, loss_scale: Any = "dynamic", *, axis_name: Any = None
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax optimizer with loss scaling; the scale lives in the optimizer state.

    ``update`` takes the *scaled* gradients, unscales them, and when they (and the loss, if
    given as ``value=``) are finite, runs the inner optimizer. A non-finite step is skipped:
    the updates are zeros (negative zeros, so ``optax.apply_updates`` leaves every parameter
    bitwise unchanged, ``-0.0`` included), the inner state is returned bitwise unchanged, and
    the skip is counted. The scale is adjusted by unimp's algorithm either way. Unlike
    ``optax.apply_if_finite`` it never gives up and applies a non-finite update.

    Read the scale for the next loss with :func:`get_loss_scale`. Works inside
    :class:`MultiSteps` (a window with a non-finite micro-batch is skipped whole).

    Args:
        inner: the optax optimizer to protect.
        loss_scale: a core config, a loss-scale pytree, or a spec such as ``"dynamic"``.
        axis_name: under ``shard_map`` / ``pmap``, the data-parallel axis: the finite flags
            are reduced over it (a non-finite gradient on any replica skips the step on all)
            and the loss-scale state is taken from replica 0 (:func:`sync_loss_scale`), so
            the replicas' scales and parameters stay identical. ``None``: one replica.

    Returns:
        A ``GradientTransformationExtraArgs``; ``update(updates, state, params=None, *,
        value=None, **extra_args)`` where ``value`` is the unscaled loss (its non-finiteness is
        a forward overflow: skipped without reducing the scale). Extra args go to ``inner``.

    Raises:
        TypeError: ``inner`` is not an optax GradientTransformation.
        ValueError: a bad loss-scale spec.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> opt = loss_scaling(optax.sgd(1.0), 8.0)
        >>> state = opt.init(jnp.zeros(2))
        >>> updates, state = opt.update(jnp.array([jnp.nan, 0.0]), state)
        >>> updates.tolist(), int(get_loss_scale(state).total_skips)
        ([-0.0, -0.0], 1)
    """
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            f"loss_scaling needs an optax GradientTransformation (e.g. optax.adam(1e-3)), got {type(inner).__name__}."
        )
    initial = loss_scale_from_config(loss_scale)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> LossScaleOptState:
        return LossScaleOptState(initial, inner.init(params))

    def update_fn(
        updates: Any, state: LossScaleOptState, params: Any = None, **extra_args: Any
    ) -> Any:
        ls = state.loss_scale
        if axis_name is not None:
            ls = sync_loss_scale(ls, axis_name)
        grads = ls.unscale(updates)
        grads_finite = all_finite(grads, axis_name)
        value = extra_args.get("value")
        loss_finite = jnp.array(True) if value is None else all_finite(value, axis_name)
        applied = grads_finite & loss_finite
        new_updates, new_inner = inner.update(grads, state.inner_state, params, **extra_args)
        new_updates = jax.tree_util.tree_map(
            lambda u: jnp.where(applied, u, jnp.full_like(u, -0.0)), new_updates
        )
        inner_state = _keep_unless(applied, new_inner, state.inner_state)
        return new_updates, LossScaleOptState(ls.adjust(grads_finite, loss_finite), inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def get_loss_scale(opt_state: Any) -> LossScale:
    """The loss-scale pytree inside an optimizer state built with :func:`loss_scaling`.

    Searches nested states (``optax.chain``, :class:`MultiSteps`, ...). Inside ``MultiSteps``
    this is the committed scale, constant through an accumulation window. Scale the loss with
    ``get_loss_scale(opt_state).scale(loss)``.

    Raises:
        ValueError: none or more than one :class:`LossScaleOptState` in ``opt_state``.
    """
    found = [
        x.loss_scale
        for x in jax.tree_util.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, LossScaleOptState)
        )
        if isinstance(x, LossScaleOptState)
    ]
    if len(found) != 1:
        raise ValueError(
            f"expected one loss_scaling(...) state in the optimizer state, found {len(found)}; "
            "wrap the optimizer once with unimp.backends.jax.loss_scaling."
        )
    return found[0]


class MultiSteps(optax.MultiSteps):
    """``optax.MultiSteps`` whose gradient accumulator is reset to exact zeros after a window.

    optax resets the accumulator by multiplying it by zero, which leaves NaN (``0 * nan``)
    after a window with a non-finite micro-batch, so every later window is non-finite and
    skipped too. This subclass replaces the accumulator with ``zeros`` whenever a window
    ends, so with :func:`loss_scaling` as the inner optimizer a bad window is skipped whole and
    the next one starts clean. Arguments are optax.MultiSteps's.
    """

    def update(self, updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        new_updates, new_state = super().update(updates, state, params, **extra_args)
        window_done = new_state.mini_step == 0
        acc = jax.tree_util.tree_map(
            lambda a: jnp.where(window_done, jnp.zeros_like(a), a), new_state.acc_grads
        )
        return new_updates, new_state._replace(acc_grads=acc)


# --------------------------------------------------------------------------------------------
# MixedPrecision and the train step
# --------------------------------------------------------------------------------------------


class MixedPrecision(MixedPrecisionBase):
    """A recipe bound to JAX.

    JAX has no autocast: casts happen at function boundaries (:meth:`apply`, as jmp) and inside
    flax modules given :meth:`module_kwargs`.

    Args:
        recipe: a :class:`unimp.Recipe` or anything :func:`unimp.get_recipe` accepts.
        device: where :meth:`train_step` runs: ``"cpu"``, ``"gpu"`` / ``"cuda"``, ``"tpu"``
            with an optional ``":N"`` index, or a ``jax.Device`` (the same option as torch's);
            ``None`` (default) follows JAX's default device. The step's state is committed
            there and each batch is put there.

    Raises:
        ValueError: an unknown recipe, a float64 policy while JAX runs in 32-bit mode, or a
            device JAX does not have (the message lists the ones it has).

    Example:
        >>> import jax.numpy as jnp
        >>> mp = MixedPrecision("mixed_float16")
        >>> mp.cast_to_compute({"x": jnp.ones(2), "n": jnp.int32(1)})["x"].dtype
        dtype('float16')
    """

    _cast_tree = staticmethod(cast_tree)

    backend = "jax"

    def __init__(self, recipe: Any = "mixed_float16", device: Any = None) -> None:
        resolved = None if device is None else _as_device(device)  # before anything is kept
        super().__init__(recipe)
        p = self.policy
        self._dtypes = tuple(to_dtype(d) for d in (p.param_dtype, p.compute_dtype, p.output_dtype))
        self._device = resolved

    @property
    def device(self) -> jax.Device | None:
        """The bound device, or None (JAX's default device)."""
        return self._device

    @property
    def param_dtype(self) -> np.dtype:
        """The JAX dtype parameters are stored in."""
        return self._dtypes[0]

    @property
    def compute_dtype(self) -> np.dtype:
        """The JAX dtype the maths runs in."""
        return self._dtypes[1]

    @property
    def output_dtype(self) -> np.dtype:
        """The JAX dtype floating outputs are returned in."""
        return self._dtypes[2]

    def autocast(self) -> contextlib.AbstractContextManager:
        """A no-op context manager: JAX has no autocast (use :meth:`apply` or
        :meth:`module_kwargs`). Provided so framework-neutral code runs unchanged."""
        return contextlib.nullcontext()

    def apply(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Wraps ``fn(params, *inputs)`` jmp-style.

        Params and floating inputs are cast to the compute dtype, floating outputs to the
        output dtype; integer and boolean leaves pass through.

        Raises:
            TypeError: ``fn`` is not callable.
        """
        if not callable(fn):
            raise TypeError(
                f"apply() needs a function fn(params, *inputs), got {type(fn).__name__}."
            )

        @functools.wraps(fn)
        def wrapped(params: Any, *inputs: Any) -> Any:
            out = fn(self.cast_to_compute(params), *self.cast_to_compute(inputs))
            return self.cast_to_output(out)

        return wrapped

    def module_kwargs(self) -> dict[str, Any]:
        """``{"dtype": compute, "param_dtype": param}`` for flax linen and nnx modules.

        The dtype is explicit: flax's ``dtype=None`` promotes half inputs back to float32 when
        parameters are float32. Normalization layers given these keep float32 parameters and
        statistics (flax computes mean and variance in at least float32) and return the
        compute dtype.
        """
        return {"dtype": self.compute_dtype, "param_dtype": self.param_dtype}

    def init_loss_scale(self) -> LossScale:
        """The recipe's loss scale as a pytree in its initial state."""
        return loss_scale_from_config(self.loss_scale)

    def prepare(
        self, params: Any, optimizer: optax.GradientTransformation | None = None
    ) -> tuple[Any, Any]:
        """Applies the recipe to parameters and an optax optimizer.

        Args:
            params: a pytree; floating leaves are cast to the param dtype.
            optimizer: an optax optimizer, wrapped with :func:`loss_scaling` using the recipe's
                loss scale; ``None`` to skip.

        Returns:
            ``(params, optimizer)``; scale the loss with ``get_loss_scale(opt_state).scale``.
        """
        opt = None if optimizer is None else loss_scaling(optimizer, self.loss_scale)
        return self.cast_to_param(params), opt

    def train_step(
        self,
        loss_fn: Callable[[Any, Any], Any],
        optimizer: optax.GradientTransformation,
        params: Any,
        *,
        grad_accum_steps: int = 1,
        max_grad_norm: float | None = None,
        axis_name: Any = None,
        mesh: Any = None,
        donate: bool = False,
    ) -> TrainStep:
        """A jitted training step holding params, optimizer state and loss-scale state.

        See :class:`TrainStep` (``axis_name`` / ``mesh``: data parallelism under ``shard_map``). ``loss_fn(params, batch)`` returns a scalar loss; make it run
        in the compute dtype with :meth:`apply` or flax modules built with
        :meth:`module_kwargs`.
        """
        return TrainStep(
            self,
            loss_fn,
            optimizer,
            params,
            grad_accum_steps=grad_accum_steps,
            max_grad_norm=max_grad_norm,
            axis_name=axis_name,
            mesh=mesh,
            donate=donate,
        )


def _tracks_variance(axis_name: Any) -> bool:
    """True under shard_map with check_vma=True: JAX types values as varying over the axis,
    and the gradient of an invariant (replicated) param is all-reduced by the transpose."""
    return axis_name in _varying_axes(lax.axis_index(axis_name))


def _sharded_norm(grads: Any, axis_name: Any) -> jax.Array:
    """Global L2 norm under shard_map: squares of gradients that vary over ``axis_name``
    (local shards) are summed over it; replicated (already all-reduced) ones are not."""
    local, shared = jnp.float32(0.0), jnp.float32(0.0)
    for g in jax.tree_util.tree_leaves(grads):
        sq = jnp.sum(jnp.square(g.astype(jnp.promote_types(g.dtype, jnp.float32))))
        if axis_name in _varying_axes(g):
            local = local + sq
        else:
            shared = shared + sq
    return jnp.sqrt(shared + lax.psum(local, axis_name))


#: optax state fields holding running squares of gradients (Adam/AdamW/Adamax/NAdam's ``nu``,
#: RMSprop's ``nu``, Adagrad's ``sum_of_squares``, AdaBelief's ``nu``)
_SECOND_MOMENTS = frozenset({"nu", "sum_of_squares"})


def _half_second_moments(opt_state: Any) -> bool:
    """True when an optax state keeps second moments (``nu``, ``sum_of_squares``) in float16."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        names = {getattr(k, "name", None) for k in path}
        if names & _SECOND_MOMENTS and getattr(leaf, "dtype", None) == jnp.float16:
            return True
    return False


def _injected_eps(opt_state: Any) -> float | None:
    """The smallest ``eps`` of the ``optax.inject_hyperparams`` states in ``opt_state``, or
    None when there is none (optax closes over it otherwise) or it is not numeric."""
    found = []
    for state in jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(getattr(x, "hyperparams", None), dict)
    ):
        hyper = getattr(state, "hyperparams", None)
        if isinstance(hyper, dict) and "eps" in hyper:
            try:
                found.append(float(np.min(np.asarray(hyper["eps"], dtype=np.float64))))
            except (TypeError, ValueError):
                return None
    return min(found) if found else None


def _as_device(device: Any) -> jax.Device:
    """``"cpu"``, ``"cuda:1"``, ``"tpu"``, ... or a ``jax.Device``, as one of this process's
    devices (``jax.local_devices``: index N counts this host's devices, as torch's ``cuda:N``)."""
    if isinstance(device, jax.Device):
        return device
    platform, index = parse_device(device)  # the core's one reading of the spelling
    try:
        found = jax.local_devices(backend=platform)
    except RuntimeError:
        found = []
    i = index or 0
    if i >= len(found):
        have = []
        for p in ("cpu", "gpu", "tpu"):
            try:
                have += [f"{p}:{j}" for j in range(len(jax.local_devices(backend=p)))]
            except RuntimeError:
                pass
        raise ValueError(f"device={device!r}: JAX has no such device here (it has {', '.join(have)}).")
    return found[i]


def _device_leaf(x: Any) -> Any:
    return x if isinstance(x, jax.Array) else jnp.asarray(np.asarray(x))


def _commit_like(tree: Any, reference: Any) -> Any:
    """``tree`` with its uncommitted arrays committed where ``reference``'s committed arrays live.

    A jitted step whose arguments mix committed arrays (``jax.device_put(x, device)``, or any
    output of a jitted call on them) and uncommitted ones (``jnp.asarray``, ``init_loss_scale``)
    is compiled for that mix, and its outputs all come back committed: the second call then
    compiles again. Committing everything before the first call keeps it to one compilation.
    Uncommitted trees (or a reference on several devices) are returned unchanged.
    """
    devices = {
        frozenset(x.sharding.device_set)
        for x in jax.tree_util.tree_leaves(reference)
        if isinstance(x, jax.Array) and getattr(x, "committed", False)
    }
    if len(devices) != 1 or len(next(iter(devices))) != 1:
        return tree
    device = next(iter(next(iter(devices))))

    def commit(x: Any) -> Any:
        if isinstance(x, jax.Array) and not getattr(x, "committed", False):
            return jax.device_put(x, device)
        return x

    return jax.tree_util.tree_map(commit, tree)


def _contains_loss_scaling(state: Any) -> bool:
    return any(
        isinstance(x, LossScaleOptState)
        for x in jax.tree_util.tree_leaves(
            state, is_leaf=lambda x: isinstance(x, LossScaleOptState)
        )
    )


class TrainStep:
    """One jitted step ``step(batch) -> StepResult`` with params, optimizer state and loss scale.

    Each call runs one compiled function (the second call with the same shapes does not
    recompile; :attr:`traces` counts tracings): the loss is scaled, gradients are taken,
    unscaled once, checked, optionally clipped, and applied. Rules, as in every unimp backend:

    * clipping acts on the unscaled gradients (``grad_norm`` is the global L2 norm before
      clipping; clipping follows optax.clip_by_global_norm: ``g * max_norm / norm`` when the
      norm exceeds ``max_norm``);
    * a non-finite gradient skips the step and backs the scale off; a non-finite loss
      (forward overflow) skips the step without changing the scale; every loss-scale kind
      skips and counts non-finite steps;
    * a skipped step leaves params and the whole optimizer state bitwise unchanged;
    * with ``grad_accum_steps=k`` each call takes a list of ``k`` micro-batches of one
      structure and shapes (the same call shape in every backend; run with ``lax.scan``
      over them stacked inside the jitted step); the gradient is the mean of the micro-batch
      gradients, accumulated from exact zeros, unscaled once, and the whole window is
      skipped when any micro-batch is non-finite. ``loss`` is the mean micro-batch loss.

    Args:
        mp: the :class:`MixedPrecision`.
        loss_fn: ``loss_fn(params, batch)`` returning a scalar loss.
        optimizer: an optax optimizer (not wrapped with :func:`loss_scaling`: the step scales
            the loss itself).
        params: the initial params; floating leaves are cast to the param dtype.
        grad_accum_steps: micro-batches per optimizer step, >= 1.
        max_grad_norm: clip the global norm of the unscaled gradients to this; ``None`` for no
            clipping (``grad_norm`` is then not computed and reported as ``None``).
        axis_name: data parallelism under ``jax.shard_map``: the mesh axis the batch is split
            over. The step then runs per replica: the loss is ``lax.pmean`` of the local
            losses (so JAX's transpose all-reduces the gradients of replicated params, and
            leaves sharded params' gradients local), the finite flags are reduced over the
            axis (a non-finite gradient on any replica skips the step on all), the global
            norm sums the squares of sharded gradients over the axis, and the loss-scale
            state comes from replica 0 (:func:`sync_loss_scale`: replicas that differ are
            re-synchronized with a :class:`ReplicaDesyncWarning`). Under shard_map's default
            ``check_vma=True`` JAX tracks which values vary over the axis; where it does not
            (``pmap``, ``vmap(axis_name=...)``, ``shard_map(check_vma=False)``) every param is
            taken as replicated and the step averages the gradients with ``lax.pmean``.
        mesh: with ``axis_name``, a ``jax.sharding.Mesh``: calling the step runs
            ``jit(shard_map(...))`` with params, optimizer and loss-scale state replicated and
            the batch split along its first dimension over ``axis_name``. Without ``mesh``,
            call :attr:`replica_step` inside your own ``shard_map`` (sharded params, other
            specs) and do not call the step object itself.
        donate: donate the params, optimizer-state and loss-scale buffers to each call
            (``jax.jit(..., donate_argnums=(0, 1, 2))``), so XLA updates them in place instead
            of holding a second copy in device memory: what flax/optax training loops do on
            GPU and TPU (there it saves one copy of params and optimizer state). Arrays read
            from :attr:`params` / :attr:`opt_state` / :attr:`loss_scale` before a call are
            deleted by that call: copy what you keep (``jax.tree.map(jnp.copy,
            step.params)``); and do not feed them to :attr:`jitted` yourself while still
            stepping through this object (it would hold deleted buffers). The ``params``
            given here are copied once, so the caller's arrays are never donated. Off by
            default; on a CPU it made the benchmark MLP about 9 % slower.

    Raises:
        TypeError: ``loss_fn`` not callable or ``optimizer`` not an optax transformation.
        ValueError: a bad ``grad_accum_steps`` / ``max_grad_norm``, or an optimizer already
            wrapped with :func:`loss_scaling`, ``mesh`` without ``axis_name`` or an
            ``axis_name`` not in ``mesh``.

    Multi-host: call ``jax.distributed.initialize()`` in every process first, build the mesh
    over ``jax.devices()`` (all hosts), and feed each process's part of the global batch
    (``jax.make_array_from_process_local_data``); the step is the same program on every
    host.
    """

    def __init__(
        self,
        mp: MixedPrecision,
        loss_fn: Callable[[Any, Any], Any],
        optimizer: optax.GradientTransformation,
        params: Any,
        *,
        grad_accum_steps: int = 1,
        max_grad_norm: float | None = None,
        axis_name: Any = None,
        mesh: Any = None,
        donate: bool = False,
    ) -> None:
        if not isinstance(donate, bool):
            raise TypeError(f"donate must be True or False, got {donate!r}.")
        if mesh is not None:
            if axis_name is None:
                raise ValueError(
                    "mesh= needs axis_name=: the mesh axis the batch is split over, e.g. "
                    f"axis_name={mesh.axis_names[0]!r}."
                )
            if axis_name not in mesh.axis_names:
                raise ValueError(
                    f"axis_name={axis_name!r} is not an axis of the mesh {tuple(mesh.axis_names)}."
                )
        if not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be callable as loss_fn(params, batch), got {type(loss_fn).__name__}."
            )
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise TypeError(
                f"optimizer must be an optax GradientTransformation (e.g. optax.adam(1e-3)), got {type(optimizer).__name__}."
            )
        grad_accum_steps, max_grad_norm = check_step_options(grad_accum_steps, max_grad_norm)
        # Host leaves (NumPy arrays, Python floats) become device arrays of a fixed dtype now, so
        # the first call's signature equals every later one's and nothing recompiles.
        if mp.device is not None and mesh is not None:
            raise ValueError(
                "device= and mesh= both place the step: bind the recipe without a device "
                "(the mesh says where the replicas run)."
            )
        params = jax.tree_util.tree_map(_device_leaf, mp.cast_to_param(params))
        if mp.device is not None:  # committed there: the rest of the state follows it
            params = jax.device_put(params, mp.device)
        if donate:  # the first call must not delete the caller's own arrays
            params = jax.tree_util.tree_map(jnp.copy, params)
        opt_state = jax.tree_util.tree_map(_device_leaf, optimizer.init(params))
        if donate:  # a state leaf that aliases a param (or another leaf) cannot be donated twice
            opt_state = jax.tree_util.tree_map(jnp.copy, opt_state)
        if _contains_loss_scaling(opt_state):
            raise ValueError(
                "train_step scales the loss itself: pass the plain optax optimizer, not one wrapped "
                "with loss_scaling() or mp.prepare()."
            )
        if _half_second_moments(opt_state):
            # optax keeps its state in the params' dtype; its eps is not readable from outside
            warn_half_optimizer_state("the optax optimizer", _injected_eps(opt_state))
        self._mp = mp
        self._loss_fn = loss_fn
        self._optimizer = optimizer
        self._k = int(grad_accum_steps)
        self._max_norm = max_grad_norm
        # one compilation: committed params (jax.device_put) commit the rest of the state too
        params, opt_state, loss_scale = _commit_like(
            (params, opt_state, mp.init_loss_scale()), params
        )
        self._params = params
        self._opt_state = opt_state
        self._loss_scale = loss_scale
        self._traces = 0
        self._axis = axis_name
        self._mesh = mesh
        self._donate = donate
        donated = (0, 1, 2) if donate else ()
        if mesh is None:
            self._jitted = jax.jit(self._step, donate_argnums=donated)
        else:
            P = jax.sharding.PartitionSpec
            replicated = jax.sharding.NamedSharding(mesh, P())
            self._batch_sharding = jax.sharding.NamedSharding(mesh, P(axis_name))
            self._params, self._opt_state, self._loss_scale = jax.device_put(
                (self._params, self._opt_state, self._loss_scale), replicated
            )
            self._jitted = jax.jit(
                jax.shard_map(
                    self._step,
                    mesh=mesh,
                    in_specs=(P(), P(), P(), P(axis_name)),
                    out_specs=P(),
                ),
                donate_argnums=donated,
            )

    # -- the pure, jitted step ----------------------------------------------------------------

    def _step(self, params: Any, opt_state: Any, ls: LossScale, batch: Any) -> Any:
        self._traces += 1  # runs only while tracing: counts compilations
        k = self._k
        axis = self._axis
        if axis is not None:
            ls = sync_loss_scale(ls, axis)

        def scaled_loss(p: Any, mb: Any) -> Any:
            loss = jnp.asarray(self._loss_fn(p, mb))
            if not jnp.issubdtype(loss.dtype, jnp.floating):
                raise TypeError(f"loss_fn must return a floating loss, got {loss.dtype}.")
            if loss.shape != ():
                raise ValueError(f"loss_fn must return a scalar loss, got shape {loss.shape}.")
            loss = loss.astype(jnp.promote_types(loss.dtype, jnp.float32))
            if axis is not None:
                loss = lax.pmean(loss, axis)  # the global mean loss; its grad is all-reduced
            return ls.scale(loss), loss

        grad_fn = jax.grad(scaled_loss, has_aux=True)
        if k == 1:
            scaled_grads, loss = grad_fn(params, batch)
            loss_finite = jnp.isfinite(loss)
        else:
            # batch is a sequence of k micro-batches of one structure: stacked inside the jit
            micro = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *batch)
            zeros = jax.tree_util.tree_map(
                lambda p: jnp.zeros(
                    jnp.shape(p), jnp.promote_types(jnp.result_type(p), jnp.float32)
                ),
                params,
            )

            def body(acc: Any, mb: Any) -> Any:
                g, micro_loss = grad_fn(params, mb)
                return jax.tree_util.tree_map(
                    lambda a, x: a + x.astype(a.dtype), acc, g
                ), micro_loss

            summed, losses = lax.scan(body, zeros, micro)
            scaled_grads = jax.tree_util.tree_map(lambda a: a / k, summed)
            loss = jnp.mean(losses)
            loss_finite = jnp.all(jnp.isfinite(losses))
        if axis is not None and not _tracks_variance(axis):
            # pmap, vmap, shard_map(check_vma=False): JAX does not all-reduce the gradients of
            # replicated params in the transpose, so average them here (every param is taken
            # as replicated: the pmap convention)
            scaled_grads = lax.pmean(scaled_grads, axis)
        grads = ls.unscale(scaled_grads)
        grads_finite = all_finite(grads, axis)
        grad_norm = None
        if self._max_norm is not None:
            grad_norm = optax.tree.norm(grads) if axis is None else _sharded_norm(grads, axis)
            max_norm = jnp.float32(self._max_norm)
            clip = grad_norm > max_norm
            grads = jax.tree_util.tree_map(
                lambda g: jnp.where(clip, g * (max_norm / grad_norm).astype(g.dtype), g), grads
            )
        updates, new_opt_state = self._optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        applied = grads_finite & loss_finite
        params = _keep_unless(applied, new_params, params)
        opt_state = _keep_unless(applied, new_opt_state, opt_state)
        new_ls = ls.adjust(grads_finite, loss_finite)
        raw = {
            "loss": loss,
            "scale": ls.loss_scale,
            "applied": applied,
            "loss_finite": loss_finite,
            "grads_finite": grads_finite,
            "grad_norm": grad_norm,
            "consecutive_skips": new_ls.consecutive_skips,
            "total_skips": new_ls.total_skips,
        }
        return params, opt_state, new_ls, raw

    # -- the stateful face ----------------------------------------------------------------------

    def _check_batch(self, batch: Any) -> None:
        if self._k == 1:
            return
        k = self._k
        if not isinstance(batch, (list, tuple)) or len(batch) != k:
            got = f"{type(batch).__name__} of length {len(batch)}" if isinstance(batch, (list, tuple)) else type(batch).__name__
            raise ValueError(
                f"with grad_accum_steps={k}, step(batch) takes a list of {k} micro-batches, got {got}."
            )
        first = jax.tree_util.tree_structure(batch[0])
        shapes = [np.shape(x) for x in jax.tree_util.tree_leaves(batch[0])]
        for i, mb in enumerate(batch[1:], 1):
            if jax.tree_util.tree_structure(mb) != first or [np.shape(x) for x in jax.tree_util.tree_leaves(mb)] != shapes:
                raise ValueError(
                    f"micro-batch {i} differs in structure or shapes from micro-batch 0; every "
                    "micro-batch of a window must have the same structure and shapes."
                )

    def __call__(self, batch: Any) -> StepResult:
        """Runs one step on ``batch``; returns its :class:`unimp.StepResult` without syncing.

        With ``mesh``, ``batch`` is the global batch; it is split over the mesh axis along
        its first dimension.

        Raises:
            ValueError: with ``grad_accum_steps=k > 1``, ``batch`` is not a list of ``k``
                micro-batches of one structure and shapes (nothing is changed).
            RuntimeError: built with ``axis_name`` but no ``mesh`` (use :attr:`replica_step`).
        """
        if self._axis is not None and self._mesh is None:
            raise RuntimeError(
                f"this step was built with axis_name={self._axis!r} and no mesh: call "
                "step.replica_step inside your own jax.shard_map, or pass mesh= to train_step."
            )
        self._check_batch(batch)
        if self._mesh is not None:
            batch = jax.device_put(batch, self._batch_sharding)
        elif self._mp.device is not None:
            batch = jax.device_put(batch, self._mp.device)  # a no-op for arrays already there
        elif self._traces == 0:  # first call: a committed batch commits the state (one compilation)
            self._params, self._opt_state, self._loss_scale = _commit_like(
                (self._params, self._opt_state, self._loss_scale), batch
            )
        params, opt_state, ls, raw = self._jitted(
            self._params, self._opt_state, self._loss_scale, batch
        )
        self._params, self._opt_state, self._loss_scale = params, opt_state, ls
        return StepResult(raw, to_host=jax.device_get, config=ls.config)

    @property
    def params(self) -> Any:
        """The current params."""
        return self._params

    @property
    def opt_state(self) -> Any:
        """The current optimizer state."""
        return self._opt_state

    @property
    def loss_scale(self) -> LossScale:
        """The current loss-scale pytree."""
        return self._loss_scale

    @property
    def traces(self) -> int:
        """How many times the step function has been traced (each trace is a compilation)."""
        return self._traces

    @property
    def replica_step(self) -> Callable[..., Any]:
        """The pure, un-jitted step ``(params, opt_state, loss_scale, batch) -> (params,
        opt_state, loss_scale, raw_results)``; with ``axis_name``, the per-replica function to
        run under your own ``jax.shard_map`` (any param sharding). Build the
        :class:`unimp.StepResult` from ``raw_results`` with
        ``StepResult(raw, jax.device_get, loss_scale.config)``."""
        return self._step

    @property
    def jitted(self) -> Callable[..., Any]:
        """The pure jitted function ``(params, opt_state, loss_scale, batch) -> (params,
        opt_state, loss_scale, raw_results)``, for use in your own loop (with ``donate=True``
        it deletes its first three arguments)."""
        return self._jitted

    def state_dict(self) -> dict[str, Any]:
        """The portable loss-scale state (:func:`unimp.loss_scale.state_dict`). Params and
        optimizer state are pytrees: save them with your checkpointer (e.g. orbax)."""
        return self._loss_scale.state_dict()

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Resumes the loss scale from a portable state dict saved by any backend; the saved
        config replaces the recipe's.

        Raises:
            ValueError: a bad or foreign state dict; nothing is changed.
        """
        self._loss_scale = _commit_like(loss_scale_from_state_dict(d), self._params)
