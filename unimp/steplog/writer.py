"""Writing a step log: :class:`StepLogWriter` (see :mod:`unimp.steplog`). Framework-free."""

from __future__ import annotations

import datetime
import io
import json
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

try:  # POSIX: a log in use is locked (on other systems it is not)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

from unimp.steplog.ending import ending_of, track
from unimp.steplog.records import (
    STEPLOG_FORMAT,
    _json_value,
    check_step_record,
)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _portable_config(loss_scale: Any) -> dict[str, Any] | None:
    """The loss-scale config dict: from a config, its ``to_dict()``, a portable state_dict
    (its ``"config"``), or a name; validated by :func:`unimp.loss_scale.loss_scale_from_dict`."""
    if loss_scale is None:
        return None
    from unimp.loss_scale import loss_scale_from_dict

    if isinstance(loss_scale, Mapping) and "config" in loss_scale and "format" in loss_scale:
        loss_scale = loss_scale["config"]
    return _json_value(loss_scale_from_dict(loss_scale).to_dict())


# ---------------------------------------------------------------- the writer


class _Sink:
    """What the writer's finalizer needs, without the writer (so the writer can be collected):
    the file, whether unimp opened it, the buffered lines and a lock."""

    def __init__(self, file: Any, owned: bool, binary: bool) -> None:
        self.file, self.owned, self.binary = file, owned, binary
        self.lines: list[str] = []
        self.lock = threading.Lock()

    def flush(self) -> None:
        with self.lock:
            if self.lines:
                text = "".join(self.lines)
                self.lines.clear()
                self.file.write(text.encode("utf-8") if self.binary else text)
            self.file.flush()

    def release(self) -> None:
        """Flushes, and closes a file unimp opened: at garbage collection and at interpreter
        exit (``weakref.finalize``), for a writer that was never closed. No end line."""
        try:
            if not getattr(self.file, "closed", False):
                self.flush()
        finally:
            if self.owned and not getattr(self.file, "closed", True):
                self.file.close()


class StepLogBusyError(OSError):
    """The log file is open in another :class:`StepLogWriter` (this process or another)."""


def _open_locked(path: str, overwrite: bool) -> Any:
    """Opens ``path`` for a new log under an exclusive lock (``flock``, POSIX), taken before
    the file is emptied: a log another run is writing is refused and left as it is. The lock
    goes with the file when it is closed (or the process ends)."""
    flags = os.O_WRONLY | os.O_CREAT | (0 if overwrite else os.O_EXCL)
    fd = os.open(path, flags, 0o666)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StepLogBusyError(
                    f"step log {path!r} is being written by another run; give each run its own "
                    "file (unimp compare: its own --log-dir)"
                ) from None
        os.ftruncate(fd, 0)
        return os.fdopen(fd, "w", encoding="utf-8", newline="\n")
    except BaseException:
        os.close(fd)
        raise


class StepLogWriter:
    """Writes a step log: the run header now, step records as they come, the end line on close.

    Records are buffered and written every ``flush_every`` records (and by :meth:`flush`).
    Nothing buffered is lost: :meth:`close` (and leaving a ``with`` block, also on an
    exception) writes the rest and the end line, which says how the run ended
    (``"status"``: ``"completed"``, ``"exception"`` with its type, ``"interrupted"``; see
    :mod:`unimp.steplog.ending`); a writer never closed is flushed when it is garbage
    collected and at interpreter exit (``weakref.finalize``, which holds no reference to the
    writer), without an end line, so ``unimp doctor`` says the run was not closed. ``SIGTERM``
    flushes every open log and writes its end line (``"interrupted"``). Only a killed process
    (``SIGKILL``, ``os._exit``) loses the records still buffered.

    An existing file is replaced (``overwrite=True``, the default), as a log file of a new
    run; ``overwrite=False`` refuses it with ``FileExistsError``. A file another writer has
    open (another run, or this one) is refused with :class:`StepLogBusyError` and left as it
    is: the writer holds an exclusive ``flock`` lock on its file while it is open (POSIX; on
    Windows there is no lock). Every argument is checked
    before the file is opened, so a bad call or a failed open leaves an existing file as it was.

    Args:
        path_or_file: a path (str or ``os.PathLike``), or an open text or binary file, which
            is flushed but never closed (its owner closes it).
        backend: the framework that ran the step (``"torch"``, ``"tensorflow"``, ``"jax"``
            or another name).
        framework_version: the framework's version string.
        recipe: ``None``, a :class:`unimp.Recipe`, its ``to_dict()``, or a recipe name.
        loss_scale: ``None``, a loss-scale config, its ``to_dict()``, a portable
            ``state_dict`` (its ``"config"`` is kept), or a name (``"dynamic"``).
        label: ``None`` or a string naming the run (``unimp doctor`` shows it).
        flush_every: int >= 1, records buffered between writes.
        overwrite: replace an existing file (default), else ``FileExistsError``.

    Raises:
        ValueError: a bad argument, naming it; ``OSError`` when the file cannot be opened
        (:class:`StepLogBusyError` when another writer has it open).

    Example:
        >>> import io
        >>> buf = io.StringIO()
        >>> w = StepLogWriter(buf, backend="jax", framework_version="0.4.30", flush_every=10)
        >>> w.close(); w.close()  # idempotent
        >>> [line[:44] for line in buf.getvalue().splitlines()][1]
        '{"format": "unimp.steplog/1", "kind": "end",'
    """

    def __init__(
        self,
        path_or_file: Any,
        *,
        backend: str,
        framework_version: str,
        recipe: Any = None,
        loss_scale: Any = None,
        label: str | None = None,
        flush_every: int = 100,
        overwrite: bool = True,
    ) -> None:
        if not isinstance(backend, str) or not backend:
            raise ValueError(f"backend must be a non-empty string, got {backend!r}")
        if not isinstance(framework_version, str):
            raise ValueError(f"framework_version must be a string, got {framework_version!r}")
        if label is not None and not isinstance(label, str):
            raise ValueError(f"label must be None or a string, got {label!r}")
        if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(f"flush_every must be an int >= 1, got {flush_every!r}")
        if isinstance(recipe, str):
            from unimp.recipe import get_recipe

            recipe = get_recipe(recipe)
        if (
            recipe is not None
            and not isinstance(recipe, Mapping)
            and not hasattr(recipe, "to_dict")
        ):
            raise ValueError(
                f"recipe must be None, a Recipe or a dict, got {type(recipe).__name__}"
            )
        import unimp

        header = {
            "format": STEPLOG_FORMAT,
            "kind": "run",
            "backend": backend,
            "framework_version": framework_version,
            "unimp": unimp.__version__,
            "recipe": None if recipe is None else _json_value(recipe),
            "loss_scale": _portable_config(loss_scale),
            "started": _now(),
            "label": label,
        }
        line = json.dumps(header, allow_nan=False) + "\n"
        if hasattr(path_or_file, "write"):
            binary = isinstance(path_or_file, (io.RawIOBase, io.BufferedIOBase)) or "b" in str(
                getattr(path_or_file, "mode", "")
            )
            sink = _Sink(path_or_file, owned=False, binary=binary)
            self.path = getattr(path_or_file, "name", None)
        else:
            path = os.fspath(path_or_file)
            file = _open_locked(path, overwrite)
            sink = _Sink(file, owned=True, binary=False)
            self.path = path
        self._sink = sink
        self._flush_every = flush_every
        self._steps = 0
        self._last_step: int | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _Sink.release, sink)
        sink.lines.append(line)
        sink.flush()  # the header is on disk before the first step: a crash still leaves a log
        track(writer=self)  # after the finalizer: SIGTERM and an uncaught exception are seen

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def steps(self) -> int:
        """Step records written (or buffered) so far."""
        return self._steps

    def write(self, record: Mapping[str, Any]) -> None:
        """Adds one step record (see :data:`STEP_KEYS` and ``docs/steplog.md``).

        Args:
            record: a dict with ``step`` (int >= 0, larger than the previous record's) and
                every key of :data:`unimp.step.STEP_FIELDS`; ``batch_finite``, ``lr``,
                ``nonfinite`` and ``stats`` are optional (``null``). Numbers may be NumPy
                scalars; non-finite floats (a NaN loss) are written as ``null``; ``stats`` may
                be a :class:`unimp.stats.StepStats` or its ``to_dict()``.

        Raises:
            ValueError: the log is closed, a key is missing or unknown, a value has the wrong
                type, or the step does not follow the previous one; nothing is written then.
        """
        if self._closed:
            raise ValueError("the step log is closed; open a new StepLogWriter")
        rec = check_step_record(record)
        if self._last_step is not None and rec["step"] <= self._last_step:
            raise ValueError(
                f"step {rec['step']} after step {self._last_step}: records go in step order"
            )
        line = json.dumps(rec, allow_nan=False) + "\n"
        self._last_step = rec["step"]
        self._steps += 1
        self._sink.lines.append(line)
        if len(self._sink.lines) >= self._flush_every:
            self._sink.flush()

    def flush(self) -> None:
        """Writes the buffered records and flushes the file."""
        if not self._closed:
            self._sink.flush()

    def close(self, error: BaseException | None = None) -> None:
        """Writes the buffered records and the end line, and closes a file it opened.
        Idempotent.

        Args:
            error: the exception that ended the run, if one did: the end line's ``status``
                is then ``"exception"`` with its type (``"interrupted"`` for a
                ``KeyboardInterrupt``). ``None``: ``"completed"``, unless the process is
                ending on an uncaught exception or ``SIGTERM`` (see
                :mod:`unimp.steplog.ending`).
        """
        if self._closed:
            return
        self._closed = True
        end = {
            "format": STEPLOG_FORMAT, "kind": "end", "steps": self._steps, "ended": _now(),
            **ending_of(error), "last_step": self._last_step,
        }  # fmt: skip
        self._sink.lines.append(json.dumps(end) + "\n")
        self._finalizer()  # flush, close the file if owned; runs once, never again at exit

    def __enter__(self) -> StepLogWriter:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"StepLogWriter({self.path!r}, {self._steps} steps, {state})"
