"""Loss-scale configs, the state, errors and warnings (see :mod:`unimp.loss_scale`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from unimp.loss_scale.presets import preset_fields

_F32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126, smallest normal float32


_F32_MAX = float(np.finfo(np.float32).max)


_I32_MAX = int(np.iinfo(np.int32).max)


class LossScaleError(RuntimeError):
    """The loss scale is stuck: more consecutive skipped steps than ``max_consecutive_skips``,
    or an overflow asked to lower a scale already at its floor with ``floor_action="raise"``."""


#: The floor actions of :class:`DynamicLossScale` (what an overflow at the floor does).
FLOOR_ACTIONS = ("keep", "warn", "raise")


def _extra(default: Any) -> Any:
    """A state field that only some rules count (:data:`EXTRA_FIELDS`): a backend holds it only
    where the config's rule needs it (:func:`unimp.loss_scale.rule.tracks_extra`)."""
    return dataclasses.field(default=default, metadata={"extra": True})


class LossScaleFloorWarning(UserWarning):
    """An overflow asked to lower a loss scale already at its floor (``floor_action="warn"``):
    the cause is probably not float16 range but a diverging loss."""


class ReplicaDesyncWarning(UserWarning):
    """Data-parallel replicas held different loss-scale states (a checkpoint restored on one
    worker only); every engine re-synchronizes them from replica 0 and warns with this class,
    never silently and never by averaging: torch.distributed and Horovod at the first step after
    the scaler is built or loaded, tf.distribute and JAX inside the compiled step."""


def warn_replica_desync(fix: str, differ: Iterable[str] = (), *, stacklevel: int = 2) -> None:
    """Warns, with :class:`ReplicaDesyncWarning`, that the replicas' loss-scale states differed
    and were re-synchronized from replica 0: the one message every engine gives.

    Args:
        fix: what the user does to avoid it, in the engine's words (e.g. "Load the same
            checkpoint (scaler.load_state_dict) on every rank").
        differ: the fields that differed, as ``"name in [lo, hi]"`` strings, where the engine
            read them on the host (torch.distributed, Horovod); empty where the check runs inside
            a compiled step (tf.distribute, JAX), which cannot say more without a host sync.
        stacklevel: passed to :func:`warnings.warn` (this function's frame is counted).
    """
    import warnings

    detail = f" ({'; '.join(differ)})" if differ else ""
    warnings.warn(
        f"the replicas held different loss-scale states{detail}; re-synchronized every replica "
        f"from replica 0. {fix.rstrip('.')} to avoid this.",
        ReplicaDesyncWarning,
        stacklevel=stacklevel + 1,
    )


def _number(cls: str, field: str, value: Any) -> float:
    """Any real number (Python, NumPy, float16/bfloat16, a 0-d tensor) as a float32-rounded float."""
    if isinstance(value, bool):
        raise ValueError(f"{cls}.{field} must be a number, got a bool ({value!r}).")
    if isinstance(value, (str, bytes)):  # float("65536") would read it: a config holds numbers
        raise ValueError(f"{cls}.{field} must be a number, got the string {value!r}; write it without quotes.")
    try:
        f = float(value)
    except OverflowError:  # an int past float64's range (a JSON 1e400 written as digits)
        raise ValueError(f"{cls}.{field} must be finite, got {_shown(value)}.") from None
    except (TypeError, ValueError):
        raise ValueError(f"{cls}.{field} must be a real number, got {value!r}.") from None
    if not math.isfinite(f):
        raise ValueError(f"{cls}.{field} must be finite, got {value!r}.")
    return float(np.float32(f)) if abs(f) <= _F32_MAX else f


def _shown(value: Any) -> str:
    """``repr(value)``, but an int too long to read as its digit count (an error message
    stays one short line)."""
    if isinstance(value, (int, np.integer)) and not -(10**20) < value < 10**20:
        return f"an integer of {len(str(abs(int(value))))} digits"
    return repr(value)


def positive_int(cls: str, field: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        # a NumPy float counts as a Python float (np.float32(16.0) as 16.0; np.float64 is one)
        if isinstance(value, (float, np.floating)) and float(value).is_integer():
            value = int(value)
        else:
            raise ValueError(f"{cls}.{field} must be an integer >= {minimum}, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{cls}.{field} must be >= {minimum}, got {_shown(value)}.")
    if value > np.iinfo(np.int32).max:
        raise ValueError(f"{cls}.{field} must fit in int32, got {_shown(value)}.")
    return int(value)


#: A scalar of :class:`LossScaleState`: a NumPy scalar on the host, or a framework's 0-d array
#: (a device array, a tracer) that the record holds as given.
Array = Any


def _held_as_given(value: Any) -> bool:
    """A framework's array (it has a shape and a dtype and is not NumPy's): a jax array or
    tracer, which the record keeps as given; reading it on the host would be a sync per step
    (or impossible, under ``jit``)."""
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, (np.ndarray, np.generic))


@dataclass(frozen=True)
class LossScaleState:
    """The loss scaler's state, one record in every backend, generic over arrays.

    Host values (Python and NumPy numbers) are held as NumPy scalars, ``scale`` as
    ``np.float32`` and the counters as ``np.int32``: what the reference rule, the torch and
    TensorFlow scalers' host views and the portable format read. A framework's array (anything
    with a shape and a dtype that is not NumPy's: a jax array, a tracer) is held as given and
    never read on the host: the JAX backend registers this record as a pytree and carries it
    through ``jit`` inside its loss scale.

    Attributes:
        scale: the loss scale used for the next step.
        counter: consecutive finite steps since the last growth or overflow,
            always in ``[0, growth_interval)``.
        consecutive_skips: skipped steps in a row (reset by an applied step).
        total_skips: skipped steps since the start.
        hysteresis_used: overflows absorbed by ``hysteresis`` since it was last
            refilled, in ``[0, hysteresis)`` (DeepSpeed's ``delayed_shift - cur_hysteresis``,
            Megatron's ``hysteresis - _hysteresis_tracker``). 0 unless ``hysteresis > 1``.
        overflows_since_rescale: overflows since the last backoff (fairseq's
            ``_overflows_since_rescale``; a growth does not reset it). 0 unless
            ``overflow_tolerance > 0``.
        steps_since_rescale: steps since the last growth or backoff, this one not
            included (fairseq's ``_iter - _last_rescale_iter - 1``). 0 unless
            ``overflow_tolerance > 0``.
        floor_hits: overflows that asked to lower a scale already at its floor
            (DeepSpeed's "already at minimum", fairseq's FloatingPointError). Counted only with
            ``floor_action`` ``"warn"`` or ``"raise"``, else 0.

    The last four fields (:data:`EXTRA_FIELDS`) are counted only by the rules that need them
    (hysteresis, an overflow tolerance, a floor action); every other rule keeps them at 0.
    """

    scale: Array  # shape=(), dtype=float32
    counter: Array  # shape=(), dtype=int32
    consecutive_skips: Array  # shape=(), dtype=int32
    total_skips: Array  # shape=(), dtype=int32
    hysteresis_used: Array = _extra(0)  # shape=(), dtype=int32
    overflows_since_rescale: Array = _extra(0)  # shape=(), dtype=int32
    steps_since_rescale: Array = _extra(0)  # shape=(), dtype=int32
    floor_hits: Array = _extra(0)  # shape=(), dtype=int32

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if _held_as_given(value):
                continue
            host = np.asarray(value)
            if host.shape != () or host.dtype.kind not in "biuf":
                raise TypeError(
                    f"LossScaleState.{f.name} must be a real scalar (or a framework's array), got "
                    f"{type(value).__name__} {host.dtype} of shape {host.shape}."
                )
            if f.name == "scale":
                object.__setattr__(self, f.name, np.float32(host.item()))
                continue
            number = host.item()
            if (
                host.dtype.kind == "b"
                or not math.isfinite(float(number))
                or float(number) != int(number)
                or not -(2**31) <= int(number) < 2**31
            ):
                raise ValueError(
                    f"LossScaleState.{f.name} must be an integer count in int32's range (5.0 reads "
                    f"as 5), got {value!r}."
                )
            object.__setattr__(self, f.name, np.int32(int(number)))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values: ``scale`` a float, the counters ints (every field; device
        values are read on the host)."""
        return {
            f.name: (float if f.name == "scale" else int)(getattr(self, f.name))
            for f in dataclasses.fields(self)
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LossScaleState:
        """Inverse of :meth:`to_dict`; the :data:`EXTRA_FIELDS`, which only some rules count,
        read as 0 where left out (as a config's fields read as their defaults). Raises
        ``ValueError`` naming a missing or bad key."""
        if not isinstance(d, Mapping):
            raise ValueError(f"loss-scale state must be a dict, got {type(d).__name__}.")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in d and not f.metadata.get("extra")]
        extra = sorted(set(d) - set(names))
        if missing or extra:
            raise ValueError(
                f"loss-scale state: missing keys {missing}, unknown keys {extra}; expected {names}."
            )
        scale = d["scale"]
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
            raise ValueError(f"loss-scale state 'scale' must be a number, got {scale!r}.")
        try:
            f = float(scale)
        except OverflowError:  # an int past float64's range
            f = math.inf
        if not math.isfinite(f) or f <= 0:
            raise ValueError(f"loss-scale state 'scale' must be finite and > 0, got {_shown(scale)}.")
        counts = {}
        for n in [n for n in names[1:] if n in d]:
            v = d[n]
            if isinstance(v, (float, np.floating)) and float(v).is_integer():
                v = int(v)  # the configs' rule for integer fields: 5.0 is 5
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= _I32_MAX:
                raise ValueError(
                    f"loss-scale state {n!r} must be an int in [0, 2**31 - 1], got {_shown(d[n])}."
                )
            counts[n] = v
        return cls(scale=scale, **counts)


#: The fields of :class:`LossScaleState` that only some rules count, in order
#: (``update_arrays``'s ``extra``).
EXTRA_FIELDS = tuple(f.name for f in dataclasses.fields(LossScaleState) if f.metadata.get("extra"))


class _Config:
    """Shared behaviour of the loss-scale configs (framework-free, frozen dataclasses)."""

    kind: ClassVar[str]
    dynamic: ClassVar[bool] = False

    @property
    def enabled(self) -> bool:
        """False for :class:`NoLossScale`: the loss is not multiplied."""
        return True

    @property
    def unity(self) -> bool:
        """True when the scale is always exactly 1 (no scaling, or a static 1.0, as Apex O3):
        unscaling is exact, so float16 gradients are safe."""
        return not self.dynamic and self.initial_scale() == 1.0

    def initial_scale(self) -> float:
        raise NotImplementedError

    def initial_state(self) -> LossScaleState:
        """The state before the first step (counters zero, the initial scale as float32)."""
        return LossScaleState(np.float32(self.initial_scale()), 0, 0, 0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: ``{"kind": ..., <every dataclass field>}``."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            out[f.name] = getattr(self, f.name)
        return out


@dataclass(frozen=True)
class NoLossScale(_Config):
    """No loss scaling: the scale is 1.0 and never changes.

    Non-finite steps are still skipped and counted.
    """

    kind: ClassVar[str] = "none"

    @property
    def enabled(self) -> bool:
        return False

    def initial_scale(self) -> float:
        return 1.0


@dataclass(frozen=True)
class StaticLossScale(_Config):
    """A fixed loss scale (Apex ``loss_scale=128.0``, jmp ``StaticLossScale``).

    Args:
        scale: the loss scale, a finite number > 0 (any numeric type; stored as float32).

    Raises:
        ValueError: ``scale`` is not a finite positive number.
    """

    scale: float = 1.0
    kind: ClassVar[str] = "static"

    def __post_init__(self) -> None:
        s = _number("StaticLossScale", "scale", self.scale)
        if not _F32_TINY <= s <= _F32_MAX:
            raise ValueError(
                f"StaticLossScale.scale must be in [2**-126, float32 max] (a normal float32, so "
                f"1/scale is finite), got {self.scale!r}."
            )
        object.__setattr__(self, "scale", s)

    def initial_scale(self) -> float:
        return self.scale


@dataclass(frozen=True)
class DynamicLossScale(_Config):
    """A dynamic loss scale: backs off on overflow, grows after a run of finite steps.

    Args:
        init_scale: the first scale; any real number (Python int, float16 or bfloat16 value);
            the state is float32.
        growth_factor: > 1; the scale is multiplied by it after ``growth_interval``
            consecutive finite steps.
        backoff_factor: in [2**-126, 1); the scale is multiplied by it on overflow.
        growth_interval: >= 1, consecutive finite steps before the scale grows.
        min_scale: floor of the scale, > 0; ``None`` floors at the smallest normal float32
            (2**-126) so ``1/scale`` stays finite.
        max_scale: cap of the scale; ``None`` means no cap (growth still never makes it inf).
        max_consecutive_skips: ``None``, or N >= 1: more than N skipped steps in a row raise
            :class:`LossScaleError` when the state is checked.
        hysteresis: int >= 1, overflows it takes to back off once (DeepSpeed's and Megatron's
            ``hysteresis``): the first ``hysteresis - 1`` overflows only reset the growth count;
            once used up, every overflow backs off until the hysteresis is refilled. 1 (default)
            backs off on every overflow.
        consecutive_hysteresis: refill the hysteresis on every clean step (DeepSpeed's
            ``consecutive_hysteresis``) instead of only when the scale grows (default, as
            DeepSpeed and Megatron).
        overflow_tolerance: in [0, 1), fairseq's ``fp16_scale_tolerance``: an overflow backs
            off only when the overflows since the last backoff, divided by the steps since the
            last growth or backoff (this one included), reach it (compared in float32). 0
            (default) backs off on every overflow.
        floor_action: what an overflow that would lower a scale already at its floor does:
            ``"keep"`` (default) keeps the scale at the floor and goes on; ``"warn"`` also
            warns (:class:`LossScaleFloorWarning`) and ``"raise"`` raises
            :class:`LossScaleError`, both where the host reads the state (a step's result,
            ``get_scale``), never with a sync per step; the step is counted in
            ``LossScaleState.floor_hits``.
        delayed_first_growth: the first growth after the start or an overflow comes on the
            ``growth_interval + 1``-th clean step, later ones every ``growth_interval`` clean
            steps (DeepSpeed >= 0.17.1). False (default): on the ``growth_interval``-th.

    Raises:
        ValueError: naming the field, for growth_factor <= 1, backoff_factor outside (0, 1),
            growth_interval < 1, min_scale above max_scale, init_scale outside
            [min_scale, max_scale], a non-finite number, hysteresis < 1, overflow_tolerance
            outside [0, 1), or an unknown floor_action.

    Example:
        >>> from unimp.loss_scale import update
        >>> cfg = DynamicLossScale(init_scale=2**15, growth_interval=1)
        >>> float(update(cfg, cfg.initial_state(), grads_finite=True).scale)
        65536.0
    """

    init_scale: float = 2.0**15
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float | None = 1.0
    max_scale: float | None = 2.0**24
    max_consecutive_skips: int | None = None
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    overflow_tolerance: float = 0.0
    floor_action: str = "keep"
    delayed_first_growth: bool = False
    kind: ClassVar[str] = "dynamic"
    dynamic: ClassVar[bool] = True

    def __post_init__(self) -> None:
        c = "DynamicLossScale"
        init = _number(c, "init_scale", self.init_scale)
        growth = _number(c, "growth_factor", self.growth_factor)
        backoff = _number(c, "backoff_factor", self.backoff_factor)
        interval = positive_int(c, "growth_interval", self.growth_interval, 1)
        lo = None if self.min_scale is None else _number(c, "min_scale", self.min_scale)
        hi = None if self.max_scale is None else _number(c, "max_scale", self.max_scale)
        if not growth > 1:
            raise ValueError(f"{c}.growth_factor must be > 1, got {self.growth_factor!r}.")
        if not 0 < backoff < 1:
            raise ValueError(f"{c}.backoff_factor must be in (0, 1), got {self.backoff_factor!r}.")
        if backoff < _F32_TINY:
            # TensorFlow and XLA flush float32 subnormals to zero: such a factor would back off
            # to the floor there and to scale * factor in NumPy and torch
            raise ValueError(
                f"{c}.backoff_factor must be >= 2**-126 (a normal float32: TensorFlow and XLA "
                f"flush subnormals to zero), got {self.backoff_factor!r}."
            )
        if lo is not None and not lo >= _F32_TINY:
            raise ValueError(
                f"{c}.min_scale must be >= 2**-126 (a normal float32, so 1/scale is finite) or None, "
                f"got {self.min_scale!r}."
            )
        if hi is not None and (not hi > 0 or hi > _F32_MAX):
            raise ValueError(
                f"{c}.max_scale must be in (0, float32 max] or None, got {self.max_scale!r}."
            )
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"{c}.min_scale ({lo}) must not be above max_scale ({hi}).")
        floor = _F32_TINY if lo is None else lo
        if not floor <= init <= (hi if hi is not None else _F32_MAX):
            raise ValueError(
                f"{c}.init_scale must be in [min_scale, max_scale] = [{floor}, {hi}], got {self.init_scale!r}."
            )
        skips = self.max_consecutive_skips
        if skips is not None:
            skips = positive_int(c, "max_consecutive_skips", skips, 1)
        hysteresis = positive_int(c, "hysteresis", self.hysteresis, 1)
        tolerance = _number(c, "overflow_tolerance", self.overflow_tolerance)
        if not 0 <= tolerance < 1:
            raise ValueError(
                f"{c}.overflow_tolerance must be in [0, 1) (a fraction of the steps since the last "
                f"rescale), got {self.overflow_tolerance!r}."
            )
        if self.floor_action not in FLOOR_ACTIONS:
            raise ValueError(
                f"{c}.floor_action must be one of {', '.join(map(repr, FLOOR_ACTIONS))}, got "
                f"{self.floor_action!r}."
            )
        for name in ("consecutive_hysteresis", "delayed_first_growth"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{c}.{name} must be a bool, got {getattr(self, name)!r}.")
        if self.delayed_first_growth and interval == _I32_MAX:
            # the int32 counter counts to growth_interval + 1 before the first growth
            raise ValueError(
                f"{c}.growth_interval must be < 2**31 - 1 with delayed_first_growth=True (the "
                f"int32 growth counter reaches growth_interval + 1), got {self.growth_interval!r}."
            )
        for name, value in (
            ("init_scale", init),
            ("growth_factor", growth),
            ("backoff_factor", backoff),
            ("growth_interval", interval),
            ("min_scale", lo),
            ("max_scale", hi),
            ("max_consecutive_skips", skips),
            ("hysteresis", hysteresis),
            ("consecutive_hysteresis", bool(self.consecutive_hysteresis)),
            ("overflow_tolerance", tolerance),
            ("delayed_first_growth", bool(self.delayed_first_growth)),
        ):
            object.__setattr__(self, name, value)

    def initial_scale(self) -> float:
        return self.init_scale

    @property
    def floor(self) -> float:
        """The effective floor: ``min_scale``, or 2**-126 when it is ``None``."""
        return _F32_TINY if self.min_scale is None else self.min_scale

    @property
    def growth_at(self) -> int:
        """The counter value that grows the scale: ``growth_interval``, plus 1 with
        ``delayed_first_growth`` (the counter then restarts at 1 after a growth)."""
        return self.growth_interval + int(self.delayed_first_growth)

    def replace(self, **changes: Any) -> DynamicLossScale:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> DynamicLossScale:
        """Each framework's or trainer's own dynamic loss-scale defaults and rules: ``torch``,
        ``keras``, ``tf_keras``, ``jmp``, ``flax``, ``apex``, ``deepspeed``, ``megatron``,
        ``fairseq``. The table, and the source each preset was read from, is in
        :mod:`unimp.loss_scale.presets`.

        Args:
            name: a preset name (case, ``-`` and ``.`` are ignored; ``tf.keras``, ``pytorch``
                are aliases).
            **overrides: fields to change, e.g. ``growth_interval=100``.

        Raises:
            ValueError: unknown preset name (the message lists them), or a bad override.

        Example:
            >>> DynamicLossScale.preset("megatron").hysteresis
            2
        """
        return cls(**preset_fields(name, overrides, [f.name for f in dataclasses.fields(cls)]))


LossScaleConfig = NoLossScale | StaticLossScale | DynamicLossScale


_KINDS: dict[str, type] = {
    "none": NoLossScale,
    "static": StaticLossScale,
    "dynamic": DynamicLossScale,
}


def loss_scale_from_dict(d: Mapping[str, Any] | str | float | None) -> LossScaleConfig:
    """Builds a config from ``to_dict()`` output, ``"dynamic"``, ``"none"``, ``"preset:<name>"``,
    or a number (static; also as a string, ``"1024"`` or the CLI's ``"static:1024"``).

    Raises:
        ValueError: unknown ``kind`` or field, naming it and listing the valid ones.
    """
    if d is None:
        return NoLossScale()
    if isinstance(d, _Config):
        return d  # type: ignore[return-value]
    if isinstance(d, str):
        key = d.strip().lower()
        if key in ("none", "no", "off", "disabled"):
            return NoLossScale()
        if key == "dynamic":
            return DynamicLossScale()
        if key.startswith("preset:"):
            return DynamicLossScale.preset(key[len("preset:") :])
        number = key[len("static:"):] if key.startswith("static:") else key  # the CLI's spelling
        try:
            value = float(number)
        except ValueError:
            raise ValueError(
                f"unknown loss scale {d!r}; use 'none', 'dynamic', 'preset:<name>', a number "
                "('static:<number>' too), or a dict."
            ) from None
        return StaticLossScale(value)
    if isinstance(d, (int, float, np.number)) and not isinstance(d, bool):
        return StaticLossScale(d)
    if not isinstance(d, Mapping):
        raise ValueError(f"loss scale must be a dict, a name or a number, got {type(d).__name__}.")
    kind = d.get("kind")
    if not isinstance(kind, str) or kind not in _KINDS:
        hint = (
            f"; a trainer's preset is written as the string 'preset:{d['preset']}' (or saved "
            "with DynamicLossScale.preset(...).to_dict())"
            if "preset" in d and kind is None else ""
        )
        raise ValueError(f"loss scale 'kind' must be one of {sorted(_KINDS)}, got {kind!r}{hint}.")
    cls = _KINDS[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names - {"kind"})
    if unknown:
        raise ValueError(
            f"unknown key(s) {unknown} for loss scale kind {kind!r}; valid keys: {sorted(names)}."
        )
    return cls(**{k: v for k, v in d.items() if k != "kind"})
