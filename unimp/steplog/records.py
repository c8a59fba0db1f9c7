"""Step-log records: the format tag, the keys and the check of one step record (see
:mod:`unimp.steplog`). Framework-free."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np

#: The format tag on every line; the number after the slash is the version.
STEPLOG_FORMAT = "unimp.steplog/1"
_FAMILY = "unimp.steplog/"

#: The keys of a step record, in the order written. The first nine are required by
#: :meth:`StepLogWriter.write` (``step`` and :data:`unimp.step.STEP_FIELDS`); the last five
#: default to ``null`` when left out (``params_finite``: the half-precision parameters were
#: finite after the step, :attr:`unimp.StepResult.params_finite`; null: none to check).
STEP_KEYS = (
    *("step", "loss", "scale", "applied", "loss_finite", "grads_finite", "grad_norm"),
    *("consecutive_skips", "total_skips", "batch_finite", "lr", "nonfinite", "params_finite", "stats"),
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
    except OverflowError:  # an int past float64's range: JSON allows any number of digits
        raise ValueError(
            f"{key!r} must be a number within float64 range (about 1.8e308), got an integer of "
            f"{len(str(abs(int(v))))} digits"
        ) from None
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
        ValueError: a missing or unknown key, a value of the wrong type, or values no train
            step produces (a negative ``grad_norm``, ``consecutive_skips`` above
            ``total_skips``, ``applied`` with ``loss_finite`` or ``grads_finite`` false),
            naming the key.
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
    out = {
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
        "params_finite": _bool("params_finite", record.get("params_finite"), True),
        "stats": _stats(record.get("stats")),
    }
    _check_consistent(out)
    return out


def _check_consistent(r: dict[str, Any]) -> None:
    """What no train step can produce, in a record whose values each have the right type: a
    negative norm, more skips in a row than in all, an applied step that was not finite (the
    loss-scale rule applies a step only when its loss and gradients are finite:
    ``applied = grads_finite & loss_finite`` in :func:`unimp.loss_scale.rule.update_arrays`).
    A non-finite norm is possible (read as null), a negative one is not."""
    if r["grad_norm"] is not None and r["grad_norm"] < 0:
        raise ValueError(
            f"'grad_norm' must be >= 0 or null (an L2 norm), got {r['grad_norm']!r}"
        )
    if r["consecutive_skips"] > r["total_skips"]:
        raise ValueError(
            f"'consecutive_skips' ({r['consecutive_skips']}) must not exceed 'total_skips' "
            f"({r['total_skips']}): the skips in a row are among all the skips"
        )
    for key in ("loss_finite", "grads_finite"):
        if r["applied"] and not r[key]:
            raise ValueError(
                f"'applied' is true but {key!r} is false: a step with a non-finite loss or "
                "gradients is skipped, never applied"
            )
