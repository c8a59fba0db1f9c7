"""What the doctor reports: the thresholds, :class:`Fix`, :class:`Finding`, :class:`LogDiagnosis`
and :class:`Diagnosis` with its JSON and text forms (see :mod:`unimp.doctor`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: A burst: at least this many gradient overflows in a row.
BURST_MIN = 3
#: A collapse: the scale this many powers of two (1024x) below its level after the start.
COLLAPSE_BITS = 10
#: Overflows at most this many applied steps apart belong to one run (collapses).
CLUSTER_GAP = 8
#: A learning-rate change: a rise by at least this factor from one step to the next ...
LR_JUMP = 3.0
#: ... at most this many steps before (or at) the start of an episode.
LR_WINDOW = 100
#: A recurring layer: the first non-finite one in at least this many problem steps.
RECURRING_MIN = 2
#: Overflows in the first steps of a run that starts at step 0: the initial scale calibrating.
CALIBRATION_STEPS = 10
#: The share of a gradient flushing to zero in float16 that makes a capped scale a problem.
FLUSH_WARN = 0.01
#: The format tag of :meth:`Diagnosis.to_dict` (``unimp doctor --json``).
DIAGNOSIS_FORMAT = "unimp.doctor/1"
#: The finding classes, root causes first: the order findings are ranked in.
CLASSES = (
    "run_ended_early",
    "nonfinite_input",
    "params_non_finite",
    "recurring_layer",
    "lr_change_before_overflow",
    "forward_overflow",
    "scale_collapse",
    "overflow_burst",
    "scale_at_cap",
    "half_overflow_recorded",
    "isolated_overflow",
    "nothing_wrong",
)
#: The fix ids, each said in plain words by :attr:`Fix.text`.
FIXES = (
    "check_data",
    "master_weights",
    "optimizer_epsilon",
    "lower_lr",
    "keep_float32",
    "check_layer",
    "bfloat16",
    "hysteresis",
    "stop_early",
    "initial_scale",
    "raise_max_scale",
    "dynamic_scale",
)
SEVERITIES = ("error", "warning", "info")
_SHOWN = 8  # step ranges shown in the text


@dataclass(frozen=True)
class Fix:
    """One thing to do.

    Attributes:
        id: stable, one of :data:`FIXES`.
        text: what to do, in plain words, with the numbers (steps, layer, learning rate).
        layer: the layer it names (``keep_float32``, ``check_layer``), else None.
    """

    id: str
    text: str
    layer: str | None = None


@dataclass
class Finding:
    """One episode found in a log.

    Attributes:
        cls: the class id, one of :data:`CLASSES`.
        severity: ``"info"`` (normal), ``"warning"`` or ``"error"`` (the run does not train).
        summary: what happened, in plain words, with the steps and numbers.
        steps: the evidence steps, in order (:attr:`step` is the first).
        layer, tensor, phase: the layer (its tensor, ``"forward"`` or ``"backward"``) that went
            non-finite first in most evidence steps, where the log says; else None.
        fixes: what to do, most likely first.
        details: the numbers behind the summary (JSON-able); ``spike`` tells the two kinds of
            ``isolated_overflow`` apart.
    """

    cls: str
    severity: str
    summary: str
    steps: list[int] = field(default_factory=list)
    layer: str | None = None
    tensor: str | None = None
    phase: str | None = None
    fixes: list[Fix] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cls not in CLASSES or self.severity not in SEVERITIES:
            raise ValueError(f"unknown finding class {self.cls!r} or severity {self.severity!r}")

    @property
    def step(self) -> int | None:
        """The first evidence step (None for ``nothing_wrong``)."""
        return self.steps[0] if self.steps else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, with ``"class"`` for :attr:`cls` and ``"count"`` for ``len(steps)``."""
        return {
            "class": self.cls,
            "severity": self.severity,
            "step": self.step,
            "steps": list(self.steps),
            "count": len(self.steps),
            "layer": self.layer,
            "tensor": self.tensor,
            "phase": self.phase,
            "summary": self.summary,
            "fixes": [{"id": f.id, "text": f.text, "layer": f.layer} for f in self.fixes],
            "details": self.details,
        }


@dataclass
class LogDiagnosis:
    """The findings of one log, ranked: problems before normal events, root causes first.

    Attributes:
        path: the log file.
        name: how the log is named in the report (its label, else its backend).
        backend: the header's backend.
        steps: step records read; ``first_step`` and ``last_step`` (None when none).
        ended: the log had its end line (the run was closed).
        end: the end line (``status``, ``exception`` / ``signal``, ``last_step``), or None.
        warnings: the reader's warnings (a cut-off line, no end line).
        findings: the :class:`Finding` s, ranked.
    """

    path: str
    name: str
    backend: str
    steps: int
    first_step: int | None
    last_step: int | None
    ended: bool
    warnings: list[str]
    findings: list[Finding]
    end: dict[str, Any] | None = None

    @property
    def how_ended(self) -> str:
        """``"completed"``, ``"crashed (ValueError)"``, ``"interrupted (SIGTERM)"``, or
        ``"NOT closed (killed?)"`` for a log without an end line."""
        if not self.ended:
            return "NOT closed (killed?)"
        end = self.end or {}
        status = end.get("status", "completed")
        why = end.get("exception") or end.get("signal")
        word = "crashed" if status == "exception" else status
        return f"{word} ({why})" if why and status != "completed" else word

    @property
    def ok(self) -> bool:
        """No finding above severity info."""
        return all(f.severity == "info" for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            k: getattr(self, k)
            for k in ("path", "name", "backend", "steps", "first_step", "last_step", "ended")
        }
        out["how_ended"] = self.how_ended
        out["warnings"] = list(self.warnings)
        out["ok"] = self.ok
        out["findings"] = [f.to_dict() for f in self.findings]
        return out


@dataclass
class Diagnosis:
    """What :func:`unimp.doctor.diagnose` found.

    Attributes:
        logs: one :class:`LogDiagnosis` per log, in the order given.
        comparison: None for one log; for several, ``{"logs": [names], "agree": bool, "rows":
            [...], "mismatch": [str]}`` with one row per finding class: ``{"class", "spike",
            "agree", "note", "per_log": {name: {"step", "layer"} or None}}``; ``mismatch``
            says why the logs may not be one run (empty when nothing says so).
    """

    logs: list[LogDiagnosis]
    comparison: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        """No log has a finding above severity info."""
        return all(d.ok for d in self.logs)

    @property
    def fixes(self) -> list[dict[str, Any]]:
        """The fixes of every finding merged (one per id and layer), most likely first, each
        as ``{"id", "text", "layer", "for": [finding classes], "steps": [the evidence steps of
        those findings, the first 100], "count": all of them}``."""
        merged: dict[tuple[str, str | None], dict[str, Any]] = {}
        steps: dict[tuple[str, str | None], set[int]] = {}
        for d in self.logs:
            for f in d.findings:
                for fx in f.fixes:
                    key = (fx.id, fx.layer)
                    m = merged.setdefault(
                        key, {"id": fx.id, "text": fx.text, "layer": fx.layer, "for": []}
                    )
                    if f.cls not in m["for"]:
                        m["for"].append(f.cls)
                    steps.setdefault(key, set()).update(f.steps)
        for key, m in merged.items():
            m["steps"] = sorted(steps[key])[:100]
            m["count"] = len(steps[key])
        return list(merged.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (``unimp doctor --json``), tagged ``"format": "unimp.doctor/1"``."""
        return {
            "format": DIAGNOSIS_FORMAT,
            "ok": self.ok,
            "logs": [d.to_dict() for d in self.logs],
            "comparison": self.comparison,
            "fixes": self.fixes,
        }

    def render(self) -> str:
        """Plain text for a terminal: per log its findings, then the comparison and the fixes."""
        out: list[str] = []
        for d in self.logs:
            closed = d.how_ended
            span = f" ({d.first_step}-{d.last_step})" if d.steps else ""
            out.append(f"{d.name}: {d.path}: {d.steps} steps{span}, {closed}")
            if not d.steps:
                out.append("  nothing to diagnose: the log holds no step")
            for f in d.findings:
                head = f"  [{f.severity}] {f.cls}"
                head += f" at step {f.step}" if f.steps else ""
                head += f" in {f.layer}" if f.layer else ""
                out += [head, f"      {f.summary}"]
                if len(f.steps) > 1:
                    out.append(f"      steps: {ranges(f.steps)}")
        if self.comparison:
            c = self.comparison
            verdict = "they agree" if c["agree"] else "they differ"
            out.append(f"\nacross the logs ({', '.join(c['logs'])}): {verdict}")
            if c.get("mismatch"):
                out.append("  warning: these logs may not be one run: " + "; ".join(c["mismatch"]))
            out += [f"  {row['note']}" for row in c["rows"]]
        fixes = self.fixes
        if fixes:
            out.append("\nfixes, most likely first:")
            for i, fx in enumerate(fixes, 1):
                more = f" ({fx['count']} in all)" if fx["count"] > len(fx["steps"]) else ""
                why = f"{', '.join(fx['for'])}; steps {ranges(fx['steps'])}{more}"
                out.append(f"  {i}. {fx['text']}  [{why}]")
        elif self.ok:
            out.append("\nnothing to fix.")
        return "\n".join(out)


def ranges(steps: list[int]) -> str:
    """Steps as ranges, the first few: ``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:_SHOWN])
    return text + (f", ... ({len(steps)} steps in all)" if len(runs) > _SHOWN else "")
