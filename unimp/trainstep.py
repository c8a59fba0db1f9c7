"""The algorithm of one training step, written once over a backend's primitives. Framework-free.

Every backend's ``train_step`` runs :func:`run_step`: the order of the phases, what each phase
is given and what the step reports are decided here, once; a backend supplies the phases as
the methods of its ``StepOps`` (``unimp/backends/<framework>/step.py``), with the names and
signatures of :class:`StepPrimitives`, as :func:`unimp.loss_scale.update_arrays` runs the
loss-scale rule over an array namespace. What a backend hands over between the phases
(``grads``, ``saved``) is opaque here: a pytree (JAX), a list of tensors (TensorFlow), or the
optimizer whose parameters hold the gradients (torch, whose ``.grad`` fields are the state).

The step's options are validated and documented once, by :class:`StepOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from unimp.rounding import check_seed
from unimp.stats import check_formats
from unimp.step import check_schedule_counts, check_stats_every, check_step_options, micro_batches
from unimp.steprecorder import check_log_every

__all__ = ["NORM_RESCALE_ABOVE", "StepOptions", "StepPrimitives", "run_step", "run_step_traced"]

#: The global norm's rescaling, one rule in every backend. With ``amax`` the largest magnitude
#: of the unscaled gradients (float32), the norm is ``sqrt(sum((g * s)**2)) / s`` with
#: ``s = NORM_RESCALE_ABOVE / 2**floor(log2(amax))`` where ``amax`` is finite and above
#: ``NORM_RESCALE_ABOVE``, else ``s = 1``. ``s`` is a power of two taken from ``amax``'s
#: exponent bits (exact: no rounding of ``g * s`` in float32's normal range), so the scaled
#: elements are below 2**33 and their squares sum without overflow for up to 2**62
#: elements; below the threshold the norm is the plain ``sqrt(sum(g**2))``, bit for bit. The
#: clip multiplies in the same rescaled domain, ``(g * s) * (max_norm / (norm * s))``, in
#: float32 (at least) and rounded once to the gradient's dtype, so that the factor never leaves
#: float32's normal range (``max_norm / norm`` would, for a norm above 2**126 * max_norm, and
#: XLA and TensorFlow flush it to 0: a silent no-op update).
NORM_RESCALE_ABOVE = 2.0**32


@dataclass(frozen=True)
class StepOptions:
    """The options every backend's ``train_step`` takes, validated once, one rule for all.

    Args:
        grad_accum_steps: micro-batches per optimizer step (an int >= 1). With ``k > 1`` each
            call takes a list of ``k`` micro-batches (the same call shape in every backend:
            one call is one optimizer step and one :class:`~unimp.StepResult`); their scaled
            gradients are summed from exact zeros, in float32 (or the parameters' wider
            dtype) or, where the policy sets ``accum_dtype``, in that dtype rounded at every
            addition; the mean is unscaled once; the whole window is skipped when any
            micro-batch is non-finite; ``loss`` is the mean micro-batch loss.
        max_grad_norm: ``None`` (no clipping; ``grad_norm`` is then reported as ``None``) or
            a finite number > 0: the global L2 norm the UNSCALED gradients are clipped to
            (``g * min(1, max_norm / norm)``, as ``torch.nn.utils.clip_grad_norm_``,
            ``optax.clip_by_global_norm`` and ``tf.clip_by_global_norm``); ``grad_norm`` is
            the norm before clipping, taken so that finite gradients never overflow it
            (:data:`NORM_RESCALE_ABOVE`: 1e20 in each of 100 elements has the norm 1e21,
            where ``sqrt(sum(g**2))`` in float32 is inf and the clip a silent no-op,
            pytorch/pytorch#46849). A norm that is itself beyond float32 counts as a
            non-finite gradient: the step is skipped and reports ``grads_finite=False``.
        stats_every: ``None`` (default) or ``k >= 1``: tensor statistics
            (:mod:`unimp.stats`) in the results of calls 0, k, 2k, ... (counted by the step;
            a call that raises is not counted); the other calls run the plain step.
        schedule_counts: what a skipped step does to learning-rate schedules and step
            counters: ``"applied"`` (default) or ``"attempted"``
            (:data:`unimp.step.SCHEDULE_COUNTS`).
        log: ``None`` (default), a file path or a :class:`unimp.steplog.StepLogWriter`: a
            JSON Lines step log (``docs/steplog.md``; ``unimp doctor`` reads it): one record
            per step, kept on the device and written every ``log_every`` steps (the only waits
            it adds), the rest on the step's ``close()``, garbage collection or exit. With
            ``stats_every`` the records carry the statistics, and a non-finite step's first
            non-finite layer.
        log_every: steps between two writes of the step log, an int >= 1 (default 100).
        rounding_seed: the seed of stochastic rounding (a policy with
            ``update="stochastic"``, :mod:`unimp.rounding`), an integer (default 0; its low
            32 bits are used): one seed gives the same random bits in every framework.
        stats_formats: block-scaled formats (names of :data:`unimp.stats.BLOCK_FORMATS`, or a
            block recipe's: ``"mxfp8"``, ``"fp8-block"``, ``"nvfp4"``, ``"mxfp4"``) whose
            quantization error the statistics take as well, per tensor: the share of its
            nonzero elements that would round to zero and the relative MSE
            (:meth:`unimp.stats.TensorStats.underflow`, :meth:`~unimp.stats.TensorStats.relative_mse`).
            Default ``()``: none (each format quantizes every recorded tensor once more on a
            statistics step). Needs ``stats_every``.

    Raises:
        ValueError: any option out of its range, naming the option and the accepted values.
        TypeError: ``rounding_seed`` is not an integer.
    """

    grad_accum_steps: int = 1
    max_grad_norm: float | None = None
    stats_every: int | None = None
    schedule_counts: str = "applied"
    log: Any = None
    log_every: int = 100
    rounding_seed: int = 0
    stats_formats: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        k, norm = check_step_options(self.grad_accum_steps, self.max_grad_norm)
        set_ = object.__setattr__  # frozen: the checked values replace the given ones
        set_(self, "stats_every", check_stats_every(self.stats_every))
        set_(self, "grad_accum_steps", k)
        set_(self, "max_grad_norm", norm)
        set_(self, "schedule_counts", check_schedule_counts(self.schedule_counts))
        set_(self, "log_every", check_log_every(self.log, self.log_every))
        set_(self, "rounding_seed", check_seed(self.rounding_seed, "StepOptions.rounding_seed"))
        set_(self, "stats_formats", check_formats(self.stats_formats))
        if self.stats_formats and self.stats_every is None:
            raise ValueError(
                f"stats_formats={list(self.stats_formats)} is taken on statistics steps: give "
                "stats_every=k as well (e.g. stats_every=100)."
            )

    def stats_step(self, calls: int) -> bool:
        """Whether the call with 0-based index ``calls`` takes statistics."""
        return self.stats_every is not None and calls % self.stats_every == 0

    def micro_batches(self, batch: Any) -> list[Any]:
        """``batch`` as the step's list of micro-batches (:func:`unimp.step.micro_batches`)."""
        return micro_batches(batch, self.grad_accum_steps)


class StepPrimitives(Protocol):
    """The phases of one step, as each backend's ``StepOps`` supplies them.

    Every method runs on the device's values without reading them on the host (a traced
    backend runs them while tracing). ``grads`` is whatever the backend hands from one phase
    to the next.
    """

    def begin(self) -> Any:
        """Checks what must hold before the loss is scaled (replicas agree on the loss-scale
        state) and returns the loss scale this step uses (a 0-d float32 device value)."""

    def save_forward_state(self) -> Any:
        """The state the forward pass changes (normalization statistics, counters), kept to
        be selected back on a skipped step."""

    def gradients(self, micro: list[Any], scale: Any) -> tuple[Any, Any, Any]:
        """Runs the scaled forward and backward pass of every micro-batch of the window and
        accumulates (see :class:`StepOptions`); returns ``(grads, loss, loss_finite)``: the
        scaled mean gradients (all-reduced where the backend reduces them in the backward),
        the mean unscaled loss (float32) and whether every micro-batch's loss was finite."""

    def abort(self, saved: Any) -> None:
        """Undoes a step that raised before its update (in the window, the unscale, the
        checks or the optimizer's own step): no gradients left, the forward state restored,
        the scaler ready for the next step."""

    def unscale(self, grads: Any, scale: Any) -> Any:
        """The gradients divided by ``scale`` (once, for the whole window)."""

    def observe(self, grads: Any, scale: Any) -> dict[str, Any]:
        """The unscaled gradients' statistics on a statistics step, or their finite flags on a
        logged one (before clipping, at the step's scale): entries added to the step's raw
        values (``"stats"``, ``"grad_flags"``), which the backend takes back out; ``{}``."""

    def finite(self, grads: Any, scale: Any) -> tuple[Any, Any]:
        """``(grads, grads_finite)``: whether every unscaled gradient element is finite, on
        every replica; a backend that all-reduces the gradients here returns the reduced ones
        (and the flag covers them too)."""

    def global_norm(self, grads: Any, grads_finite: Any) -> tuple[Any, Any]:
        """``(norm, grads_finite)``: the global L2 norm (float32) of the unscaled gradients,
        over all replicas, rescaled by :data:`NORM_RESCALE_ABOVE`'s rule; and the gradients'
        finite flag, false too where the norm is not finite."""

    def clip(self, grads: Any, norm: Any, max_norm: float) -> Any:
        """The gradients times ``min(1, max_norm / norm)``."""

    def apply(self, grads: Any, grads_finite: Any, loss_finite: Any) -> Any:
        """The guarded update: parameters and optimizer state change only where the loss and
        every gradient are finite (``schedule_counts`` says what a skipped step does to the
        counters); returns ``applied`` (a device bool)."""

    def restore_forward_state(self, saved: Any, applied: Any) -> None:
        """Selects the saved forward state back where the step was skipped."""

    def params_finite(self) -> Any:
        """Whether every half-precision trainable parameter is finite after the update (a
        device bool), or None where the parameters are all float32 (not checked: no op is
        added to those steps). An applied step whose gradients were finite can still write
        inf / NaN into half parameters (an optimizer computing in the parameters' dtype);
        :attr:`unimp.StepResult.params_finite`, the step log and the doctor report it."""

    def update_scale(self, grads_finite: Any, loss_finite: Any) -> dict[str, Any]:
        """Runs the loss-scale rule (:func:`unimp.loss_scale.update_arrays`) and returns the
        report's fields it decides: ``consecutive_skips``, ``total_skips`` and, where the
        config's ``floor_action`` needs them, ``floor_hits`` (:func:`unimp.step.floor_hits`).
        A backend whose update decides more of the report returns those fields too, and they
        replace the step's own: torch's fused update reports the scale and flags from one
        snapshot; TensorFlow's update under a strategy reports the flags agreed by every
        replica in its ``merge_call``."""


def run_step(ops: StepPrimitives, micro: list[Any], options: StepOptions) -> dict[str, Any]:
    """One training step: the algorithm every backend runs (see the module docstring).

    Scale the loss, backward over the window's micro-batches, unscale once, check the
    gradients (agreed over the replicas), clip the unscaled gradients, apply the update only
    where the loss and every gradient are finite, keep the forward pass's state only where
    applied, update the loss scale.

    Args:
        ops: the backend's primitives (:class:`StepPrimitives`).
        micro: the window's micro-batches (:meth:`StepOptions.micro_batches`).
        options: the step's checked options.

    Returns:
        The step's raw device values: one per name of :data:`unimp.step.STEP_FIELDS`, the
        floor fields where the config needs them, ``params_finite`` where the parameters
        include half-precision ones, and what :meth:`StepPrimitives.observe` added; a backend builds its :class:`unimp.StepResult` from them.
    """
    scale = ops.begin()
    saved = ops.save_forward_state()
    try:  # anything that raises before the update leaves nothing behind (ops.abort)
        update = _update(ops, micro, options, scale)
    except BaseException:
        ops.abort(saved)
        raise
    return _finish(ops, saved, scale, update)


def run_step_traced(ops: StepPrimitives, micro: list[Any], options: StepOptions, saved: Any) -> dict[str, Any]:
    """:func:`run_step` for a compiler that cannot resume its graph after a break inside a
    ``try`` block: the same phases in the same order, with the ``try`` and the forward state's
    save left to the caller.

    ``torch.compile`` is one (CPython 3.11+ exception tables; ``torch.optim``'s step breaks the
    graph on purpose, inside the update phase): with the ``try`` there, it compiles up to the
    ``try`` and the rest phase by phase. The caller saves the forward state before the call
    (:meth:`StepPrimitives.save_forward_state`), passes it in (selected back on a skipped step),
    and undoes a call that raised, as a whole, with it (:meth:`StepPrimitives.abort`): one save
    serves both.

    Args:
        ops, micro, options: as :func:`run_step`.
        saved: what the caller's ``ops.save_forward_state()`` returned.

    Returns:
        As :func:`run_step`.
    """
    scale = ops.begin()
    return _finish(ops, saved, scale, _update(ops, micro, options, scale))


def _update(ops: StepPrimitives, micro: list[Any], options: StepOptions, scale: Any) -> tuple[Any, ...]:
    """The phases :func:`run_step` undoes when they raise: the window's gradients up to the
    guarded update. Returns ``(loss, loss_finite, grads_finite, grad_norm, applied, observed)``."""
    grads, loss, loss_finite = ops.gradients(micro, scale)
    grads = ops.unscale(grads, scale)
    observed = ops.observe(grads, scale)
    grads, grads_finite = ops.finite(grads, scale)
    grad_norm = None
    if options.max_grad_norm is not None:
        grad_norm, grads_finite = ops.global_norm(grads, grads_finite)
        grads = ops.clip(grads, grad_norm, options.max_grad_norm)
    applied = ops.apply(grads, grads_finite, loss_finite)
    return loss, loss_finite, grads_finite, grad_norm, applied, observed


def _finish(ops: StepPrimitives, saved: Any, scale: Any, update: tuple[Any, ...]) -> dict[str, Any]:
    """The phases after the update (the forward state, the parameters' check, the loss-scale
    update) and the step's raw values."""
    loss, loss_finite, grads_finite, grad_norm, applied, observed = update
    ops.restore_forward_state(saved, applied)
    params_finite = ops.params_finite()
    reported = ops.update_scale(grads_finite, loss_finite)
    raw = {
        "loss": loss,
        "scale": scale,
        "applied": applied,
        "loss_finite": loss_finite,
        "grads_finite": grads_finite,
        "grad_norm": grad_norm,
    }
    if params_finite is not None:
        raw["params_finite"] = params_finite
    raw.update(reported)
    raw.update(observed)
    return raw
