"""The step log: one JSON Lines record per training step, the same in every backend. Framework-free.

A step log is a UTF-8 text file, one JSON object per line, every object tagged
``"format": "unimp.steplog/1"`` and a ``"kind"``:

* line 1, ``"run"``: the header (backend, framework version, unimp version, recipe, loss-scale
  config, start time, label);
* one ``"step"`` record per training step, in step order: loss, scale, applied, the finiteness
  flags, grad norm, skip counters, learning rate, the first layer that went non-finite and the
  tensor statistics (:mod:`unimp.stats`) where they were taken;
* last, ``"end"``, written by :meth:`StepLogWriter.close`, at interpreter exit or on
  ``SIGTERM``: how the run ended (``"status"``: ``"completed"``, ``"exception"`` with the
  exception's type, ``"interrupted"``; :mod:`unimp.steplog.ending`) and its last step. A log
  without it was not closed (the run was killed): ``unimp doctor`` warns and diagnoses what is
  there.

Non-finite floats are never written (``NaN`` and ``Infinity`` are not JSON): they are ``null``,
and the flags say what happened. ``pandas.read_json(path, lines=True)`` reads a log (one row
per line; the header's and end's columns are empty on the step rows). The format and every key
are documented in ``docs/steplog.md``; ``unimp doctor`` (:mod:`unimp.doctor`) diagnoses logs.
"""

from unimp.steplog.reader import StepLog, read_steplog
from unimp.steplog.records import STEP_KEYS, STEPLOG_FORMAT, StepLogWarning, check_step_record  # noqa: F401
from unimp.steplog.writer import StepLogBusyError, StepLogWriter

__all__ = [
    "STEPLOG_FORMAT",
    "STEP_KEYS",
    "StepLog",
    "StepLogBusyError",
    "StepLogWarning",
    "StepLogWriter",
    "read_steplog",
]
