"""What a train step's ``log=`` option runs: each step's device values, written every k steps.

Framework-free. A backend's train step hands :meth:`StepRecorder.add` the step's
:class:`~unimp.step.StepResult` (device values, unread), the learning rate where the optimizer
exposes it, and whether the batch was finite (a device bool); nothing is read from the device
until :meth:`StepRecorder.flush`, every ``every`` steps, when the buffered steps are converted
at once (one wait for the device per ``every`` steps) and written as step records
(``docs/steplog.md``). Nothing is lost: :meth:`close`, and a flush when the recorder is
garbage collected or the interpreter exits.

The first non-finite layer of a non-finite step: on a step with statistics (``stats_every``),
the first layer output in forward order with a non-finite element, else the first gradient in
backward order (the parameters' order reversed); on the other logged steps whose loss was finite
and gradients were not, the first gradient in backward order from one finite flag per gradient,
which the step computes on the device only when it logs (a forward overflow on such a step
names no layer: only statistics see the activations).
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from unimp.stats import first_nonfinite, first_nonfinite_gradient
from unimp.step import _KIND, STEP_FIELDS, StepResult
from unimp.steplog import StepLogWriter
from unimp.steplog.ending import track

__all__ = ["LoggedStep", "StepRecorder", "check_log_every", "with_log"]



def check_log_every(log: Any, log_every: Any) -> int:
    """Validates the ``log`` / ``log_every`` options of every backend's ``train_step``.

    Raises:
        ValueError: ``log_every`` is not an int >= 1, or ``log`` is not ``None``, a path or a
            :class:`~unimp.steplog.StepLogWriter`.
    """
    import numpy as np

    if isinstance(log_every, bool) or not isinstance(log_every, (int, np.integer)) or log_every < 1:
        raise ValueError(f"log_every must be an int >= 1, got {log_every!r}.")
    if log is not None and not isinstance(log, (str, StepLogWriter)) and not hasattr(log, "__fspath__"):
        raise ValueError(
            f"log must be None, a file path or a unimp.steplog.StepLogWriter, got {type(log).__name__}."
        )
    if isinstance(log, str) and not log.strip():
        raise ValueError("log must be None, a file path or a unimp.steplog.StepLogWriter, got ''.")
    return int(log_every)


def _host_fields(result: StepResult) -> dict[str, Any]:
    raw, to_host = result.raw, result._to_host
    return {f: None if raw[f] is None else _KIND[f](to_host(raw[f])) for f in STEP_FIELDS}


def _bools(flags: Any, to_host: Callable[[Any], Any]) -> list[bool]:
    """A device bool vector as a list, in one read (torch and JAX arrays have ``tolist``)."""
    host = flags.tolist() if hasattr(flags, "tolist") else to_host(flags)
    return [bool(f) for f in host]


def _drain(pending: list, writer: StepLogWriter, to_host: Callable[[Any], Any], close: bool) -> None:
    try:
        for index, result, lr, batch_finite, grad_flags in pending:
            rec = _host_fields(result)
            rec["step"] = index
            rec["lr"] = None if lr is None else float(to_host(lr))
            rec["batch_finite"] = None if batch_finite is None else bool(to_host(batch_finite))
            stats = result.stats
            rec["stats"] = stats
            rec["nonfinite"] = None
            rec["params_finite"] = result.params_finite
            finite = rec["loss_finite"] and rec["grads_finite"]
            found = None
            if not finite and stats is not None:
                found = first_nonfinite(stats.to_dict())
            elif rec["loss_finite"] and not rec["grads_finite"] and grad_flags is not None:
                names, flags = grad_flags
                found = first_nonfinite_gradient(names, _bools(flags, to_host))
            if found is not None:
                rec["nonfinite"] = dict(zip(("phase", "layer", "tensor"), found, strict=True))
            if rec["loss"] is not None and not math.isfinite(rec["loss"]):
                rec["loss"] = None
            writer.write(rec)
        pending.clear()
        writer.flush()
    finally:
        if close:
            writer.close()


class StepRecorder:
    """Buffers a train step's results and writes them as step-log records every ``every`` steps.

    Args:
        log: a path (the log file, replaced) or a :class:`~unimp.steplog.StepLogWriter` (not
            closed by :meth:`close`: its owner closes it).
        every: steps buffered between writes (the only host syncs the log adds).
        backend, framework_version, recipe, loss_scale: the run header (see
            :class:`~unimp.steplog.StepLogWriter`).
        to_host: converts one device value to a host value (the backend's).
    """

    def __init__(
        self,
        log: Any,
        *,
        every: int,
        backend: str,
        framework_version: str,
        recipe: Any,
        loss_scale: Any,
        to_host: Callable[[Any], Any],
    ) -> None:
        owned = not isinstance(log, StepLogWriter)
        self.writer = (
            StepLogWriter(
                log, backend=backend, framework_version=framework_version, recipe=recipe,
                loss_scale=loss_scale, flush_every=every,
            )  # fmt: skip
            if owned
            else log
        )
        self.every = every
        self._owned = owned
        self._to_host = to_host
        self._pending: list = []
        self._warned = False
        self._finalizer = weakref.finalize(self, _drain, self._pending, self.writer, to_host, owned)
        track(recorder=self)  # SIGTERM reads and writes the buffered steps

    def add(
        self,
        index: int,
        result: StepResult,
        *,
        lr: Any = None,
        batch_finite: Any = None,
        grad_flags: tuple[list[str], Any] | None = None,
    ) -> None:
        """Keeps one step (device values, unread); writes the buffer every ``every`` steps.
        After :meth:`close` the step is not logged, with a warning (once).

        Args:
            index: the step's number (0-based calls of the train step).
            result: the step's result, its values still on the device.
            lr: the learning rate (a device scalar or a number) where the optimizer exposes it.
            batch_finite: a device bool: the batch held no inf or NaN.
            grad_flags: ``(names, flags)``: the gradients' names in the parameters' order and a
                device bool vector, one finite flag per gradient (the step computes it when it
                logs); names the first non-finite gradient on a step without statistics.
        """
        if not self._finalizer.alive:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"step {index} runs after the step log {self.writer.path!r} was closed: it "
                    "and later steps are not logged (build a new train step with log=...).",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return
        self._pending.append((index, result, lr, batch_finite, grad_flags))
        if len(self._pending) >= self.every:
            self.flush()

    def flush(self) -> None:
        """Reads the buffered steps from the device and writes them."""
        _drain(self._pending, self.writer, self._to_host, close=False)

    def close(self, error: BaseException | None = None) -> None:
        """Writes what is buffered and the end line (a writer passed in is left open).

        Args:
            error: the exception that ended the run, if one did (the end line says so; see
                :meth:`StepLogWriter.close`).
        """
        if self._finalizer.detach() is not None:
            try:
                _drain(self._pending, self.writer, self._to_host, close=False)
            finally:
                if self._owned:
                    self.writer.close(error)


class LoggedStep:
    """What every backend's train step has for ``log=``: the recorder :func:`with_log`
    attaches (None without a log) and :meth:`close`."""

    _recorder: StepRecorder | None = None

    def close(self, error: BaseException | None = None) -> None:
        """Writes what the step log (``log=``) still holds, and its end line.

        Args:
            error: the exception that ended the run, if one did: the end line records it
                (``"exception"`` with its type, ``"interrupted"`` for a ``KeyboardInterrupt``).
        """
        if self._recorder is not None:
            self._recorder.close(error)


def with_log(step: Any, mp: Any, log: Any, log_every: int, config: Any, to_host: Callable[[Any], Any]) -> Any:
    """Attaches a :class:`StepRecorder` to a train step built by ``mp.train_step`` (after the
    step was built, so a failed build writes no file)."""
    if log is not None:
        from unimp import registry

        module = registry.get_backend(mp.backend)
        step._recorder = StepRecorder(
            log, every=log_every, backend=mp.backend, framework_version=module.framework_version(),
            recipe=mp.recipe, loss_scale=config, to_host=to_host,
        )  # fmt: skip
    return step
