"""How a run ended, for the step log's end line, and what ends a run outside a ``close()``:
the interpreter exiting after an uncaught exception, and ``SIGTERM``.

A log's end line says ``"status"``: ``"completed"`` (closed by ``close()``, a ``with`` block or
the interpreter exiting normally), ``"exception"`` (with the exception's type: a ``with`` block
left by one, or the interpreter exiting on an uncaught one) or ``"interrupted"``
(``KeyboardInterrupt``, or ``SIGTERM``: ``"signal": "SIGTERM"``), and ``"last_step"``.

``SIGTERM`` (what schedulers and ``docker stop`` send) is handled while a log is open, in the
main thread: every open log's buffered steps are read and written, then the handler that was
installed before runs (a Python handler the user installed is called, and the logs are closed
at exit as ``"interrupted"``); with Python's default action the logs are closed (the end line
``"interrupted"``) and the signal is raised again with the default action, so the process ends
as it would have (exit status 143, ``-15`` for its parent). A handler installed after the
first log was opened replaces unimp's, as any later ``signal.signal`` does.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import weakref
from typing import Any

#: the end line's ``status`` values
STATUSES = ("completed", "exception", "interrupted")

_state: dict[str, Any] = {"ending": None, "atexit": False, "previous": None}
_lock = threading.Lock()
_recorders: weakref.WeakSet = weakref.WeakSet()  # objects with flush(): drained first
_writers: weakref.WeakSet = weakref.WeakSet()  # StepLogWriter: flushed or closed after


def ending_of(error: BaseException | None) -> dict[str, Any]:
    """The end line's fields for a run ended by ``error`` (``None``: how the process is ending,
    ``"completed"`` unless an uncaught exception or ``SIGTERM`` is ending it)."""
    if error is None:
        return dict(_state["ending"] or {"status": "completed"})
    if isinstance(error, KeyboardInterrupt):
        return {"status": "interrupted", "exception": "KeyboardInterrupt"}
    return {"status": "exception", "exception": type(error).__name__}


def _at_exit() -> None:
    # runs before weakref.finalize's exit hook (atexit is last in, first out): the finalizers
    # that close never-closed logs then know whether an uncaught exception is ending the run
    if _state["ending"] is None:
        error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if error is not None:
            _state["ending"] = ending_of(error)


def _on_sigterm(signum: int, frame: Any) -> None:
    _state["ending"] = {"status": "interrupted", "signal": "SIGTERM"}
    previous = _state["previous"]
    for recorder in list(_recorders):
        try:
            recorder.flush()
        except Exception:  # noqa: BLE001 - a log must not keep the process from ending
            pass
    for writer in list(_writers):
        try:
            writer.flush() if callable(previous) else writer.close()
        except Exception:  # noqa: BLE001
            pass
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def track(writer: Any = None, recorder: Any = None) -> None:
    """Registers an open log (a writer, or a recorder buffering device values for one) for the
    exit and ``SIGTERM`` handling above; installs both once, the signal handler in the main
    thread only and only where ``SIGTERM`` is not ignored."""
    if writer is not None:
        _writers.add(writer)
    if recorder is not None:
        _recorders.add(recorder)
    with _lock:
        if not _state["atexit"]:
            _state["atexit"] = True
            atexit.register(_at_exit)
        if threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGTERM)
        if current is _on_sigterm or current in (signal.SIG_IGN, None):
            return
        _state["previous"] = current if callable(current) else None
        signal.signal(signal.SIGTERM, _on_sigterm)
