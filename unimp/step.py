"""StepResult: what one training step reports, the same in every backend. Framework-free."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from unimp.loss_scale import FloorWatch, LossScaleConfig, LossScaleState, check_state

__all__ = [
    "SCHEDULE_COUNTS",
    "STEP_FIELDS",
    "check_schedule_counts",
    "floor_hits",
    "HalfOptimizerStateWarning",
    "StepResult",
    "check_scaled_half_params",
    "check_stats_every",
    "check_step_options",
    "warn_half_optimizer_state",
]

#: The fields of :class:`StepResult`, in order.
STEP_FIELDS = (
    "loss",
    "scale",
    "applied",
    "loss_finite",
    "grads_finite",
    "grad_norm",
    "consecutive_skips",
    "total_skips",
)

_KIND = {
    "loss": float,
    "scale": float,
    "applied": bool,
    "loss_finite": bool,
    "grads_finite": bool,
    "grad_norm": float,
    "consecutive_skips": int,
    "total_skips": int,
}


class _RawDict(dict):
    """:attr:`StepResult.raw`: a plain ``dict`` of the step's device values in which a value a
    backend derives on demand (torch's fused step: a field of one packed snapshot, with a
    ``device_value()``) is derived when its key is read and kept, so that reading
    ``raw["loss"]`` costs no device op for the other fields. Everything else a dict does
    (iterating values or items, ``copy``, ``|``, ``==``, pickling, ``torch.save``) derives the
    remaining ones first, so it sees device values only; it pickles as an ``OrderedDict``
    (which ``torch.load``'s default ``weights_only=True`` reads)."""

    __slots__ = ()

    def _derive(self, key: Any) -> Any:
        v = dict.__getitem__(self, key)
        if hasattr(v, "device_value"):
            v = v.device_value()
            dict.__setitem__(self, key, v)
        return v

    def _derive_all(self) -> None:
        for key in list(dict.keys(self)):
            self._derive(key)

    def __getitem__(self, key: Any) -> Any:
        return self._derive(key)

    def get(self, key: Any, default: Any = None) -> Any:
        return self._derive(key) if key in self else default

    def __iter__(self) -> Iterator[Any]:  # not dict's own: dict(raw) and {**raw} read per key
        return iter(list(dict.keys(self)))


def _deriving(name: str) -> Callable[..., Any]:
    method = getattr(dict, name)

    def call(self: _RawDict, *args: Any, **kwargs: Any) -> Any:
        self._derive_all()
        return method(self, *args, **kwargs)

    call.__name__ = name
    return call


for _name in ("values", "items", "copy", "pop", "popitem", "setdefault", "__eq__", "__ne__",
              "__or__", "__ror__", "__repr__"):  # fmt: skip
    setattr(_RawDict, _name, _deriving(_name))
_RawDict.__hash__ = None  # type: ignore[assignment]  # a dict: unhashable
# pickled as an OrderedDict of device values: a dict, and one that torch.load's default
# weights_only unpickler accepts (it refuses a dict subclass, and builtins.dict by name)
_RawDict.__reduce__ = lambda self: (collections.OrderedDict, (list(self.items()),))  # type: ignore[method-assign]


class StepResult:
    """The outcome of one training step.

    Taking a step never synchronizes with the device: the result holds the step's device
    values. Reading a field converts it to a Python value, which may wait for the device;
    the first read also checks ``max_consecutive_skips`` and the loss scale's ``floor_action``
    and may raise :class:`~unimp.LossScaleError`.

    Args:
        raw: the step's device values, one per name in :data:`STEP_FIELDS`; optionally
            ``floor_hits`` (the loss-scale state's, for ``floor_action`` "warn" / "raise").
        to_host: converts one device value to a host value (e.g. ``Tensor.item``).
        config: the loss-scale config, for the ``max_consecutive_skips`` check.
        stats: the step's tensor statistics: ``None`` (not taken on this step), a
            :class:`unimp.stats.StepStats`, or a function of no arguments returning one, called
            on the first read of :attr:`stats` (where the backend reads its device arrays).
        watch: the run's :class:`unimp.loss_scale.FloorWatch` (each train step holds one), so
            a floor hit warns or raises at the first result read after it, not at every later
            one; None checks this result alone.

    Attributes:
        loss: float, the unscaled loss of the step (the mean over micro-batches when
            accumulating).
        scale: float, the loss scale used for this step (1.0 without scaling).
        applied: bool, the optimizer step was applied (False: skipped).
        loss_finite: bool, the loss was finite (False is a forward overflow: skipped, the
            scale is not reduced).
        grads_finite: bool, every unscaled gradient element was finite.
        grad_norm: float or None, global L2 norm of the unscaled gradients before clipping;
            None when not computed (no ``max_grad_norm``).
        consecutive_skips: int, skipped steps in a row, this one included.
        total_skips: int, skipped steps since the start.
        params_finite: bool or None: every half-precision (float16 / bfloat16) trainable
            parameter is finite after the step; None where the parameters are all float32
            (not checked). False after an applied step with finite gradients means the update
            itself overflowed: the optimizer computes in the half dtype (see the step log's
            doctor). Not one of :data:`STEP_FIELDS` (:meth:`as_dict` leaves it out).
        stats: :class:`unimp.stats.StepStats` or None: the tensor statistics of a step taken
            with ``train_step(..., stats_every=k)`` on steps 0, k, 2k, ...; None on the others
            (and without the option). Not one of :data:`STEP_FIELDS`: :meth:`as_dict` and the
            repr leave it out. Its first read converts the device arrays (a host sync).
    """

    __slots__ = ("_raw", "_to_host", "_config", "_values", "_checked", "_stats", "_watch")

    def __init__(
        self,
        raw: Mapping[str, Any],
        to_host: Callable[[Any], Any] | None = None,
        config: LossScaleConfig | None = None,
        stats: Any = None,
        watch: FloorWatch | None = None,
    ) -> None:
        missing = [f for f in STEP_FIELDS if f not in raw]
        if missing:
            raise ValueError(f"StepResult is missing fields {missing}.")
        self._raw = dict(raw)
        self._to_host = to_host or (lambda x: x)
        self._config = config
        self._values: dict[str, Any] = {}
        self._checked = False
        self._stats = stats
        self._watch = watch

    def _get(self, name: str) -> Any:
        if name not in self._values:
            raw = self._raw[name]
            value = None if raw is None else _KIND[name](self._to_host(raw))
            self._values[name] = value
        if not self._checked:
            self._checked = True
            floor = self._raw.get("floor_hits")  # with floor_action "warn" / "raise"
            if self._config is not None and (
                getattr(self._config, "max_consecutive_skips", None) is not None or floor is not None
            ):
                skips = self._get("consecutive_skips")
                state = LossScaleState(
                    self._get("scale"), 0, skips, max(skips, self._get("total_skips")),
                    floor_hits=0 if floor is None else int(self._to_host(floor)),
                )
                check = check_state if self._watch is None else self._watch.check
                check(self._config, state, step=self._raw.get("floor_step"))
        return self._values[name]

    loss = property(lambda self: self._get("loss"), doc="float, the unscaled loss.")
    scale = property(
        lambda self: self._get("scale"), doc="float, the loss scale used for this step."
    )
    applied = property(
        lambda self: self._get("applied"), doc="bool, the optimizer step was applied."
    )
    loss_finite = property(lambda self: self._get("loss_finite"), doc="bool, the loss was finite.")
    grads_finite = property(
        lambda self: self._get("grads_finite"), doc="bool, the gradients were finite."
    )
    grad_norm = property(
        lambda self: self._get("grad_norm"), doc="float or None, unscaled norm before clipping."
    )
    consecutive_skips = property(
        lambda self: self._get("consecutive_skips"), doc="int, skips in a row."
    )
    total_skips = property(lambda self: self._get("total_skips"), doc="int, skips since the start.")

    @property
    def params_finite(self) -> bool | None:
        """bool or None: the half-precision parameters are finite after the step (see the
        class); None where there are none (not checked)."""
        if "params_finite" not in self._values:
            raw = self._raw.get("params_finite")
            self._values["params_finite"] = None if raw is None else bool(self._to_host(raw))
        return self._values["params_finite"]

    @property
    def stats(self) -> Any:
        """:class:`unimp.stats.StepStats` of a statistics step, else None (see the class).

        The first read reads the statistics' device arrays back (one sync); later reads return
        the same object.
        """
        if callable(self._stats):
            self._stats = self._stats()
        return self._stats

    @property
    def raw(self) -> dict[str, Any]:
        """The device values, unconverted (reading this never synchronizes): a new ``dict``
        on each read, keyed by the names of :data:`STEP_FIELDS` (and any extra a backend
        reports). A backend may hold a field as a value derived on demand from a packed
        snapshot (torch's fused step): it is derived, as a device value, when its key is
        read, so reading ``raw["loss"]`` costs no device op for the other fields."""
        return _RawDict(self._raw)

    def as_dict(self) -> dict[str, Any]:
        """Every field as a Python value (synchronizes)."""
        return {f: self._get(f) for f in STEP_FIELDS}

    def __repr__(self) -> str:
        try:
            parts = []
            for f in STEP_FIELDS:
                v = self._get(f)
                parts.append(
                    f"{f}={v:.6g}" if isinstance(v, float) and math.isfinite(v) else f"{f}={v}"
                )
            return f"StepResult({', '.join(parts)})"
        except Exception as e:  # repr must not raise
            return f"StepResult(<unreadable: {e}>)"


#: What a skipped step does to learning-rate schedules and step counters, the same in every
#: backend (``train_step(..., schedule_counts=...)``):
#:
#: * ``"applied"`` (default): a skipped step changes no counter: torch's LR scheduler is not
#:   stepped, Keras's ``iterations`` and optax's ``count`` leaves keep their value, so a
#:   schedule is a function of the applied steps (as torch.amp's skipped ``optimizer.step``,
#:   Keras's LossScaleOptimizer and optax's ``apply_if_finite``).
#: * ``"attempted"``: the schedule counts every step, skipped or not: torch's scheduler steps on
#:   every call (and needs no host read of ``applied``), Keras's ``iterations`` and every integer
#:   ``count`` leaf of the optax state grow by one on a skipped step (as DeepSpeed and Megatron-LM,
#:   whose LR schedulers step once per iteration). Parameters, moments and EMA values are never
#:   touched by a skipped step; torch's per-parameter ``step`` (Adam's bias correction) counts
#:   applied steps in both modes, where Keras's ``iterations`` and optax's Adam ``count`` also
#:   drive the bias correction.
SCHEDULE_COUNTS = ("applied", "attempted")


def check_schedule_counts(value: Any) -> str:
    """Validates ``schedule_counts`` (one of :data:`SCHEDULE_COUNTS`).

    Raises:
        ValueError: naming the option and the accepted values.
    """
    if value not in SCHEDULE_COUNTS:
        raise ValueError(f"schedule_counts must be 'applied' or 'attempted', got {value!r}.")
    return value


def floor_hits(config: LossScaleConfig, extra: Any) -> dict[str, Any]:
    """``{"floor_hits": <device value>}`` for a step's raw values where the config's
    ``floor_action`` needs the host check ("warn" / "raise"), else ``{}``; ``extra`` is the
    extra-fields tail that :func:`unimp.loss_scale.update_arrays` returned. Every backend's step
    adds ``"floor_step"`` (its 0-based index, named in the message) on the host, after the call."""
    if getattr(config, "floor_action", "keep") == "keep" or not extra:
        return {}
    return {"floor_hits": extra[-1]}


def check_step_options(grad_accum_steps: Any, max_grad_norm: Any) -> tuple[int, float | None]:
    """Validates the train-step options every backend takes, one rule for all.

    Args:
        grad_accum_steps: micro-batches per optimizer step: an int >= 1.
        max_grad_norm: ``None``, or a real number in float32's positive normal range, about
            1.2e-38 to 3.4e38 (the global norm the unscaled gradients
            are clipped to).

    Returns:
        ``(grad_accum_steps, max_grad_norm)`` as ``(int, float | None)``.

    Raises:
        ValueError: naming the option and the accepted values.
    """
    import numpy as np

    if (
        isinstance(grad_accum_steps, bool)
        or not isinstance(grad_accum_steps, (int, np.integer))
        or grad_accum_steps < 1
    ):
        raise ValueError(f"grad_accum_steps must be an int >= 1, got {grad_accum_steps!r}.")
    if max_grad_norm is not None:
        bad = ValueError(
            f"max_grad_norm must be a finite number > 0 or None, got {max_grad_norm!r}; the "
            "norm is float32 in every backend, so it must lie in float32's positive range "
            "(about 1.2e-38 to 3.4e38)."
        )
        if (
            isinstance(max_grad_norm, (bool, np.bool_, np.complexfloating))
            or not isinstance(max_grad_norm, (int, float, np.integer, np.floating))
        ):
            raise bad
        try:
            value = float(max_grad_norm)
        except OverflowError:  # an int beyond float64 (10**400)
            raise bad from None
        # the backends clip in float32: a value that is inf there makes inf / inf = NaN
        # gradients, one that rounds to 0 makes 0 / 0 on zero gradients
        tiny, top = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
        if not (math.isfinite(value) and tiny <= value <= top):
            raise bad
        max_grad_norm = value
    return int(grad_accum_steps), max_grad_norm


def check_stats_every(stats_every: Any) -> int | None:
    """Validates ``train_step``'s ``stats_every`` option, one rule for every backend.

    Args:
        stats_every: ``None`` (no statistics, the default: the step is the plain one), or an
            int ``k >= 1``: tensor statistics (:mod:`unimp.stats`) on steps 0, k, 2k, ...
            (0-based, counted by the train step).

    Returns:
        ``None`` or ``k`` as an ``int``.

    Raises:
        ValueError: anything else (``0``, negative numbers, floats, bools, strings), naming the
            accepted values.

    Example:
        >>> check_stats_every(100), check_stats_every(None)
        (100, None)
    """
    import numpy as np

    if stats_every is None:
        return None
    if (
        isinstance(stats_every, bool)
        or not isinstance(stats_every, (int, np.integer))
        or stats_every < 1
    ):
        raise ValueError(
            f"stats_every must be None (no statistics) or an int >= 1 (statistics on steps 0, "
            f"k, 2k, ...), got {stats_every!r}; e.g. stats_every=100."
        )
    return int(stats_every)


def micro_batches(batch: Any, grad_accum_steps: int) -> list[Any]:
    """The micro-batches of one optimizer step, by the rule every backend's ``step(batch)`` uses.

    With ``grad_accum_steps == 1`` the batch is the one micro-batch; with ``k > 1`` it must be a
    list of ``k`` micro-batches. A tuple is refused: it is how a batch is written (``(x, y)``),
    so ``step((x, y))`` with ``k == 2`` would take ``x`` and ``y`` as two micro-batches and
    fail deep in the framework.

    Args:
        batch: what the user passed to ``step``.
        grad_accum_steps: the step's ``k`` (already checked by :func:`check_step_options`).

    Returns:
        A list of ``k`` micro-batches (``[batch]`` for ``k == 1``).

    Raises:
        ValueError: ``k > 1`` and ``batch`` is not a list of ``k`` items; the message names
            what was passed.
    """
    k = grad_accum_steps
    if k == 1:
        return [batch]
    if isinstance(batch, tuple):
        example = "[batch_0, batch_1]" if k == 2 else f"[batch_0, ..., batch_{k - 1}]"
        raise ValueError(
            f"with grad_accum_steps={k}, step(batch) takes a list of {k} micro-batches, got a "
            f"tuple (one batch, such as (x, y)): pass {example}."
        )
    if not isinstance(batch, list) or len(batch) != k:
        got = f"list of length {len(batch)}" if isinstance(batch, list) else type(batch).__name__
        raise ValueError(
            f"with grad_accum_steps={k}, step(batch) takes a list of {k} micro-batches, got {got}."
        )
    sizes = [_leading_sizes(b) for b in batch]
    for i, got in enumerate(sizes[1:], start=1):
        if _differ(sizes[0], got):
            raise ValueError(
                f"with grad_accum_steps={k}, micro-batch {i} has {_size_text(got)} rows where "
                f"micro-batch 0 has {_size_text(sizes[0])}: every micro-batch's mean loss weighs "
                "the same in the window's mean, so uneven micro-batches would not step as their "
                "full batch does. Split the batch evenly (a DataLoader's drop_last=True, a "
                "batch size divisible by grad_accum_steps)."
            )
    return list(batch)


def _leading_sizes(batch: Any) -> list[int | None]:
    """The first dimension of every array in ``batch`` (lists, tuples and dicts walked, in
    order; an array is anything with a ``shape`` of at least one dimension, in any framework;
    ``None`` where it is unknown, as in a traced TensorFlow shape)."""
    if isinstance(batch, Mapping):
        return [n for key in batch for n in _leading_sizes(batch[key])]
    if isinstance(batch, (list, tuple)):
        return [n for item in batch for n in _leading_sizes(item)]
    shape = getattr(batch, "shape", None)
    try:
        if shape is None or len(shape) == 0:
            return []
    except TypeError:  # an unknown rank (a traced TensorFlow shape)
        return []
    return [shape[0] if isinstance(shape[0], int) else None]


def _differ(a: list[int | None], b: list[int | None]) -> bool:
    """Two micro-batches of one structure differ in size where both sizes are known (a
    different structure is the framework's to refuse, or to take)."""
    return len(a) == len(b) and any(
        x is not None and y is not None and x != y for x, y in zip(a, b, strict=True)
    )


def _size_text(sizes: list[int | None]) -> str:
    known = sorted({n for n in sizes if n is not None})
    return "/".join(map(str, known)) or "no known"


def check_scaled_half_params(names: Any, loss_scale: LossScaleConfig, keep: str) -> None:
    """Refuses float16 parameters under a loss scale that is not always 1, one rule for every
    backend (torch.amp's GradScaler refuses to unscale float16 gradients: "Attempting to
    unscale FP16 gradients"): a float16 parameter gets a float16 gradient, whose scaled value
    overflows where the float32 one would not and whose unscaled value loses the small
    gradients the scale was there to keep. A pure-float16 recipe comes without a loss scale
    (``16-true``) or with Apex O3's static 1.0, which are allowed.

    Args:
        names: the float16 parameters' names (as the framework names them), checked before
            anything is changed.
        loss_scale: the recipe's loss-scale config.
        keep: how to keep a parameter float32 in this framework, for the message.

    Raises:
        ValueError: naming up to 8 of the parameters and the three fixes.
    """
    if loss_scale.unity:
        return
    bad = sorted(set(names))
    if bad:
        listed = ", ".join(bad[:8]) + (" ..." if len(bad) > 8 else "")
        raise ValueError(
            f"loss scaling is on but these float16 parameters would get float16 gradients, which "
            f"cannot be unscaled safely: {listed}. Keep them float32 ({keep}), use a recipe "
            "with float32 parameters, or loss_scale='none'."
        )


class HalfOptimizerStateWarning(UserWarning):
    """An adaptive optimizer (Adam, RMSprop, Adagrad, ...) keeps its moments in float16
    because the parameters are float16 (a pure-float16 recipe such as ``"float16"``,
    ``"16-true"`` or Apex ``O3``): see :func:`warn_half_optimizer_state`."""


#: float16's smallest normal number, 2**-14; below it float16 has only subnormals (down to
#: 2**-24, about 6e-8) and then zero
_F16_TINY = 2.0**-14


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points :func:`warnings.warn` (called from the function that
    called this) at the first frame outside unimp and the frameworks (Keras builds optimizers
    from deep inside ``fit`` or a traced step)."""
    import sys

    skip = ("unimp", "keras", "tensorflow", "torch", "jax", "optax", "flax", "importlib")
    frame = sys._getframe(2)  # the caller of warn_half_optimizer_state
    level = 2
    while frame is not None and (frame.f_globals.get("__name__") or "").split(".")[0] in skip:
        frame = frame.f_back
        level += 1
    return level


def warn_half_optimizer_state(optimizer: str, eps: float | None) -> None:
    """Warns that an adaptive optimizer keeps float16 state, one rule for every backend.

    torch, Keras and optax create optimizer state in the parameters' dtype. With float16
    parameters an adaptive optimizer's second moment ``v`` (a running mean of ``g**2``) is
    float16: squares of gradients below about 2.4e-4 flush to zero (float16 stops at 6e-8),
    and an ``eps`` below float16's smallest normal (6.1e-5; the usual 1e-7 / 1e-8) is rounded
    to a subnormal or to 0, so ``m / (sqrt(v) + eps)`` blows up to huge, inf or NaN updates.
    Mixed recipes (``"mixed_float16"``: float32 parameters and optimizer state) and bfloat16
    (float32's range) do not have the problem; an ``eps`` of at least 6.1e-5 (1e-4 is the
    usual pure-float16 choice) bounds the update, and then nothing is said. Backends call this
    when they see float16 optimizer state; nothing is changed. The warning points at the first
    caller outside unimp and the frameworks.

    Args:
        optimizer: the optimizer's name, for the message.
        eps: its (smallest) epsilon, or None when the backend cannot read it (optax keeps it
            in a closure; ``optax.inject_hyperparams`` exposes it).
    """
    import warnings

    import numpy as np

    if eps is not None and eps >= _F16_TINY:
        return  # the pure-float16 mitigation (e.g. eps=1e-4): sqrt(v) may flush, eps holds
    if eps is None:
        why = (
            "an epsilon below 6.1e-5 (optax's default 1e-8) becomes a float16 subnormal or 0 "
            "(unimp cannot read this optimizer's epsilon: wrap it in optax.inject_hyperparams "
            "to have it checked)"
        )
    elif float(np.float16(eps)) == eps:
        why = f"epsilon is {eps:g} in float16"
    else:
        why = f"epsilon={eps:g} becomes {float(np.float16(eps)):g} in float16"
    warnings.warn(
        f"{optimizer} keeps its moments in float16 because the parameters are float16: squared "
        f"gradients below ~2.4e-4 flush to zero and {why}, so updates blow up (inf/NaN) or "
        "stall. Use a mixed recipe ('mixed_float16': float32 parameters and optimizer state), "
        "bfloat16, or an epsilon >= 1e-4.",
        HalfOptimizerStateWarning,
        stacklevel=_user_stacklevel(),
    )
