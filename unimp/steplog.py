"""The step log: one JSON Lines record per training step, the same in every backend. Framework-free.

A step log is a UTF-8 text file, one JSON object per line, every object tagged
``"format": "unimp.steplog/1"`` and a ``"kind"``:

* line 1, ``"run"``: the header (backend, framework version, unimp version, recipe, loss-scale
  config, start time, label);
* one ``"step"`` record per training step, in step order: loss, scale, applied, the finiteness
  flags, grad norm, skip counters, learning rate, the first layer that went non-finite and the
  tensor statistics (:mod:`unimp.stats`) where they were taken;
* last, ``"end"``, written by :meth:`StepLogWriter.close`. A log without it was not closed (the
  run crashed or was killed): ``unimp doctor`` warns and diagnoses what is there.

Non-finite floats are never written (``NaN`` and ``Infinity`` are not JSON): they are ``null``,
and the flags say what happened. ``pandas.read_json(path, lines=True)`` reads a log (one row
per line; the header's and end's columns are empty on the step rows). The format and every key
are documented in ``docs/steplog.md``; ``unimp doctor`` (:mod:`unimp.doctor`) diagnoses logs.
"""

from __future__ import annotations

import datetime
import io
import json
import math
import operator
import os
import threading
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "STEPLOG_FORMAT",
    "STEP_KEYS",
    "StepLog",
    "StepLogWarning",
    "StepLogWriter",
    "read_steplog",
]

#: The format tag on every line; the number after the slash is the version.
STEPLOG_FORMAT = "unimp.steplog/1"
_FAMILY = "unimp.steplog/"

#: The keys of a step record, in the order written. The first nine are required by
#: :meth:`StepLogWriter.write` (``step`` and :data:`unimp.step.STEP_FIELDS`); the last four
#: default to ``null`` when left out.
STEP_KEYS = (
    *("step", "loss", "scale", "applied", "loss_finite", "grads_finite", "grad_norm"),
    *("consecutive_skips", "total_skips", "batch_finite", "lr", "nonfinite", "stats"),
)
_REQUIRED = STEP_KEYS[:9]  # "step" and unimp.step.STEP_FIELDS (a test checks they match)
_PHASES = ("forward", "backward")


class StepLogWarning(UserWarning):
    """A step log is readable but incomplete: a cut-off last line, no end line, a line kind
    this version does not know, or ``NaN``/``Infinity`` where ``null`` belongs."""


# ---------------------------------------------------------------- values: checked, JSON-able


def _json_value(x: Any) -> Any:
    """Plain JSON values: NumPy scalars as Python ones, non-finite floats as None, tuples as
    lists, recursively (statistics, recipe and config dicts)."""
    if isinstance(x, Mapping):
        return {str(k): _json_value(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_value(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if x is None or isinstance(x, str):
        return x
    if hasattr(x, "to_dict"):
        return _json_value(x.to_dict())
    raise ValueError(f"{type(x).__name__} is not JSON-able")


def _float(key: str, v: Any, nullable: bool) -> float | None:
    if v is None and nullable:
        return None
    if isinstance(v, (bool, np.bool_, str)) or v is None:
        raise ValueError(f"{key!r} must be a number{' or null' if nullable else ''}, got {v!r}")
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{key!r} must be a number, got {type(v).__name__}") from None
    if not math.isfinite(f):
        if not nullable:
            raise ValueError(f"{key!r} must be finite, got {v!r}")
        return None
    return f


def _int(key: str, v: Any) -> int:
    if not isinstance(v, (bool, np.bool_)):
        try:
            i = operator.index(v)
            if i >= 0:
                return i
        except TypeError:
            pass
    raise ValueError(f"{key!r} must be an int >= 0, got {v!r}")


def _bool(key: str, v: Any, nullable: bool = False) -> bool | None:
    if v is None and nullable:
        return None
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    raise ValueError(f"{key!r} must be true or false{' or null' if nullable else ''}, got {v!r}")


def _nonfinite(v: Any) -> dict[str, str] | None:
    if v is None:
        return None
    if not isinstance(v, Mapping) or set(v) != {"phase", "layer", "tensor"}:
        raise ValueError(f"'nonfinite' must be null or {{phase, layer, tensor}}, got {v!r}")
    if v["phase"] not in _PHASES:
        raise ValueError(f"'nonfinite.phase' must be 'forward' or 'backward', got {v['phase']!r}")
    for k in ("layer", "tensor"):
        if not isinstance(v[k], str) or not v[k]:
            raise ValueError(f"'nonfinite.{k}' must be a non-empty string, got {v[k]!r}")
    return {"phase": v["phase"], "layer": v["layer"], "tensor": v["tensor"]}


def _stats(v: Any) -> dict[str, Any] | None:
    """``StepStats.to_dict()`` (or a :class:`~unimp.stats.StepStats`) as JSON values, its shape
    checked: ``gradients`` and ``activations`` map names to tensor dicts with ``counts``."""
    if v is None:
        return None
    if not isinstance(v, Mapping) and not hasattr(v, "to_dict"):
        raise ValueError(f"'stats' must be null or StepStats.to_dict(), got {type(v).__name__}")
    out = _json_value(v)
    for group in ("gradients", "activations"):
        tensors = out.get(group)
        if not isinstance(tensors, dict) or not all(
            isinstance(t, dict) and isinstance(t.get("counts"), dict) for t in tensors.values()
        ):
            raise ValueError(f"'stats.{group}' must map names to TensorStats.to_dict()")
    return out


def check_step_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """A step record checked and converted to plain JSON values, keys in :data:`STEP_KEYS`
    order, the optional keys filled with None: what the writer writes and the reader returns.

    Args:
        record: the record; ``format`` and ``kind`` may be there (they must then be the step
            log's) or not.

    Raises:
        ValueError: a missing or unknown key, or a value of the wrong type, naming the key.
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"a step record must be a dict, got {type(record).__name__}")
    extra = sorted(set(record) - set(STEP_KEYS) - {"format", "kind"})
    if extra:
        raise ValueError(f"unknown key(s) {extra}; a step record has {list(STEP_KEYS)}")
    if (
        record.get("format", STEPLOG_FORMAT) != STEPLOG_FORMAT
        or record.get("kind", "step") != "step"
    ):
        raise ValueError("'format' and 'kind' must be 'unimp.steplog/1' and 'step' where given")
    missing = [k for k in _REQUIRED if k not in record]
    if missing:
        raise ValueError(f"missing key(s) {missing}; a step record needs {list(_REQUIRED)}")
    scale = _float("scale", record["scale"], False)
    if scale <= 0:
        raise ValueError(f"'scale' must be > 0, got {scale!r}")
    return {
        "format": STEPLOG_FORMAT,
        "kind": "step",
        "step": _int("step", record["step"]),
        "loss": _float("loss", record["loss"], True),
        "scale": scale,
        "applied": _bool("applied", record["applied"]),
        "loss_finite": _bool("loss_finite", record["loss_finite"]),
        "grads_finite": _bool("grads_finite", record["grads_finite"]),
        "grad_norm": _float("grad_norm", record["grad_norm"], True),
        "consecutive_skips": _int("consecutive_skips", record["consecutive_skips"]),
        "total_skips": _int("total_skips", record["total_skips"]),
        "batch_finite": _bool("batch_finite", record.get("batch_finite"), True),
        "lr": _float("lr", record.get("lr"), True),
        "nonfinite": _nonfinite(record.get("nonfinite")),
        "stats": _stats(record.get("stats")),
    }


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


class StepLogWriter:
    """Writes a step log: the run header now, step records as they come, the end line on close.

    Records are buffered and written every ``flush_every`` records (and by :meth:`flush`).
    Nothing buffered is lost: :meth:`close` (and leaving a ``with`` block, also on an
    exception) writes the rest and the end line; a writer never closed is flushed when it is
    garbage collected and at interpreter exit (``weakref.finalize``, which holds no reference
    to the writer), without an end line, so ``unimp doctor`` says the run was not closed. Only
    a killed process (``SIGKILL``, ``os._exit``) loses the records still buffered.

    An existing file is replaced (``overwrite=True``, the default), as a log file of a new
    run; ``overwrite=False`` refuses it with ``FileExistsError``. Every argument is checked
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
        ValueError: a bad argument, naming it; ``OSError`` when the file cannot be opened.

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
            file = open(path, "w" if overwrite else "x", encoding="utf-8", newline="\n")
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

    def close(self) -> None:
        """Writes the buffered records and the end line, and closes a file it opened.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        end = {"format": STEPLOG_FORMAT, "kind": "end", "steps": self._steps, "ended": _now()}
        self._sink.lines.append(json.dumps(end) + "\n")
        self._finalizer()  # flush, close the file if owned; runs once, never again at exit

    def __enter__(self) -> StepLogWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"StepLogWriter({self.path!r}, {self._steps} steps, {state})"


# ---------------------------------------------------------------- the reader


@dataclass
class StepLog:
    """A step log read by :func:`read_steplog`.

    Attributes:
        path: the file read.
        run: the header (line 1) as a dict.
        steps: the step records, in order, each with every key of :data:`STEP_KEYS`.
        ended: the end line was there (the run was closed).
        end: the end line, or None.
        warnings: what was wrong but readable, one line each (also issued as
            :class:`StepLogWarning`).
        loss_scale: the loss-scale config (``to_dict()`` form, checked): the header's, else
            its recipe's; None when neither has a readable one.
    """

    path: str
    run: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    ended: bool = False
    end: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)
    loss_scale: dict[str, Any] | None = None

    @property
    def backend(self) -> str:
        return str(self.run.get("backend"))

    @property
    def label(self) -> str | None:
        return self.run.get("label")

    def to_frame(self) -> Any:
        """The step records as a ``pandas.DataFrame``, one row per step (pandas is optional).

        Raises:
            ImportError: pandas is not installed.
        """
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("StepLog.to_frame needs pandas: pip install pandas") from None
        return pd.DataFrame(self.steps, columns=list(STEP_KEYS))


def read_steplog(path: str | os.PathLike[str]) -> StepLog:
    """Reads a step log written by :class:`StepLogWriter` (any backend).

    A cut-off last line (the run stopped while writing it) is skipped with a warning, and so
    is a line of a kind this version does not know; a log without its end line is read with a
    warning. Everything else that is wrong is an error naming the file and the line.

    Args:
        path: the ``.jsonl`` file.

    Returns:
        :class:`StepLog`.

    Raises:
        ValueError: a missing, unreadable or empty file; a first line that is not the run
            header; another format or version; a malformed line before the last; a bad record;
            steps out of order; a line after the end line. One line, naming the fix.
    """
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ValueError(
            f"{p}: no such file; pass a step log (JSON Lines, {STEPLOG_FORMAT})"
        ) from None
    except IsADirectoryError:
        raise ValueError(f"{p}: is a folder; pass a step log file") from None
    except OSError as e:
        raise ValueError(f"{p}: cannot be read ({e.strerror or e})") from None
    numbered = [(i + 1, raw) for i, raw in enumerate(data.split(b"\n")) if raw.strip()]
    if not numbered:
        raise ValueError(f"{p}: the file is empty, not a step log (the run wrote nothing)")
    log = StepLog(p, {})
    nan_lines: list[int] = []

    def warn(msg: str) -> None:
        log.warnings.append(msg)
        warnings.warn(msg, StepLogWarning, stacklevel=3)

    def parse(lineno: int, raw: bytes) -> dict[str, Any] | None:
        def constant(name: str) -> None:
            nan_lines.append(lineno)  # NaN / Infinity: not JSON; read as null
            return None

        try:
            obj = json.loads(raw.decode("utf-8"), parse_constant=constant)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if lineno == numbered[-1][0] and lineno != numbered[0][0]:
                warn(f"{p}: line {lineno} is cut off (the run stopped while writing it); skipped")
                return None
            why = getattr(e, "msg", None) or str(e)
            raise ValueError(
                f"{p}: line {lineno} is not a JSON object ({why}); a step log holds one per "
                "line: fix or delete the line"
            ) from None
        if not isinstance(obj, dict):
            raise ValueError(f"{p}: line {lineno} is not a JSON object; fix or delete the line")
        fmt = obj.get("format")
        if isinstance(fmt, str) and fmt.startswith(_FAMILY) and fmt != STEPLOG_FORMAT:
            raise ValueError(
                f"{p}: line {lineno} has format {fmt!r}; this unimp reads {STEPLOG_FORMAT!r}: "
                "read it with the unimp that wrote it, or upgrade unimp"
            )
        if fmt != STEPLOG_FORMAT:
            raise ValueError(
                f'{p}: line {lineno} is not a unimp step log line (no "format": '
                f'"{STEPLOG_FORMAT}"); pass a log written by unimp'
            )
        return obj

    first_no, first_raw = numbered[0]
    header = parse(first_no, first_raw)
    if header is None or header.get("kind") != "run":
        kind = None if header is None else header.get("kind")
        raise ValueError(
            f"{p}: line {first_no} must be the run header (kind 'run'), got kind {kind!r}: "
            "the start of the log is missing"
        )
    if not isinstance(header.get("backend"), str):
        raise ValueError(f"{p}: line {first_no}: the run header has no 'backend' string")
    log.run = header
    recipe = header.get("recipe")
    cfg = header.get("loss_scale")
    if cfg is None and isinstance(recipe, Mapping):
        cfg = recipe.get("loss_scale")
    if cfg is not None:
        from unimp.loss_scale import loss_scale_from_dict

        try:
            log.loss_scale = loss_scale_from_dict(cfg).to_dict()
        except (ValueError, TypeError) as e:
            warn(f"{p}: line {first_no}: the loss-scale config is not readable ({e}); ignored")
    for lineno, raw in numbered[1:]:
        obj = parse(lineno, raw)
        if obj is None:
            continue
        kind = obj.get("kind")
        if log.ended:
            raise ValueError(f"{p}: line {lineno} follows the end line; one run per file")
        if kind == "step":
            try:
                rec = check_step_record(obj)
            except ValueError as e:
                raise ValueError(f"{p}: line {lineno}: {e}") from None
            if log.steps and rec["step"] <= log.steps[-1]["step"]:
                raise ValueError(
                    f"{p}: line {lineno}: step {rec['step']} after step {log.steps[-1]['step']}; "
                    "steps go in order (two runs in one file? write each run to its own file)"
                )
            log.steps.append(rec)
        elif kind == "end":
            log.ended, log.end = True, obj
            n = obj.get("steps")
            if n != len(log.steps):
                warn(
                    f"{p}: line {lineno}: the end line counts {n!r} steps, the log {len(log.steps)}"
                )
        elif kind == "run":
            raise ValueError(f"{p}: line {lineno} is a second run header; one run per file")
        else:
            warn(f"{p}: line {lineno} has kind {kind!r}, unknown to this unimp; skipped")
    if nan_lines:
        warn(f"{p}: line {nan_lines[0]} holds NaN or Infinity, which is not JSON; read as null")
    if not log.ended:
        warn(
            f"{p}: no end line: the run was not closed (a crash, a kill, or no close()); "
            f"diagnosing the {len(log.steps)} steps logged"
        )
    return log
