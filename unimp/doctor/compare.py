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
    frameworks), whether they agree.

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
    per = [diagnose_log(log, n) for log, n in zip(logs, _names(logs), strict=True)]
    return Diagnosis(per, compare(per) if len(per) > 1 else None)
