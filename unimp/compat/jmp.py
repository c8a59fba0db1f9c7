"""jmp's public API on unimp's JAX backend: change ``import jmp`` to
``import unimp.compat.jmp as jmp`` and a jmp script runs unchanged.

Names: :class:`Policy`, :func:`get_policy`, :func:`cast_to_full`, :func:`cast_to_half`,
:func:`half_dtype`, :class:`NoOpLossScale`, :class:`StaticLossScale`,
:class:`DynamicLossScale` (``loss_scale, counter, period, factor, min_loss_scale``, jmp's
positional order, with jmp's pytree children ``(loss_scale, counter)``), :func:`all_finite`,
:func:`select_tree`, and the ``LossScale`` union.

Each object behaves as jmp 0.0.4's, tested against jmp itself (``tests/test_compat_jmp.py``):
pytree leaves (none for ``NoOpLossScale`` and ``StaticLossScale``; ``loss_scale`` then
``counter`` for ``DynamicLossScale``, under jmp's key paths), ``StaticLossScale(0)``,
``min_loss_scale=0`` as no floor, jmp's warning for integer scales, jmp's exception classes and
words for a bad predicate, and ``scale`` / ``unscale`` / ``all_finite`` / ``select_tree`` /
``adjust`` results bit for bit, eagerly and under ``jit``. Where jmp 0.0.4 is unsafe, the shim
follows unimp's rule instead; jmp code still runs unchanged:

* The dynamic loss scale is held as a float32 array whatever it is given as: jmp keeps a
  float16 scale, which overflows at 65536 (scaling a loss by ``inf``) and rounds every other
  growth. A Python number or weakly typed array (``jnp.asarray(2.**15)``) is held strongly
  typed too, so a float16 loss scaled before the first ``adjust`` is float32 where jmp's is
  float16 (the same value unless jmp's overflows), and a jitted step compiles once where jmp's
  compiles again after the first step.
* ``min_loss_scale`` survives ``jit``, ``tree_map`` and every other flatten / unflatten: jmp's
  flatten leaves it out and unflatten restores the default 1.0, so a floor of 2**-4 becomes 1
  inside a jitted step. Without a floor (``min_loss_scale <= 0``) the scale stops at float32's
  smallest normal 2**-126, where jmp's goes on to 0 (``1 / scale`` inf: every later step is
  skipped and the scale never grows back); a floor between 0 and 2**-126 is refused.
* ``adjust`` is unimp's reference rule (:func:`unimp.loss_scale.update_arrays`, the
  ``DynamicLossScale.preset("jmp")`` timing: growth on the ``period``-th finite step in a row,
  back-off by ``factor`` floored at ``min_loss_scale``); a growth past float32's range keeps the
  old scale, as jmp. The back-off multiplies by ``1 / factor`` where jmp divides by ``factor``:
  the same for a power-of-two factor (jmp's default 2); otherwise each back-off may differ by
  an ulp, and repeated back-offs by a few. Invalid arguments (``factor <= 1``, ``period < 1``,
  a non-bool flag) are a ``ValueError`` rather than jmp's division by zero or an ``assert``
  that ``python -O`` removes; where jmp asserts, the error is also an ``AssertionError``.
* A ``StaticLossScale`` array is held as a NumPy scalar of its dtype (hashable, so the loss
  scale can be a static argument of ``jit``, where jmp's raises); results are jmp's.
* ``select_tree`` and ``adjust`` also take a Python ``bool``, where jmp's raise
  ``AttributeError``; ``select_tree`` refuses leaves of different dtypes with a ``ValueError``
  naming the leaf, where jmp's ``lax.select`` raises a ``TypeError``.

The counter and scale follow the same sequence as jmp's otherwise (tested step for step).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

from unimp import loss_scale as core
from unimp.backends.jax.casting import cast_tree
from unimp.backends.jax.overflow import all_finite as _all_finite
from unimp.backends.jax.overflow import check_pred
from unimp.backends.jax.overflow import select_tree as _select_tree
from unimp.backends.jax.scaling import STATIC_FIELDS, LossScaleOps, replace_unchecked
from unimp.dtypes import canonical_dtype
from unimp.loss_scale.config import positive_int

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


#: jmp's dtype names (``parse_dtype``); ``"half"`` is :func:`half_dtype`.
_JMP_DTYPES = {
    "full": jnp.float32, "f32": jnp.float32, "float32": jnp.float32,
    "f16": jnp.float16, "float16": jnp.float16,
    "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
    "f64": jnp.float64, "float64": jnp.float64,
}  # fmt: skip
_JMP_KEYS = {"p": "param", "params": "param", "c": "compute", "compute": "compute",
             "o": "output", "output": "output"}


def _jmp_dtype(value: str, name: str) -> Any:
    if value == "half":
        return half_dtype()
    if value not in _JMP_DTYPES:
        raise ValueError(
            f"Unknown dtype {value!r} in {name!r}: jmp takes full, half, float16, bfloat16, "
            f"float32, float64 or their contractions ({', '.join(sorted(_JMP_DTYPES))}); for "
            "unimp's named policies (mixed_bfloat16, ...) use unimp.get_policy."
        )
    return _JMP_DTYPES[value]


def get_policy(policy_name: str) -> Policy:
    """jmp's ``get_policy``, by jmp's grammar (matches jmp 0.0.4): a dtype name (``"bf16"``,
    ``"half"``, ``"full"``) is all three dtypes; ``"p=f32,c=bf16,o=f32"`` (keys ``p`` /
    ``params``, ``c`` / ``compute``, ``o`` / ``output``) sets them, params defaulting to
    float32, compute following params and output following compute (``"c=f16"`` is
    ``p=f32,c=f16,o=f16``). unimp's own policy names are :func:`unimp.get_policy`'s.

    Raises:
        ValueError: an unknown key or dtype, as jmp (naming the accepted ones).
    """
    if isinstance(policy_name, Policy):
        return policy_name
    if not isinstance(policy_name, str):
        raise TypeError(f"get_policy takes a policy string such as 'p=f32,c=bf16', got {policy_name!r}.")
    if "=" not in policy_name:
        dtype = _jmp_dtype(policy_name, policy_name)
        return Policy(dtype, dtype, dtype)
    found: dict[str, Any] = {}
    for part in policy_name.split(","):
        key, _, value = part.partition("=")
        if key not in _JMP_KEYS:
            raise ValueError(
                f"Unknown key {key!r} in {policy_name!r} should be 'params', 'compute' or "
                "'output' (or p, c, o), as jmp's."
            )
        found[_JMP_KEYS[key]] = _jmp_dtype(value, policy_name)
    param = found.get("param", jnp.float32)
    compute = found.get("compute", param)
    return Policy(param, compute, found.get("output", compute))


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
    """Whether every floating element of ``tree`` is finite (no host sync).

    Matches jmp.all_finite: True for an empty tree; integer leaves are finite.

    Args:
        tree: a pytree of arrays (and Python numbers).

    Returns:
        A bool scalar array.

    Example:
        >>> import jax.numpy as jnp
        >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array(jnp.inf)}))
        False
    """
    return _all_finite(tree)


class _NotABoolScalar(ValueError, AssertionError):
    """A predicate that is not a bool scalar where jmp asserts one: an ``AssertionError`` to
    code written for jmp, a ``ValueError`` to unimp's, and raised under ``python -O`` too."""


class _NotABool(ValueError, TypeError):
    """A 0-d flag that is not a bool: a ``TypeError`` to code written for jmp (whose
    ``lax.select`` refuses it), a ``ValueError`` to unimp's."""


def _bool_scalar(pred: Any, where: str, words: str, fix: str, non_bool: type) -> Any:
    """``pred`` as a bool scalar, refused with jmp's exception class and words, and ``fix``."""
    if isinstance(pred, (jax.Array, np.ndarray, np.generic)):
        shape, dtype = jnp.shape(pred), jnp.result_type(pred)
        if shape != () or dtype != jnp.bool_:
            cls = _NotABoolScalar if shape != () else non_bool
            raise cls(f"{where}: {words}, got {dtype}{list(shape)}; {fix}.")
    return check_pred(pred, where)  # a Python bool passes; anything else is a TypeError


def select_tree(pred: Any, a: T, b: T) -> T:
    """``a`` where ``pred`` else ``b``, leaf by leaf (``lax.select``, bitwise).

    Matches jmp.select_tree, and also takes a Python ``bool``.

    Args:
        pred: a bool scalar.
        a, b: pytrees of one structure, with leaves of equal shapes and dtypes.

    Returns:
        A pytree like ``a``.

    Raises:
        AssertionError: ``pred`` is an array but not a bool scalar (jmp's ``assert``, with
            its words "expected boolean scalar"); it is also a ``ValueError``.
        TypeError: ``pred`` is not an array or a bool.
        ValueError: the trees differ in structure, or a leaf in shape or dtype (named).

    Example:
        >>> import jax.numpy as jnp
        >>> select_tree(jnp.array(False), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})["a"].tolist()
        [0.0, 0.0]
    """
    p = _bool_scalar(pred, "select_tree", "expected boolean scalar",
                     "reduce it first, e.g. with all_finite(tree) or jnp.all(x)", _NotABoolScalar)
    return _select_tree(p, a, b)


def _scale_tree(tree: Any, factor: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x * factor, tree)


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """No loss scaling: ``scale`` and ``unscale`` return their input.

    Matches jmp.NoOpLossScale: ``loss_scale`` is 1, and the pytree has no leaves.
    """

    @property
    def loss_scale(self) -> int:
        """1 (a Python int, as jmp)."""
        return 1

    def scale(self, tree: T) -> T:
        """``tree`` itself."""
        return tree

    def unscale(self, tree: T) -> T:
        """``tree`` itself."""
        return tree

    def adjust(self, grads_finite: Any) -> NoOpLossScale:
        """``self`` (``grads_finite`` is not read)."""
        return self


def _static_value(raw: Any) -> Any:
    """A static loss scale as the shim holds it: weakly typed values as Python numbers (so a
    float16 loss stays float16, as jmp's weakly typed scale), an array as a NumPy scalar of
    its dtype (hashable: the loss scale is a pytree's static data)."""
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return raw
    arr = np.asarray(raw)
    if arr.shape != ():
        raise ValueError(
            f"StaticLossScale.loss_scale must be a scalar, got shape {arr.shape}; pass a number "
            "such as 2.0**15."
        )
    return arr.item() if getattr(raw, "weak_type", False) else arr[()]


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """A fixed loss scale.

    Matches jmp.StaticLossScale: ``StaticLossScale(0)`` is accepted, a Python number is kept
    as given (weakly typed: a float16 loss scaled by it stays float16), and the pytree has no
    leaves. An array is held as a NumPy scalar of its dtype (jmp keeps the array, which
    cannot be hashed as a static argument of ``jit``).

    Args:
        loss_scale: 0, or a finite number in [2**-126, float32 max] (any numeric type).

    Raises:
        ValueError: ``loss_scale`` is not a scalar, or is negative, non-finite or outside
            float32's normal range (jmp does not check).

    Example:
        >>> import jax.numpy as jnp
        >>> float(StaticLossScale(128.0).unscale(jnp.float32(256.0)))
        2.0
    """

    loss_scale: Any

    def __post_init__(self) -> None:
        value = _static_value(self.loss_scale)
        if float(value) != 0.0:  # 0 is accepted, as jmp accepts it
            try:
                core.StaticLossScale(float(value))
            except ValueError as e:
                msg = str(e).replace("StaticLossScale.scale", "StaticLossScale.loss_scale")
                raise ValueError(
                    f"{msg} Pass a positive scale such as 2.0**15 (0 is accepted too, as in jmp; "
                    "NoOpLossScale() scales by 1)."
                ) from None
        object.__setattr__(self, "loss_scale", value)

    def scale(self, tree: T) -> T:
        """Every leaf of ``tree`` times ``loss_scale`` (matches jmp.StaticLossScale.scale)."""
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Every leaf of ``tree`` times ``1 / loss_scale``, the reciprocal in the scale's own
        dtype (matches jmp.StaticLossScale.unscale; an array scale of 0 gives inf).

        Raises:
            ZeroDivisionError: ``loss_scale`` is the Python number 0 (as jmp's ``1 / 0``).
        """
        s = self.loss_scale
        if isinstance(s, (int, float)):
            if s == 0:
                raise ZeroDivisionError(
                    "StaticLossScale(0).unscale: a loss scale of 0 has no reciprocal (jmp's "
                    "raises ZeroDivisionError too); use a positive scale, or NoOpLossScale()."
                )
            return _scale_tree(tree, 1 / s)
        dtype = s.dtype if np.issubdtype(s.dtype, np.floating) else np.dtype(np.float32)
        with np.errstate(divide="ignore"):  # jmp's 1 / 0 of an array is inf, silently
            inv = np.divide(dtype.type(1), s.astype(dtype))
        return _scale_tree(tree, inv)

    def adjust(self, grads_finite: Any) -> StaticLossScale:
        """``self`` (``grads_finite`` is not read)."""
        return self


def _empty_pytree(cls: type) -> None:
    jax.tree_util.register_pytree_node(cls, lambda x: ((), x), lambda x, _: x)


_empty_pytree(NoOpLossScale)
_empty_pytree(StaticLossScale)

_F32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126


def _floor(value: Any) -> float:
    """``min_loss_scale`` as a float32-rounded Python float (hashable static data); 0.0 for
    none (jmp's ``maximum`` with a floor <= 0 never binds)."""
    v = np.asarray(value, np.float64)
    if v.shape != ():
        raise ValueError(
            f"DynamicLossScale.min_loss_scale must be a scalar, got shape {v.shape}; pass a "
            "number such as 1.0, or 0 for no floor."
        )
    f = float(np.float32(v))
    if f <= 0.0:
        return 0.0
    if not _F32_TINY <= f < np.inf:
        raise ValueError(
            f"DynamicLossScale.min_loss_scale must be 0 (no floor, as in jmp) or a finite "
            f"float32 >= 2**-126 (a normal float32, so 1 / scale is finite), got {value!r}; "
            "pass 0 for no floor, or a floor such as 1.0."
        )
    return f


def _rule(period: Any, factor: Any, floor: float) -> core.DynamicLossScale:
    """The unimp rule of a jmp loss scale (``DynamicLossScale.preset("jmp", ...)``)."""
    try:
        period = positive_int("DynamicLossScale", "period", period, 1)
    except ValueError as e:
        raise ValueError(
            f"{e} Pass the number of finite steps in a row before the scale grows (jmp's "
            "default is 2000)."
        ) from None
    f = float(factor) if isinstance(factor, (int, float, np.number)) and not isinstance(factor, bool) else None
    if f is None or not 1.0 < f <= 2.0**126:
        raise ValueError(
            f"DynamicLossScale.factor must be a finite number > 1 (at most 2**126, so a back-off "
            f"by it stays a normal float32), got {factor!r}; jmp's default is 2."
        )
    return core.DynamicLossScale.preset(
        "jmp",
        init_scale=max(floor, 1.0),  # not used: the state is the loss scale's own
        growth_interval=period,
        growth_factor=f,
        backoff_factor=1.0 / f,
        min_scale=floor if floor > 0 else None,  # none: stops at 2**-126, where 1 / scale is finite
    )


def _warn_if_not_floating(value: Any, name: str) -> None:
    """jmp's warning, in jmp's words, for a scale whose dtype is not floating; then the fix."""
    dtype = jnp.result_type(value)
    if not jnp.issubdtype(dtype, jnp.floating):
        warnings.warn(
            f"Expected floating type for {name}, got {dtype}; pass a float, e.g. "
            f"{name}=jnp.asarray(value, jnp.float32) (the shim holds it as float32).",
            UserWarning,
            stacklevel=4,
        )


def _register_like_jmp(cls: type) -> type:
    """Registers a frozen dataclass as a pytree, fields read from ``dataclasses.fields``
    (never a hand-written list: jmp lost ``min_loss_scale`` through ``jit`` that way).

    Fields with ``metadata={"static": True}`` are auxiliary data; the others are the children,
    in field order, registered without keys so that their key paths are jmp's
    (``FlattenedIndexKey(0)``, ``FlattenedIndexKey(1)``: what a checkpointer names them by).
    Unflattening bypasses ``__init__``: JAX's placeholder leaves are never converted.
    """
    fields = dataclasses.fields(cls)
    children = tuple(f.name for f in fields if not f.metadata.get("static"))
    aux = tuple(f.name for f in fields if f.metadata.get("static"))

    def flatten(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
        return [getattr(obj, n) for n in children], tuple(getattr(obj, n) for n in aux)

    def unflatten(meta: tuple[Any, ...], leaves: Any) -> Any:
        obj = object.__new__(cls)
        for n, v in (*zip(children, leaves, strict=True), *zip(aux, meta, strict=True)):
            object.__setattr__(obj, n, v)
        return obj

    jax.tree_util.register_pytree_node(cls, flatten, unflatten)
    return cls


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """A dynamic loss scale: grows on the ``period``-th finite step in a row, backs off on a
    non-finite one.

    Matches jmp.DynamicLossScale: the positional order ``(loss_scale, counter, period, factor,
    min_loss_scale)``, the pytree leaves ``loss_scale`` then ``counter`` under jmp's key paths
    (``period``, ``factor`` and, unlike jmp, ``min_loss_scale`` are static data), dataclass
    equality (so no hash, as jmp's), ``min_loss_scale=0`` as no floor, and jmp's warning for
    an integer scale. See the module docstring for where the rule differs.

    Args:
        loss_scale: the scale, a scalar (held as a float32 array, whatever its dtype).
        counter: finite steps in a row since the last change (held as an int32 array).
        period: grow after this many finite steps in a row (an integer >= 1).
        factor: growth and back-off factor (a number in (1, 2**126]).
        min_loss_scale: the floor of the back-off: 0 for none, or a float32 >= 2**-126 (held
            as a float32-rounded Python float, kept through ``jit``).

    Raises:
        ValueError: a bad period, factor or floor (named, with the fix), or a non-scalar state.

    Warns:
        UserWarning: ``loss_scale`` or ``min_loss_scale`` is not floating (jmp's words).

    Example:
        >>> import jax.numpy as jnp
        >>> ls = DynamicLossScale(jnp.float32(2.0**15), period=1)
        >>> float(ls.adjust(jnp.array(True)).loss_scale), float(ls.adjust(jnp.array(False)).loss_scale)
        (65536.0, 16384.0)
    """

    loss_scale: Any
    counter: Any = 0
    period: int = dataclasses.field(default=2000, metadata=STATIC_FIELDS)
    factor: Any = dataclasses.field(default=2, metadata=STATIC_FIELDS)
    min_loss_scale: Any = dataclasses.field(default=1.0, metadata=STATIC_FIELDS)

    def __post_init__(self) -> None:
        floor = _floor(self.min_loss_scale)
        _rule(self.period, self.factor, floor)  # every check before anything is set
        values = {}
        for name, dtype in (("loss_scale", jnp.float32), ("counter", jnp.int32)):
            v = jnp.asarray(getattr(self, name), dtype)
            if jnp.shape(v) != ():
                raise ValueError(
                    f"DynamicLossScale.{name} must be a scalar, got shape {jnp.shape(v)}; pass "
                    f"a 0-d value, e.g. jnp.{dtype.__name__}(...)."
                )
            values[name] = v
        _warn_if_not_floating(self.loss_scale, "loss_scale")
        _warn_if_not_floating(self.min_loss_scale, "min_loss_scale")
        for name, v in values.items():
            object.__setattr__(self, name, v)
        object.__setattr__(self, "min_loss_scale", floor)

    @property
    def config(self) -> core.DynamicLossScale:
        """The unimp rule this loss scale follows (``DynamicLossScale.preset("jmp", ...)``)."""
        return _rule(self.period, self.factor, self.min_loss_scale)

    def scale(self, tree: T) -> T:
        """Every leaf of ``tree`` times the float32 scale (a float16 loss becomes float32)."""
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Every leaf of ``tree`` times ``1 / loss_scale``, the reciprocal in float32 (matches
        jmp.DynamicLossScale.unscale for a float32 scale)."""
        return _scale_tree(tree, jnp.float32(1.0) / self.loss_scale)

    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """The next state: grow on the ``period``-th finite step in a row, back off (floored)
        on a non-finite one.

        Args:
            grads_finite: a bool scalar, e.g. ``all_finite(grads)``.

        Returns:
            A new loss scale (``self`` is unchanged).

        Raises:
            AssertionError: ``grads_finite`` is not 0-d (jmp's ``assert``, its words "Expected
                boolean scalar"); also a ``ValueError``.
            TypeError: ``grads_finite`` is a 0-d non-bool array (jmp's ``lax.select`` refuses
                a float one) or not an array or bool; the former is also a ``ValueError``.
        """
        g = _bool_scalar(grads_finite, "DynamicLossScale.adjust(grads_finite)",
                         "Expected boolean scalar", "pass a bool scalar such as all_finite(grads)",
                         _NotABool)
        zero = jnp.int32(0)
        scale, counter, _, _ = core.update_arrays(
            LossScaleOps, self.config, self.loss_scale, self.counter, zero, zero, g, jnp.array(True)
        )
        return replace_unchecked(self, loss_scale=scale, counter=counter)


# jmp's children (loss_scale, counter) and key paths; the floor travels with period and factor
# as static data, read from the dataclass fields (jmp's hand-written flatten dropped it)
_register_like_jmp(DynamicLossScale)

LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]  # noqa: UP007 (jmp's name)
