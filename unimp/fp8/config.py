"""FP8 formats, the per-tensor scaling configs (:class:`DelayedScaling`, :class:`CurrentScaling`),
their presets, and the per-tensor state (:class:`FP8State`)."""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

# one rule for integer fields in every config: an int, or a float with an integral value (16.0,
# as JSON from some tools writes it), within int32
from unimp.loss_scale.config import positive_int

#: Largest finite value of each float8 dtype (ml_dtypes / torch.finfo / TE ``fp8_dtype_max``).
FP8_MAX: dict[str, float] = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}

#: Transformer Engine's format names: the float8 dtype of the forward tensors (inputs, weights)
#: and of the backward ones (output gradients). ``HYBRID`` is TE's default and what Keras and
#: flax always use. TE refuses pure E5M2 training, and so does unimp.
FORMATS: dict[str, tuple[str, str]] = {
    "HYBRID": ("float8_e4m3fn", "float8_e5m2"),
    "E4M3": ("float8_e4m3fn", "float8_e4m3fn"),
}

#: The two roles a quantized tensor plays: forward (inputs, weights) or backward (gradients).
ROLES = ("forward", "backward")

_F32_MAX = float(np.finfo(np.float32).max)

#: unimp's own rules cap the scale at 2**126 (TE: float32 max) so that ``scale_inv`` stays a
#: normal float32: TensorFlow flushes subnormals to zero on CPU, which would break bit-identity.
MAX_SCALE = 2.0**126
#: How far ``scale * scale_inv`` may be from 1 in a loaded state: the reciprocal rounds once
#: (half an ulp) and Keras / flax's double reciprocal drifts by one ulp more (2**-23 each).
_INVERSE_TOLERANCE = 2.0**-21


def _choice(cls: str, field: str, value: Any, valid: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in valid:
        return value
    close = difflib.get_close_matches(str(value), valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"{cls}.{field} must be one of {list(valid)}, got {value!r}.{hint}")


def _preset_fields(cls: type, name: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``{"rule": name, **overrides}`` once every override is a field the preset leaves open
    (any dataclass field but ``rule``, which the preset's name chooses)."""
    valid = [f.name for f in dataclasses.fields(cls) if f.name != "rule"]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(
            f"{cls.__name__}.preset({name!r}): cannot set {unknown}; the fields a preset takes "
            f"are {valid} (the rule is the preset's name"
            + ("; a current-scaling config keeps no history" if "amax_history_len" in unknown and
               "amax_history_len" not in valid else "") + ")."
        )
    return {"rule": name, **overrides}


class _Fp8Config:
    """What the two configs share: the format, the dtypes per role, ``to_dict``/``from_dict``."""

    kind: ClassVar[str]
    RULES: ClassVar[tuple[str, ...]]
    fp8_format: str
    rule: str

    def dtype(self, role: str) -> str:
        """The float8 dtype (``"float8_e4m3fn"`` or ``"float8_e5m2"``) of a tensor role.

        Raises:
            ValueError: ``role`` is not ``"forward"`` or ``"backward"``.
        """
        fwd, bwd = FORMATS[self.fp8_format]
        return fwd if _choice(type(self).__name__, "role", role, ROLES) == "forward" else bwd

    def fp8_max(self, role: str) -> float:
        """The largest finite value of :meth:`dtype` (448.0 or 57344.0)."""
        return FP8_MAX[self.dtype(role)]

    def to_dict(self) -> dict[str, Any]:
        """``{"kind": ..., <every dataclass field>}``, JSON-able; :func:`fp8_from_dict` inverts it."""
        return {"kind": self.kind, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}


@dataclass(frozen=True)
class DelayedScaling(_Fp8Config):
    """Delayed per-tensor scaling: the scale comes from a window of past absolute maxima.

    Each quantized tensor keeps the last ``amax_history_len`` absolute maxima (its amax
    history); the scale used at step t is ``fp8_max / amax / 2**margin`` where ``amax`` is the
    window's max (``amax_compute_algo="max"``) or the newest entry (``"most_recent"``). The
    scale multiplies (``q = float8(clip(x * scale))``, ``x ~= q * scale_inv``).

    ``rule`` chooses whose timing and edge cases are followed (see :mod:`unimp.fp8`):
    ``"unimp"`` (default): the scale used at step t comes from steps t-L .. t-1; a window amax
    of 0, inf or NaN keeps the previous scale; a scale that overflows float32 becomes float32
    max. ``"transformer_engine"``, ``"keras"``, ``"flax"``: that implementation exactly
    (use :meth:`preset`).

    Args:
        margin: int in [0, 127], the scale is divided by ``2**margin`` (headroom).
        amax_history_len: int >= 1, window length L (TE, Keras and flax default 1024).
        amax_compute_algo: ``"max"`` or ``"most_recent"`` (TE's names).
        fp8_format: ``"HYBRID"`` (e4m3 forward, e5m2 gradients; default) or ``"E4M3"``.
        rule: ``"unimp"``, ``"transformer_engine"``, ``"keras"`` or ``"flax"``.

    Raises:
        ValueError: an unknown format, algorithm or rule, a history length < 1 or a margin
            outside [0, 127] (the message names the field and its valid values); Keras and flax only
            implement ``amax_compute_algo="max"`` and ``margin=0`` (flax) / any margin (Keras
            takes one in ``compute_float8_scale``).

    Example:
        >>> DelayedScaling(amax_history_len=16).dtype("backward")
        'float8_e5m2'
    """

    kind: ClassVar[str] = "delayed"
    RULES: ClassVar[tuple[str, ...]] = ("unimp", "transformer_engine", "keras", "flax")
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    fp8_format: str = "HYBRID"
    rule: str = "unimp"

    def __post_init__(self) -> None:
        c = "DelayedScaling"
        object.__setattr__(self, "margin", positive_int(c, "margin", self.margin, 0))
        if self.margin > 127:
            # 2**margin must be a finite float32: past it every rule's scale is 0 (scale_inv
            # inf), and Python's 2.0**1024 raises OverflowError inside the Keras/flax rule
            raise ValueError(
                f"DelayedScaling.margin must be <= 127 (2**margin a finite float32; a larger "
                f"margin makes every scale 0), got {self.margin!r}."
            )
        object.__setattr__(
            self, "amax_history_len", positive_int(c, "amax_history_len", self.amax_history_len, 1)
        )
        _choice(c, "amax_compute_algo", self.amax_compute_algo, ("max", "most_recent"))
        _choice(c, "fp8_format", self.fp8_format, tuple(FORMATS))
        _choice(c, "rule", self.rule, self.RULES)
        if self.rule in ("keras", "flax") and self.amax_compute_algo != "max":
            raise ValueError(
                f"DelayedScaling.amax_compute_algo must be 'max' with rule={self.rule!r} "
                f"({self.rule} always takes the window's max), got {self.amax_compute_algo!r}."
            )
        if self.rule == "flax" and self.margin != 0:
            raise ValueError(
                "DelayedScaling.margin must be 0 with rule='flax' (flax's update_fp8_meta calls "
                f"compute_scale without a margin), got {self.margin!r}."
            )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> DelayedScaling:
        """The rule of an implementation, with its defaults (overridable by keyword).

        ``"transformer_engine"`` (TE ``recipe.DelayedScaling`` defaults: margin 0, L 1024,
        ``"max"``, HYBRID), ``"keras"`` (``QuantizedFloat8DTypePolicy``: L 1024), ``"flax"``
        (``Fp8DotGeneralBase``: L 1024), ``"unimp"``.

        Raises:
            ValueError: an unknown name (the valid names are listed), or an override that is not
                a field the preset leaves open (``rule`` is the name's).
        """
        _choice("DelayedScaling.preset", "name", name, cls.RULES)
        return cls(**_preset_fields(cls, name, overrides))


@dataclass(frozen=True)
class CurrentScaling(_Fp8Config):
    """Current (just-in-time) per-tensor scaling: the scale comes from this step's own amax.

    ``scale = fp8_max / amax(x)`` in float32, computed before ``x`` is quantized (one extra
    reduction per tensor, no history). ``rule``: ``"unimp"`` (Transformer Engine's
    ``Float8CurrentScaling`` on float32 inputs: amax 0, inf or NaN gives scale 1; power-of-two
    scales truncate the mantissa bits; but the scale is capped at 2**126 where TE caps at
    float32 max), ``"transformer_engine"``, ``"torchao"`` (``amax_to_scale``: amax clamped to 1e-12,
    so amax 0 gives 4.48e14, inf gives 0, NaN gives NaN; power-of-two scales are
    ``exp2(floor(log2(scale)))``).

    Args:
        fp8_format: ``"HYBRID"`` (default) or ``"E4M3"``.
        power_of_2_scales: round each scale down to a power of two (TE's ``power_2_scale``,
            torchao's ``round_scales_to_power_of_2``).
        rule: ``"unimp"``, ``"transformer_engine"`` or ``"torchao"``.

    Raises:
        ValueError: an unknown format or rule, a non-bool ``power_of_2_scales``.
    """

    kind: ClassVar[str] = "current"
    RULES: ClassVar[tuple[str, ...]] = ("unimp", "transformer_engine", "torchao")
    fp8_format: str = "HYBRID"
    power_of_2_scales: bool = False
    rule: str = "unimp"
    amax_history_len: ClassVar[int] = 1  # the state keeps the last amax, for reports

    def __post_init__(self) -> None:
        c = "CurrentScaling"
        _choice(c, "fp8_format", self.fp8_format, tuple(FORMATS))
        _choice(c, "rule", self.rule, self.RULES)
        if not isinstance(self.power_of_2_scales, (bool, np.bool_)):
            raise ValueError(
                f"CurrentScaling.power_of_2_scales must be True or False, got "
                f"{self.power_of_2_scales!r}."
            )
        object.__setattr__(self, "power_of_2_scales", bool(self.power_of_2_scales))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> CurrentScaling:
        """``"transformer_engine"`` (``Float8CurrentScaling``: HYBRID, no power-of-two scales
        unless ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1``), ``"torchao"``
        (``Float8LinearConfig`` tensorwise: e4m3 forward, e5m2 gradients, no power-of-two
        scales), ``"unimp"``.

        Raises:
            ValueError: an unknown name (the valid names are listed), or an override that is not
                a field the preset leaves open (``rule`` is the name's).
        """
        _choice("CurrentScaling.preset", "name", name, cls.RULES)
        return cls(**_preset_fields(cls, name, overrides))


FP8Config = DelayedScaling | CurrentScaling

#: Every preset, by the name :func:`fp8_preset` takes.
PRESETS: dict[str, tuple[type, str]] = {
    "keras": (DelayedScaling, "keras"),
    "flax": (DelayedScaling, "flax"),
    "transformer_engine": (DelayedScaling, "transformer_engine"),
    "transformer_engine_current": (CurrentScaling, "transformer_engine"),
    "torchao": (CurrentScaling, "torchao"),
    "unimp_delayed": (DelayedScaling, "unimp"),
    "unimp_current": (CurrentScaling, "unimp"),
}


def fp8_preset(name: str, **overrides: Any) -> FP8Config:
    """The config reproducing one implementation: a name of :data:`PRESETS`.

    Raises:
        ValueError: an unknown name (the valid names and the closest match are listed).

    Example:
        >>> fp8_preset("keras").amax_history_len
        1024
    """
    cls, rule = PRESETS[_choice("fp8_preset", "name", name, tuple(PRESETS))]
    return cls.preset(rule, **overrides)


def fp8_from_dict(d: Mapping[str, Any]) -> FP8Config:
    """Inverse of ``config.to_dict()``.

    Raises:
        ValueError: not a dict, an unknown ``kind`` or field (named), or a bad value.
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"an FP8 config must be a dict, got {type(d).__name__}.")
    kinds = {"delayed": DelayedScaling, "current": CurrentScaling}
    cls = kinds[_choice("FP8 config", "kind", d.get("kind"), tuple(kinds))]
    names = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(d) - names - {"kind"})
    if extra:
        raise ValueError(f"unknown key(s) {extra} in an FP8 {cls.__name__} config; expected {sorted(names)}.")
    return cls(**{k: v for k, v in d.items() if k != "kind"})


@dataclass(frozen=True)
class FP8State:
    """The scaling state of one quantized tensor (NumPy float32; backends hold their own tensors).

    Attributes:
        scale: float32 0-d, the multiplier the next step quantizes with (TE's ``scale``).
        scale_inv: float32 0-d, the dequantization factor: ``float32(1 / scale)`` rounded once,
            except under the Keras and flax rules, whose stored divisor it is exactly (their
            scale is then ``float32(1 / scale_inv)``).
        amax_history: float32 ``(L,)``, the absolute maxima of the last L steps, newest first
            (index 0); zeros before a step has run. :class:`CurrentScaling` keeps ``L = 1``.
    """

    scale: Any
    scale_inv: Any
    amax_history: Any

    @classmethod
    def initial(cls, config: FP8Config) -> FP8State:
        """Scale 1, history of zeros (every implementation starts there)."""
        one = np.float32(1.0)
        return cls(one, one, np.zeros(config.amax_history_len, np.float32))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values, one key per dataclass field: floats and a list of floats
        (``inf`` / ``nan`` as Python floats, which :mod:`json` writes as ``Infinity``/``NaN``)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = np.asarray(getattr(self, f.name), np.float32)
            out[f.name] = [float(x) for x in v.reshape(-1)] if v.ndim else float(v)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], config: FP8Config | None = None) -> FP8State:
        """Inverse of :meth:`to_dict`; checks the history length against ``config``.

        Raises:
            ValueError: a missing or unknown key, or a bad value (see :func:`check_state`).
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"an FP8 tensor state must be a dict, got {type(d).__name__}.")
        return check_state(cls.coerce(d, "FP8State.from_dict"), config)

    @classmethod
    def coerce(cls, state: Any, where: str) -> FP8State:
        """``state`` as an :class:`FP8State`: one already, or its :meth:`to_dict` (read by
        :meth:`from_dict`'s key rule; the values are checked by :func:`check_state`), the
        argument every backend's ``load_fp8_state`` takes.

        Raises:
            TypeError: anything else, naming ``where``, FP8State and :meth:`from_dict`.
            ValueError: a dict with missing or unknown keys.
        """
        if isinstance(state, cls):
            return state
        if isinstance(state, Mapping):
            names = [f.name for f in dataclasses.fields(cls)]
            missing = [n for n in names if n not in state]
            extra = sorted(set(state) - set(names))
            if missing or extra:
                raise ValueError(f"{where}: FP8 tensor state keys must be {names}; missing {missing}, "
                                 f"unknown {extra}.")
            return cls(*(state[n] for n in names))
        raise TypeError(f"{where}: state must be a unimp.fp8.FP8State or its to_dict() (read by "
                        f"FP8State.from_dict), got {type(state).__name__} {state!r}.")


#: The quantized tensors of one float8 matmul layer, in every backend: its input, its kernel and
#: the gradient of its output (TE's forward / backward tensors of a Linear).
LAYER_TENSORS = ("input", "kernel", "grad")


def check_tensor(name: Any, where: str) -> str:
    """``name`` if it is one of :data:`LAYER_TENSORS`.

    Raises:
        ValueError: another name; the message names ``where`` and the valid names.
    """
    if name not in LAYER_TENSORS:
        raise ValueError(f"{where}: name must be one of {list(LAYER_TENSORS)}, got {name!r}.")
    return name


def check_state(state: FP8State | Mapping[str, Any], config: FP8Config | None = None,
                tensor: str = "") -> FP8State:
    """``state`` as NumPy float32, checked before anything is loaded from it (the one check
    of :meth:`FP8State.from_dict` and every backend's ``load_fp8_state``).

    Args:
        state: an :class:`FP8State` (or its ``to_dict()``, :meth:`FP8State.coerce`) of numbers,
            NumPy arrays or host tensors.
        config: when given, the history must have its ``amax_history_len`` entries.
        tensor: a name for the messages (e.g. ``"input"``).

    Raises:
        TypeError: ``state`` neither an FP8State nor a dict (:meth:`FP8State.coerce`).
        ValueError: a dict with other keys; a value that is not real numbers (bools and
            strings included); a ``(scale, scale_inv)`` pair the config's preset (``config``; None: ``unimp_delayed``)
            cannot produce, the message naming the preset: its update stores
            ``scale_inv = float32(1 / scale)`` (Keras / flax: ``scale = float32(1 / scale_inv)``),
            so the pair must be finite numbers > 0 whose product is 1 within 2**-21 (the
            reciprocal's rounding plus Keras / flax's one-ulp drift; plus 2**-149 * scale, the
            rounding step of a subnormal ``scale_inv``), with a scale at most 2**126 under
            unimp's own rule (the presets reproduce their implementations, uncapped);
            ``keras`` and ``flax`` also make ``(inf, 0)`` (an amax so small that fmax / amax
            overflows), ``torchao`` ``(0, inf)`` (an inf amax) and ``(nan, nan)`` (a NaN
            amax), and nothing else non-finite; a history that is not a list of ``amax_history_len``
            maxima, or holds a negative one.
    """
    where = f"FP8 tensor state{f' {tensor!r}' if tensor else ''}"
    state = FP8State.coerce(state, where)
    vals = {}
    for f in dataclasses.fields(FP8State):
        v = getattr(state, f.name)
        try:
            a = np.asarray(v)
        except (TypeError, ValueError, RuntimeError):
            a = np.asarray(None)
        if a.dtype.kind not in "iuf":
            raise ValueError(f"{where} {f.name!r} must be real numbers, got {v!r}.")
        vals[f.name] = a.astype(np.float32)
    rule = _rule_name(config)
    for n in ("scale", "scale_inv"):
        if vals[n].ndim != 0:
            raise ValueError(
                f"{where} {n!r} must be one finite number > 0 (a scalar), got {getattr(state, n)!r}; save it with "
                "unimp.fp8.state_dict (or the layer's fp8_state)."
            )
    scale, inv = float(vals["scale"]), float(vals["scale_inv"])
    if rule == "torchao" and (math.isnan(scale) or (scale == 0 and not math.copysign(1, scale) < 0)):
        # torchao's amax_to_scale: an inf amax gives scale +0 (scale_inv +inf), a NaN amax
        # scale NaN (scale_inv NaN); the only non-finite pairs its update makes
        want = math.inf if scale == 0 else math.nan
        if not (inv == want or (math.isnan(want) and math.isnan(inv))):
            raise ValueError(
                f"{where} 'scale_inv' must be 1 / scale ({want!r}) with scale {scale!r}, got "
                f"{inv!r}: under the 'torchao' preset the only non-finite states are (0, inf) and "
                "(nan, nan); save it with unimp.fp8.state_dict (or the layer's fp8_state)."
            )
        return FP8State(vals["scale"], vals["scale_inv"], _history(vals, config, where))
    if rule in ("keras", "flax") and scale == math.inf and inv == 0:
        # Keras's and flax's update: an amax so small that fmax / amax overflows float32 gives a
        # scale of inf, stored as the double reciprocal (inf, 0); the next finite amax recovers
        return FP8State(vals["scale"], vals["scale_inv"], _history(vals, config, where))
    for n, v in (("scale", scale), ("scale_inv", inv)):
        if not (math.isfinite(v) and v > 0):
            extra = (" (or the pairs (0, inf) and (nan, nan), which an inf / NaN amax gives)"
                     if rule == "torchao" else "")
            raise ValueError(
                f"{where} {n!r} must be one finite number > 0{extra} under the {rule!r} preset, got "
                f"{getattr(state, n)!r}; save it with unimp.fp8.state_dict (or the layer's fp8_state)."
            )
    # unimp's own rule caps the scale at 2**126; the presets reproduce theirs, uncapped
    capped = rule in ("unimp_delayed", "unimp_current")
    if capped and scale > MAX_SCALE:
        raise ValueError(
            f"{where} 'scale' is {scale!r}, above 2**126, the largest scale the {rule!r} preset "
            "loads (its reciprocal would be subnormal, which TensorFlow flushes to zero); save it "
            "with unimp.fp8.state_dict, or give the transformer_engine config it was saved with."
        )
    # every preset's update stores scale_inv = float32(1 / scale) (Keras / flax: scale =
    # float32(1 / scale_inv)); no skip for a small scale_inv: under unimp's rule a valid one is
    # >= 2**-126
    product = scale * inv  # float64: exact enough, never overflows for float32 inputs
    # a subnormal scale_inv (scale > 2**126, Keras / flax / Transformer Engine) holds fewer
    # bits: its rounding step, 2**-149, is allowed on top
    if abs(product - 1.0) > _INVERSE_TOLERANCE + 2.0**-149 * scale:
        raise ValueError(
            f"{where} 'scale_inv' must be 1 / scale under the {rule!r} preset: got scale {scale!r} "
            f"and scale_inv {inv!r} (product {product!r}, want 1 within 2**-21); a state out of "
            "step with itself would scale the matmul's output; save it with unimp.fp8.state_dict "
            "(or the layer's fp8_state)."
        )
    return FP8State(vals["scale"], vals["scale_inv"], _history(vals, config, where))


def _rule_name(config: FP8Config | None) -> str:
    """The :data:`PRESETS` name of ``config``'s rule (``"unimp_delayed"`` when None)."""
    if config is None:
        return "unimp_delayed"
    return next(n for n, (cls, r) in PRESETS.items() if isinstance(config, cls) and r == config.rule)


def _history(vals: dict[str, Any], config: FP8Config | None, where: str) -> Any:
    hist = vals["amax_history"]
    if hist.ndim != 1 or (config is not None and hist.shape[0] != config.amax_history_len):
        want = config.amax_history_len if config is not None else "L"
        raise ValueError(
            f"{where} 'amax_history' must be a list of {want} numbers (amax_history_len), got "
            f"shape {hist.shape}; load a state saved with the same config."
        )
    if np.any(hist < 0):
        raise ValueError(f"{where} 'amax_history' holds absolute maxima, >= 0; got {hist.min()}.")
    return hist


#: The fields of :class:`FP8State`, in order (the backends' variables / buffers are named
#: ``{tensor}_{field}``).
STATE_FIELDS = tuple(f.name for f in dataclasses.fields(FP8State))
