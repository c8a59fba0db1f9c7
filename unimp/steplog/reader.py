"""Reading a step log: :func:`read_steplog` and :class:`StepLog` (see :mod:`unimp.steplog`).
Framework-free."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from unimp.steplog.records import (
    _FAMILY,
    STEP_KEYS,
    STEPLOG_FORMAT,
    StepLogWarning,
    check_step_record,
)


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
        recipe: the header's recipe read as ``Recipe.from_dict`` (a dict) or ``get_recipe``
            (a name) would, in ``Recipe.to_dict()`` form (its ``loss_scale`` the policy's
            default where the header's recipe leaves it out); None without a readable one (an
            unreadable one is a warning).
        loss_scale: the loss-scale config (``to_dict()`` form, checked): the header's, else
            its recipe's; None when neither has a readable one.
    """

    path: str
    run: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    ended: bool = False
    end: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)
    recipe: dict[str, Any] | None = None
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


def _read_recipe(recipe: Any) -> dict[str, Any]:
    """A header's ``recipe`` as ``Recipe.to_dict()``: a dict read by ``Recipe.from_dict`` (its
    ``loss_scale`` may be left out: the policy's default), or a name read by ``get_recipe``
    (not a recipe file: the log would then depend on a file it does not hold).

    Raises:
        ValueError: what ``Recipe.from_dict`` / ``get_recipe`` raise, or another type.
    """
    from unimp.recipe import Recipe, get_recipe

    if isinstance(recipe, str):
        if os.path.splitext(recipe)[1].lower() in (".toml", ".json"):
            raise ValueError("a recipe file's name; the log holds no recipe")
        return get_recipe(recipe).to_dict()
    if isinstance(recipe, Mapping):
        return Recipe.from_dict(recipe).to_dict()
    raise ValueError(f"a recipe is a dict or a name, got {type(recipe).__name__}")


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
        except (RecursionError, ValueError) as e:
            # valid JSON that Python will not read: nesting deeper than its recursion limit, or
            # an integer past its 4300-digit limit; no writer produces either, so never a cut-off
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(":")[0]
            raise ValueError(
                f"{p}: line {lineno} is not a readable JSON object ({why}); no step log holds "
                "such a line: fix or delete the line"
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
    label = header.get("label")
    if label is not None and not isinstance(label, str):
        raise ValueError(
            f"{p}: line {first_no}: the run header's 'label' must be a string or null (as "
            f"StepLogWriter writes it), got {type(label).__name__}; fix the line"
        )
    log.run = header
    recipe = header.get("recipe")
    if recipe is not None:
        try:
            log.recipe = _read_recipe(recipe)
        except (ValueError, TypeError) as e:
            shown = repr(recipe)
            shown = shown if len(shown) <= 120 else shown[:117] + "..."
            warn(
                f"{p}: line {first_no}: the recipe {shown} is not readable ({e}); ignored, "
                "its policy and loss-scale config unknown"
            )
    cfg = header.get("loss_scale")
    if cfg is not None:
        from unimp.loss_scale import loss_scale_from_dict

        try:
            log.loss_scale = loss_scale_from_dict(cfg).to_dict()
        except (ValueError, TypeError) as e:
            warn(f"{p}: line {first_no}: the loss-scale config is not readable ({e}); ignored")
    elif log.recipe is not None:
        log.loss_scale = log.recipe["loss_scale"]
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
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(
                    f"{p}: line {lineno}: the end line's 'steps' must be an int >= 0 (the step "
                    f"records written), got {n!r}; fix the line or delete it"
                )
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
