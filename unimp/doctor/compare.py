"""Several logs of one run (one per framework): :func:`diagnose` and where the logs agree."""

from __future__ import annotations

import os
import re
from typing import Any

from unimp.doctor.findings import CLASSES, Diagnosis, Finding, LogDiagnosis
from unimp.doctor.rules import diagnose_log
from unimp.steplog import StepLog


def same_layer(a: str | None, b: str | None) -> bool:
    """Layer paths agree when the shorter one's components end the other's (``model/l1`` and
    ``l1``; ``.`` and ``/`` both separate components)."""
    if a is None or b is None:
        return a is b
    pa, pb = re.split(r"[./]", a), re.split(r"[./]", b)
    n = min(len(pa), len(pb))
    return pa[-n:] == pb[-n:]


def _key(f: Finding) -> str:
    return f.cls + (":spike" if f.details.get("spike") else "")


def compare(logs: list[LogDiagnosis]) -> dict[str, Any]:
    """One row per finding class found in any log: found in every log, at the same first step,
    in the same layer? The normal isolated overflows (where float rounding lets the scale probe
    differs between frameworks), calibration bursts and ``nothing_wrong`` count by presence."""
    keys = {_key(f) for d in logs for f in d.findings}
    rows = []
    for k in sorted(keys, key=lambda k: (CLASSES.index(k.split(":")[0]), k)):
        per = {d.name: next((f for f in d.findings if _key(f) == k), None) for d in logs}
        got = [f for f in per.values() if f is not None]
        exact = any(f.severity != "info" for f in got)
        same = len(got) == len(logs) and (
            not exact
            or (
                len({f.step for f in got}) == 1
                and all(same_layer(got[0].layer, f.layer) for f in got)
            )
        )
        label = k.replace(":spike", " (spikes)")
        if same:
            where = f" at step {got[0].step}" if exact else ""
            where += f" in {got[0].layer}" if exact and got[0].layer else ""
            note = f"same: {label}{where}"
        else:
            parts = [
                f"{name} "
                + (
                    "none"
                    if f is None
                    else f"step {f.step}" + (f" in {f.layer}" if f.layer else "")
                )
                for name, f in per.items()
            ]
            note = f"differ: {label}: " + "; ".join(parts)
        per_log = {
            name: None if f is None else {"step": f.step, "layer": f.layer}
            for name, f in per.items()
        }
        rows.append(
            {
                "class": k.split(":")[0],
                "spike": k.endswith(":spike"),
                "agree": same,
                "note": note,
                "per_log": per_log,
            }
        )
    return {"logs": [d.name for d in logs], "agree": all(r["agree"] for r in rows), "rows": rows}


#: Relative difference of step 0's loss above which two logs are not the same weights and batch
#: (the frameworks agree to about 1e-3 at step 0 under float16: unimp compare's tolerance).
FIRST_LOSS_RTOL = 0.05


def _first_loss(log: StepLog) -> float | None:
    first = log.steps[0] if log.steps else None
    return first["loss"] if first is not None and first["step"] == 0 else None


def run_mismatch(logs: list[StepLog], names: list[str]) -> list[str]:
    """Why several logs may not be one run in several frameworks, one sentence each: another
    recipe or loss-scale config in the header, another number of steps, or a step-0 loss that
    differs by more than :data:`FIRST_LOSS_RTOL` (other weights or another batch). Empty when
    nothing says they differ."""
    ref, rname = logs[0], names[0]
    out = []
    for log, name in zip(logs[1:], names[1:], strict=True):
        if log.run.get("recipe") != ref.run.get("recipe"):
            out.append(f"{name} ran recipe {log.run.get('recipe')!r}, {rname} {ref.run.get('recipe')!r}")
        if log.loss_scale != ref.loss_scale:
            out.append(f"{name} and {rname} have different loss-scale configs")
        if len(log.steps) != len(ref.steps):
            out.append(f"{name} has {len(log.steps)} steps, {rname} {len(ref.steps)}")
        a, b = _first_loss(ref), _first_loss(log)
        if a is not None and b is not None and abs(a - b) > FIRST_LOSS_RTOL * max(abs(a), abs(b)):
            out.append(
                f"step 0's loss is {b:.4g} in {name} and {a:.4g} in {rname} (other weights or "
                "another batch)"
            )
    return out


def _names(logs: list[StepLog]) -> list[str]:
    """Each log's label, else its backend; the file name added where two would be the same."""
    names = [log.label or log.backend for log in logs]
    dup = {n for n in names if names.count(n) > 1}
    names = [
        f"{n} ({os.path.basename(log.path)})" if n in dup else n
        for n, log in zip(names, logs, strict=True)
    ]
    if len(set(names)) < len(names):
        names = [f"{n} #{i + 1}" for i, n in enumerate(names)]
    return names


def diagnose(logs: list[StepLog]) -> Diagnosis:
    """Diagnoses step logs: each on its own, then, with several (the same run in several
    frameworks), whether they agree, and whether their headers and first step say they are
    one run at all (:func:`run_mismatch`).

    Args:
        logs: :class:`~unimp.steplog.StepLog` s from :func:`~unimp.steplog.read_steplog`.

    Returns:
        :class:`~unimp.doctor.Diagnosis`.

    Raises:
        ValueError: no log given.
    """
    logs = list(logs)
    if not logs:
        raise ValueError("no step log to diagnose; pass at least one")
    names = _names(logs)
    per = [diagnose_log(log, n) for log, n in zip(logs, names, strict=True)]
    if len(per) == 1:
        return Diagnosis(per, None)
    comparison = compare(per)
    comparison["mismatch"] = run_mismatch(logs, names)
    return Diagnosis(per, comparison)
