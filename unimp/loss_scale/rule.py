"""The loss-scale rule, written once over an array namespace, and its NumPy reference."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from unimp.loss_scale.config import (
    EXTRA_FIELDS,
    LossScaleConfig,
    LossScaleError,
    LossScaleFloorWarning,
    LossScaleState,
    positive_int,
)


class _NumpyOps:
    """The array namespace of the reference: NumPy float32 / int32 0-d arrays."""

    where = staticmethod(np.where)
    minimum = staticmethod(np.minimum)
    maximum = staticmethod(np.maximum)
    isfinite = staticmethod(np.isfinite)

    @staticmethod
    def f32(x: Any) -> Any:
        return np.float32(x)

    @staticmethod
    def i32(x: Any) -> Any:
        return np.int32(x)


def fields_in_use(config: LossScaleConfig) -> tuple[str, ...]:
    """The :class:`LossScaleState` fields :func:`update_arrays` can change under ``config``, in
    the state's order: the one decision of which fields a rule counts. Every other field comes
    back as the very array it was given and stays at its initial value (0 for the counters).
    Static in the config.

    The skip counters always count. A dynamic rule also moves ``scale`` and ``counter``, and
    counts ``hysteresis_used`` with ``hysteresis > 1``, ``overflows_since_rescale`` and
    ``steps_since_rescale`` with an ``overflow_tolerance``, ``floor_hits`` with a
    ``floor_action`` other than ``"keep"``.
    """
    if not config.dynamic:
        return ("consecutive_skips", "total_skips")
    counted = {
        "hysteresis_used": config.hysteresis > 1,
        "overflows_since_rescale": config.overflow_tolerance > 0,
        "steps_since_rescale": config.overflow_tolerance > 0,
        "floor_hits": config.floor_action != "keep",
    }
    return ("scale", "counter", "consecutive_skips", "total_skips", *(n for n in EXTRA_FIELDS if counted[n]))


def tracks_extra(config: LossScaleConfig) -> bool:
    """True when ``config``'s rule counts one of the :data:`EXTRA_FIELDS`
    (:func:`fields_in_use`): a backend then holds them and passes them to
    :func:`update_arrays` as ``extra``."""
    return any(n in EXTRA_FIELDS for n in fields_in_use(config))


def unchanged_fields(config: LossScaleConfig) -> tuple[str, ...]:
    """The :class:`LossScaleState` fields that :func:`update_arrays` returns unchanged (the
    very arrays it was given) for ``config``, whatever the flags: those not in
    :func:`fields_in_use`. A compiled step need not write (nor copy) them."""
    used = fields_in_use(config)
    return tuple(f.name for f in dataclasses.fields(LossScaleState) if f.name not in used)


def update_arrays(
    ops: Any,
    config: LossScaleConfig,
    scale: Any,
    counter: Any,
    consecutive_skips: Any,
    total_skips: Any,
    grads_finite: Any,
    loss_finite: Any,
    extra: tuple[Any, ...] | None = None,
    applied: Any = None,
) -> tuple[Any, ...]:
    """The loss-scale algorithm, branch-free, over any array namespace.

    Backends call this with their own tensors so the rule is written once. Python branches
    here depend only on the (static) config, never on array values, so the function traces
    under ``jax.jit``, ``tf.function`` and ``torch.compile``.

    Beyond the rule in :mod:`unimp.loss_scale`: an overflow backs off only when the
    ``hysteresis`` is used up (it is refilled by a growth, or by every clean step with
    ``consecutive_hysteresis``) and the overflow fraction reaches ``overflow_tolerance``;
    every overflow restarts the growth count; a backoff asked for while the scale is already at
    its floor counts a floor hit (``floor_action`` "warn" / "raise" act on it on the host).

    Args:
        ops: a namespace with ``where(c, a, b)``, ``minimum``, ``maximum``, ``isfinite``,
            ``f32(x)`` and ``i32(x)`` (make a float32 / int32 scalar on the right device).
        config: the loss-scale config (static).
        scale: float32 scalar.
        counter: int32 scalar.
        consecutive_skips: int32 scalar.
        total_skips: int32 scalar.
        grads_finite: bool scalar, every gradient element is finite.
        loss_finite: bool scalar, the (unscaled) loss is finite.
        extra: ``None``, or the extra fields of :class:`LossScaleState` (:data:`EXTRA_FIELDS`) as int32 scalars
            (``hysteresis_used, overflows_since_rescale, steps_since_rescale, floor_hits``).
        applied: ``grads_finite & loss_finite`` where the caller has computed it already (for
            its own conditional update: one op less in a graph); ``None`` computes it here.

    Returns:
        ``(scale, counter, consecutive_skips, total_skips)`` after the step, same dtypes; with
        ``extra``, followed by the four extra fields.

    Raises:
        ValueError: ``extra`` is None for a config whose rule needs it (see
            :func:`tracks_extra`).
    """
    if extra is None and tracks_extra(config):
        raise ValueError(
            "this loss-scale config (hysteresis, overflow_tolerance or floor_action) needs the "
            "extra state: pass extra=(hysteresis_used, overflows_since_rescale, "
            "steps_since_rescale, floor_hits)."
        )
    # Written for few kernels: every op here is a kernel launch (torch, TF graph) or a fused
    # scalar op (XLA). tests/test_loss_scale.py checks it against the plain nested-select spec.
    # A static or absent loss scale leaves scale, counter and the extra fields as they are
    # (the same arrays come back, so a backend can skip writing them) and needs no overflow flag.
    if applied is None:
        applied = grads_finite & loss_finite
    zero = ops.i32(0)
    one = ops.i32(1)
    new_consecutive = ops.where(applied, zero, consecutive_skips + one)
    new_total = ops.where(applied, total_skips, total_skips + one)
    if not config.dynamic:
        out = (scale, counter, new_consecutive, new_total)
        return out if extra is None else (*out, *extra)
    backoff = loss_finite != applied  # finite loss, non-finite gradients: an overflow
    grown = scale * ops.f32(config.growth_factor)
    if config.max_scale is not None:
        grown = ops.minimum(grown, ops.f32(config.max_scale))  # finite: max_scale <= float32 max
    else:
        grown = ops.where(ops.isfinite(grown), grown, scale)  # growth never makes the scale inf
    backed = ops.maximum(scale * ops.f32(config.backoff_factor), ops.f32(config.floor))
    next_counter = counter + one
    grow = applied & (next_counter >= ops.i32(config.growth_at))
    overflow = backoff
    if extra is not None:
        used, overflows, since, hits = extra
        if config.hysteresis > 1:  # back off only once the hysteresis is used up
            exhausted = used + one >= ops.i32(config.hysteresis)
            backoff = backoff & exhausted
            refill = applied if config.consecutive_hysteresis else grow
            used = ops.where(refill, zero, ops.where(overflow, ops.minimum(used + one, ops.i32(config.hysteresis - 1)), used))
        if config.overflow_tolerance > 0:  # fairseq: back off once the overflow fraction is reached
            fraction = ops.f32(overflows + one) / ops.f32(since + one)
            backoff = backoff & (fraction >= ops.f32(config.overflow_tolerance))
            since = ops.where(grow | backoff, zero, ops.where(applied | overflow, since + one, since))
            overflows = ops.where(backoff, zero, ops.where(overflow, overflows + one, overflows))
        if config.floor_action != "keep":
            hits = ops.where(backoff & (scale <= ops.f32(config.floor)), hits + one, hits)
        extra = (used, overflows, since, hits)
    # finite loss and grads: count, grow on the interval-th; finite loss, bad grads: back off
    # (when the hysteresis and tolerance allow) and restart the count; non-finite loss (forward
    # overflow): leave scale, counter and the extra fields alone.
    new_scale = ops.where(grow, grown, ops.where(backoff, backed, scale))
    if config.delayed_first_growth:  # DeepSpeed >= 0.17.1: restart at 1 after a growth
        new_counter = ops.where(grow, one, ops.where(overflow, zero, ops.where(applied, next_counter, counter)))
    else:
        new_counter = ops.where(grow | overflow, zero, ops.where(applied, next_counter, counter))
    out = (new_scale, new_counter, new_consecutive, new_total)
    return out if extra is None else (*out, *extra)


def skip_counts(consecutive_skips: Any, total_skips: Any, skipped: Any) -> tuple[Any, Any]:
    """The skip counters after a step, in arithmetic alone: ``((consecutive_skips + skipped) *
    skipped, total_skips + skipped)`` with ``skipped`` 1 for a skipped step and 0 for an applied
    one (any integer array, or Python ints).

    The same counters as :func:`update_arrays` (``where(applied, 0, consecutive + 1)``,
    ``where(applied, total, total + 1)``), for an engine that holds the skip flag as a number:
    torch's fused update (``unimp.backends.torch.GradScaler``) counts with it in place, and its
    train step derives its report from one snapshot with it, on the host or the device.
    """
    return (consecutive_skips + skipped) * skipped, total_skips + skipped


def update(
    config: LossScaleConfig,
    state: LossScaleState,
    grads_finite: bool,
    loss_finite: bool = True,
) -> LossScaleState:
    """One step of the reference algorithm (NumPy, float32 arithmetic).

    Args:
        config: the loss-scale config.
        state: the state before the step.
        grads_finite: every gradient element was finite (no overflow).
        loss_finite: the loss was finite; ``False`` is a forward overflow: the step is skipped
            and counted but the scale and counter are unchanged.

    Returns:
        The state after the step.
    """
    with np.errstate(over="ignore"):  # an overflowing growth is expected and handled
        out = _reference(config, state, grads_finite, loss_finite)
    return LossScaleState(*out)


def _reference(
    config: LossScaleConfig, state: LossScaleState, grads_finite: bool, loss_finite: bool
) -> Any:
    return update_arrays(
        _NumpyOps,
        config,
        np.float32(state.scale),
        np.int32(state.counter),
        np.int32(state.consecutive_skips),
        np.int32(state.total_skips),
        np.bool_(grads_finite),
        np.bool_(loss_finite),
        extra=tuple(np.int32(getattr(state, n)) for n in EXTRA_FIELDS),
    )


def _flag(value: Any, where: str) -> bool:
    """A step flag: a bool (Python or NumPy) or the integer 0 / 1; anything else (a string,
    2, 0.5, None) is refused, since ``bool("x")`` would silently read as a clean step."""
    import numpy as np

    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise ValueError(
        f"{where} must be a bool (True: finite, False: overflow) or 0 / 1, got {value!r}."
    )


def _event(flag: Any, i: int = 0) -> tuple[bool, bool]:
    if isinstance(flag, (tuple, list)):
        if len(flag) != 2:
            raise ValueError(
                f"flags[{i}]: a step event is grads_finite or (grads_finite, loss_finite), got {flag!r}."
            )
        return _flag(flag[0], f"flags[{i}][0]"), _flag(flag[1], f"flags[{i}][1]")
    return _flag(flag, f"flags[{i}]"), True


def simulate(
    config: LossScaleConfig,
    flags: Iterable[bool | tuple[bool, bool]],
    state: LossScaleState | None = None,
) -> list[LossScaleState]:
    """Runs the reference algorithm over a sequence of steps.

    Args:
        config: the loss-scale config.
        flags: per step, ``grads_finite`` (True for a clean step, False for an overflow), or a
            pair ``(grads_finite, loss_finite)``; each flag a bool or 0 / 1.
        state: the starting state; ``config.initial_state()`` by default.

    The rule only: like the device-side update, it counts ``floor_hits`` and
    ``consecutive_skips`` but neither raises nor warns for ``floor_action`` or
    ``max_consecutive_skips``. To stop where a train step would, call
    :func:`check_state` on each state, or read ``floor_hits`` as ``unimp explain --scalers`` does.

    Returns:
        The state after each step (``len(flags)`` states; the start state is not included).

    Raises:
        ValueError: a flag that is not a bool or 0 / 1 (named by its position, e.g.
            ``flags[1]``), or an event that is not a flag or a pair.

    Example:
        >>> from unimp import DynamicLossScale, simulate
        >>> cfg = DynamicLossScale(init_scale=8, growth_interval=2, min_scale=1)
        >>> [float(s.scale) for s in simulate(cfg, [True, True, False, False, False, False])]
        [8.0, 16.0, 8.0, 4.0, 2.0, 1.0]
    """
    events = [_event(flag, i) for i, flag in enumerate(flags)]  # all checked before any step
    s = config.initial_state() if state is None else state
    out = []
    for g, lf in events:
        s = update(config, s, g, lf)
        out.append(s)
    return out


def check_state(config: LossScaleConfig, state: LossScaleState, step: int | None = None) -> None:
    """Raises :class:`LossScaleError` when ``max_consecutive_skips`` is exceeded, or when an
    overflow hit the floor with ``floor_action="raise"``; warns (:class:`LossScaleFloorWarning`)
    for a floor hit with ``floor_action="warn"``.

    Backends call this when results are read, not every step, to avoid a host-device sync.

    Args:
        config: the loss-scale config.
        state: the state read from the device.
        step: the 0-based step the state was read after, where the caller knows it (named in
            the message).

    Raises:
        LossScaleError: more than ``max_consecutive_skips`` skipped steps in a row, or
            ``state.floor_hits > 0`` with ``floor_action="raise"``; the message says why the
            scale is stuck and what to look at.
    """
    _check_floor(config, state, step)
    limit = getattr(config, "max_consecutive_skips", None)
    if limit is None or int(state.consecutive_skips) <= limit:
        return
    at_floor = not config.dynamic or float(state.scale) <= config.floor
    why = (
        "Gradients stay non-finite even at the lowest scale, so the cause is not float16 range: "
        "look for NaN/inf in the inputs or labels, a learning rate that makes the weights diverge, "
        "or a forward overflow (StepResult.loss_finite is False; compute that op in float32)."
        if at_floor
        else "The scale is still backing off from a high value: lower init_scale, or raise "
        "max_consecutive_skips above log2(init_scale / a workable scale); if the loss is "
        "non-finite (StepResult.loss_finite is False) the cause is a forward overflow instead."
    )
    raise LossScaleError(
        f"the loss scale is stuck: {int(state.consecutive_skips)} skipped steps in a row "
        f"(max_consecutive_skips={limit}), scale now {float(state.scale)!r}"
        + (f", floor {config.floor!r}" if config.dynamic else "")
        + ". "
        + why
    )


class FloorWatch:
    """:func:`check_state` for one run read again and again (every step's result, a scaler's
    ``get_scale``, a ``model.fit`` callback): each floor hit is acted on once.

    ``LossScaleState.floor_hits`` counts every hit since the start, so a plain ``check_state``
    after the first hit would warn (or raise) at every later read. The watch remembers the most
    hits it has acted on and passes ``floor_hits`` on only when it grew (a count below it is a
    loaded state: the record starts again); ``max_consecutive_skips`` is checked on every read,
    as :func:`check_state` does. Every backend's train step holds one.
    """

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen = 0

    def check(self, config: LossScaleConfig, state: LossScaleState, step: int | None = None) -> None:
        """:func:`check_state` with the floor hits already acted on taken out.

        Raises:
            LossScaleError: as :func:`check_state`.
        """
        hits = int(state.floor_hits)
        if hits < self.seen:  # fewer than seen: another state was loaded, a new record starts
            self.seen = 0
        if hits <= self.seen:
            state = dataclasses.replace(state, floor_hits=0)
        else:
            self.seen = hits
        check_state(config, state, step)


class FitCheck:
    """The body of a Keras ``LossScaleCheck`` callback, framework-free: a Keras integration
    mixes it into ``keras.callbacks.Callback`` and names its optimizer class
    (``optimizer_class``), how to compile with it (``fix``) and how to read its state
    (``read_state``, one device read). After every ``every``-th training batch it runs
    :class:`FloorWatch`'s check of the state, and reads nothing for a config with neither
    ``max_consecutive_skips`` nor a ``floor_action`` (as a step result's first read).

    Args:
        every: check after every ``every``-th batch, an int >= 1.

    Raises:
        ValueError: ``every`` is not an int >= 1.
        TypeError: (in ``fit``) the model's optimizer is not ``optimizer_class``.
        LossScaleError: (in ``fit``) as :func:`check_state`.
    """

    optimizer_class: type = object
    fix: str = ""

    def __init__(self, every: int = 1) -> None:
        super().__init__()
        self.every = positive_int("LossScaleCheck", "every", every, 1)
        self._batches = 0
        self._watch = FloorWatch()  # each floor hit acted on once, as the train steps do

    def read_state(self, optimizer: Any) -> LossScaleState:  # pragma: no cover - overridden
        raise NotImplementedError

    def accepts(self, optimizer: Any) -> bool:
        """Whether the callback can check ``optimizer`` (an ``optimizer_class`` here)."""
        return isinstance(optimizer, self.optimizer_class)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        opt = getattr(self.model, "optimizer", None)  # the model Keras gave the callback
        if not self.accepts(opt):
            kind = type(opt)
            raise TypeError(f"LossScaleCheck needs {self.fix}, got {kind.__module__}.{kind.__qualname__}.")
        self._batches += 1
        if self._batches % self.every:
            return
        config = opt.loss_scale_config
        if getattr(config, "max_consecutive_skips", None) is None and getattr(config, "floor_action", "keep") == "keep":
            return  # nothing to act on: no device read
        self._watch.check(config, self.read_state(opt), step=self._batches - 1)


def _check_floor(config: LossScaleConfig, state: LossScaleState, step: int | None) -> None:
    action = getattr(config, "floor_action", "keep")
    if action == "keep" or int(state.floor_hits) == 0:
        return
    where = f"step {step}" if step is not None else f"the state read after {int(state.total_skips)} skips"
    msg = (
        f"the loss scale is at its floor (min_scale={config.floor!r}) and an overflow asked to "
        f"lower it again (floor hit {int(state.floor_hits)}, reported by {where}; "
        f"floor_action={action!r}). "
        "DeepSpeed stops here ('Current loss scale already at minimum') and fairseq too "
        "('Minimum loss scale reached'): the loss is probably diverging, not out of float16 "
        "range. Lower the learning rate, clip gradients (max_grad_norm), look for NaN/inf in the "
        "inputs, or compute the overflowing op in float32; floor_action='keep' goes on at the floor."
    )
    if action == "raise":
        raise LossScaleError(msg)
    import warnings

    warnings.warn(msg, LossScaleFloorWarning, stacklevel=4)
