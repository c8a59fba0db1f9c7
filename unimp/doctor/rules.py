"""The rules that find episodes in one step log (see :mod:`unimp.doctor` for the classes)."""

from __future__ import annotations

import math
from collections import Counter
from itertools import pairwise
from typing import Any

from unimp.doctor.advice import Advice
from unimp.doctor.findings import (
    BURST_MIN,
    CALIBRATION_STEPS,
    CLASSES,
    CLUSTER_GAP,
    COLLAPSE_BITS,
    FLUSH_WARN,
    LR_JUMP,
    LR_WINDOW,
    RECURRING_MIN,
    Finding,
    Fix,
    LogDiagnosis,
    ranges,
)
from unimp.stats import first_nonfinite as stats_first_nonfinite
from unimp.stats import layer_of
from unimp.steplog import StepLog

_F32_TINY = 2.0**-126  # the floor of a DynamicLossScale with min_scale=None

Rec = dict[str, Any]


def _g(x: float | None) -> str:
    return "?" if x is None else f"{x:g}"


def first_nonfinite(r: Rec) -> tuple[str, str, str] | None:
    """``(phase, layer, tensor)`` of the first non-finite tensor of a step: the record's
    ``nonfinite``, else what its ``stats`` say (:func:`unimp.stats.first_nonfinite`); None
    when the log does not say."""
    nf = r.get("nonfinite")
    if nf:
        return nf["phase"], nf["layer"], nf["tensor"]
    return stats_first_nonfinite(r.get("stats"))


def _where(recs: list[Rec]) -> tuple[str | None, str | None, str | None, dict[str, int]]:
    """The layer (its tensor, phase) first non-finite in at least half of ``recs`` where one
    is known, else Nones; and the count per layer."""
    seen = [x for x in map(first_nonfinite, recs) if x]
    counts = Counter(x[1] for x in seen)
    if not seen:
        return None, None, None, {}
    layer, n = counts.most_common(1)[0]
    if 2 * n < len(seen):
        return None, None, None, dict(counts)
    phase, _, tensor = Counter(x for x in seen if x[1] == layer).most_common(1)[0][0]
    return layer, tensor, phase, dict(counts)


def _nonfinite_text(layer: str | None, tensor: str | None, phase: str | None) -> str:
    return f"; the first non-finite: {phase} {tensor} (layer {layer})" if layer else ""


def _flush(r: Rec) -> float:
    """The largest share of a gradient flushing to zero in float16 in a step's statistics."""
    out = 0.0
    for t in ((r.get("stats") or {}).get("gradients") or {}).values():
        size, n = t.get("size") or 0, (t.get("counts") or {}).get("float16_flush") or 0
        out = max(out, n / size if size else 0.0)
    return out


def _runs(idx: list[int], recs: list[Rec], gap: int) -> list[list[int]]:
    """Record indices grouped where their steps are at most ``gap + 1`` apart."""
    out: list[list[int]] = []
    for i in idx:
        if out and recs[i]["step"] - recs[out[-1][-1]]["step"] <= gap + 1:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class _Rules:
    """One log's records sorted into bad data, forward and gradient overflows, and the rules
    run over them in turn; each adds findings to :attr:`found`."""

    def __init__(self, log: StepLog) -> None:
        self.recs = recs = log.steps
        cfg = log.loss_scale
        self.cfg = cfg if cfg and cfg.get("kind") == "dynamic" else None
        self.floor = (self.cfg.get("min_scale") or _F32_TINY) if self.cfg else None
        self.advice = Advice(log.loss_scale, log.recipe)
        self.bad = [i for i, r in enumerate(recs) if r["batch_finite"] is False]
        # once the half parameters held inf / NaN every later loss and gradient follows from it
        # (params_non_finite says so): those steps are not overflows of their own
        broken = next((i for i, r in enumerate(recs) if r.get("params_finite") is False), len(recs))
        ok_data = [i for i, r in enumerate(recs[: broken + 1]) if r["batch_finite"] is not False]
        self.fwd = [i for i in ok_data if not recs[i]["loss_finite"]]
        self.gov = [i for i in ok_data if recs[i]["loss_finite"] and not recs[i]["grads_finite"]]
        self.growth = [i for i in range(1, len(recs)) if recs[i]["scale"] > recs[i - 1]["scale"]]
        self.found: list[Finding] = []
        self.problem: list[int] = list(self.fwd)  # steps a recurring layer is counted over
        self.episodes: list[tuple[str, int]] = []  # (class, first record) for the lr rule
        self.collapse: set[int] = set()
        self.calib: list[int] = []

    def steps(self, idx: list[int]) -> list[int]:
        return [self.recs[i]["step"] for i in idx]

    def add(
        self,
        cls: str,
        severity: str,
        text: str,
        idx: list[int],
        fixes: list[Fix],
        details: dict[str, Any] | None = None,
        where: tuple[Any, ...] = (None, None, None),
    ) -> None:
        """Adds a finding whose evidence is the records ``idx``; ``where`` is ``(layer,
        tensor, phase)``."""
        layer, tensor, phase = where[:3]
        f = Finding(
            cls, severity, text, self.steps(idx), layer, tensor, phase, fixes, details or {}
        )
        self.found.append(f)

    def at_floor(self, i: int) -> bool:
        return self.floor is not None and self.recs[i]["scale"] <= self.floor * (1 + 1e-6)

    def data(self) -> None:
        if not self.bad:
            return
        s = self.steps(self.bad)
        fix = Fix(
            "check_data",
            f"check the data at step {ranges(s)}: find the samples holding NaN or inf and fix "
            "or drop them",
        )
        text = (
            f"the batch held NaN or inf at {len(s)} step(s), first at step {s[0]}, before the "
            "model ran: no precision setting can fix that"
        )
        self.found.append(Finding("nonfinite_input", "error", text, s, fixes=[fix]))

    def calibration(self) -> None:
        """Overflows in a row from step 0 that end with the scale above its floor. Under
        hysteresis h (DeepSpeed's, Megatron-LM's 2) up to h - 1 clean steps may fall between
        two of them: the scale still descends (Megatron-LM from 2**32 overflowed at 524288
        after one clean step there and settled at 262144, which read as a spike)."""
        gap = int((self.cfg or {}).get("hysteresis") or 1) - 1
        recs, runs = self.recs, _runs(self.gov, self.recs, gap)
        if runs and recs[0]["step"] == 0 and runs[0][0] == 0 and runs[0][-1] + 1 < len(recs):
            if not self.at_floor(runs[0][-1] + 1):
                self.calib = runs[0]

    def scale_collapse(self) -> None:
        recs, gov = self.recs, self.gov
        begin = self.calib[-1] + 1 if self.calib else 0
        low = recs[min(begin, len(recs) - 1)]["scale"] / 2.0**COLLAPSE_BITS
        govs = set(gov)
        t = next(
            (
                i
                for i in range(begin, len(recs))
                if recs[i]["scale"] <= low or (i in govs and self.at_floor(i))
            ),
            None,
        )
        if t is None:
            return
        w0 = max([begin] + [g for g in self.growth if g <= t])
        window = [i for i in gov if w0 <= i <= t]  # the overflows since the last growth
        if not window:
            return
        cluster = next(c for c in _runs(gov, recs, CLUSTER_GAP) if c[0] <= window[-1] <= c[-1])
        tail = [i for i in cluster if window[0] <= i <= t]
        start = tail[0] if 2 * len(tail) >= len(window) else window[0]  # fast, else a slide
        grows = [g for g in self.growth if g > t]  # it lasts until the scale grows again
        ep = [i for i in gov if start <= i < (grows[0] if grows else len(recs))]
        self.collapse = set(ep)
        self.problem += ep
        self.episodes.append(("scale_collapse", start))
        floored = next((i for i in range(start, ep[-1] + 1) if self.at_floor(i)), None)
        if floored is None and ep[-1] + 1 < len(recs) and self.at_floor(ep[-1] + 1):
            floored = ep[-1] + 1
        reach = t if floored is None else floored
        stuck = [] if floored is None else [i for i in ep if i >= floored]
        a, b = recs[start], recs[reach]
        layer, tensor, phase, layers = _where([recs[i] for i in ep])
        where = f" (2**{COLLAPSE_BITS} down)"
        if floored is not None:
            where = " (its floor" + (", min_scale=None" if self.floor == _F32_TINY else "") + ")"
        text = (
            f"the loss scale collapsed: from {_g(a['scale'])} at step {a['step']} it fell to "
            f"{_g(b['scale'])}{where} at step {b['step']}: {sum(i < reach for i in ep)} "
            f"overflows in {b['step'] - a['step']} steps"
        )
        if stuck:
            text += (
                f"; then {len(stuck)} overflowed at the floor, to step "
                f"{recs[stuck[-1]]['step']} ('loss scale already at minimum')"
            )
        text += (
            f"; it grew again at step {recs[grows[0]]['step']}"
            if grows
            else "; it never grew again"
        )
        spread = any(b - a > 1 for a, b in pairwise(ep) if b <= reach)  # clean steps between
        fixes = self.advice.bfloat16() + self.advice.gentler(spread)
        if len(stuck) >= 10:
            fixes += self.advice.stop_early(len(stuck))
        details = {
            "scale_from": a["scale"],
            "scale_to": b["scale"],
            "step_to": b["step"],
            "floor": self.floor,
            "floor_step": None if floored is None else b["step"],
            "overflows_at_floor": len(stuck),
            "grew_again_step": recs[grows[0]]["step"] if grows else None,
            "bits_per_step": math.log2(a["scale"] / b["scale"]) / max(1, b["step"] - a["step"]),
            "layers": layers,
        }
        severity = "error" if stuck else "warning"
        text += _nonfinite_text(layer, tensor, phase)
        self.add("scale_collapse", severity, text, ep, fixes, details, (layer, tensor, phase))

    def gradient_overflows(self) -> None:
        """Bursts, the calibration, normal isolated overflows and spikes, outside a collapse."""
        recs = self.recs
        normal: list[int] = []
        spikes: list[int] = []
        prev = -1
        calib = set(self.calib)  # one run, though hysteresis may leave clean steps inside it
        runs = [self.calib] if self.calib else []
        runs += [r for r in _runs(self.gov, recs, 0) if not calib.intersection(r)]
        for run in runs:
            grown = any(prev < g <= run[0] for g in self.growth)
            prev = run[-1]
            run = [i for i in run if i not in self.collapse]
            if not run:
                continue
            if run == self.calib and len(run) >= BURST_MIN:
                settled = recs[run[-1] + 1]["scale"]
                text = (
                    f"{len(run)} overflows from step 0: the initial scale {_g(recs[0]['scale'])}"
                    f" was too high and settled at {_g(settled)}; normal, it cost {len(run)} steps"
                )
                fix = Fix(
                    "initial_scale",
                    f"start at init_scale={_g(settled)}, where it settled, to save the "
                    f"{len(run)} skipped steps",
                )
                self.add("overflow_burst", "info", text, run, [fix])
            elif len(run) >= BURST_MIN:
                self.problem += run
                self.episodes.append(("overflow_burst", run[0]))
                layer, tensor, phase, layers = _where([recs[i] for i in run])
                first, last = recs[run[0]]["scale"], recs[run[-1]]["scale"]
                static = (self.advice.cfg or {}).get("kind") == "static" and first == last
                if static:  # a static scale never backs off: each of these steps is lost
                    moved = f"at the static loss scale {_g(first)}, which never backs off"
                else:
                    moved = f"the scale fell from {_g(first)} to {_g(last)}"
                text = (
                    f"{len(run)} gradient overflows in a row from step {recs[run[0]]['step']}: "
                    f"{moved}" + _nonfinite_text(layer, tensor, phase)
                )
                fixes = self.advice.gentler() + self.advice.bfloat16()
                if static:
                    fixes.insert(0, Fix(
                        "dynamic_scale",
                        f"lower the static loss scale (below {_g(first)}) or use a dynamic one "
                        "(loss_scale='dynamic' backs off on overflow)",
                    ))  # fmt: skip
                details = {"length": len(run), "layers": layers}
                self.add(
                    "overflow_burst", "warning", text, run, fixes, details, (layer, tensor, phase)
                )
            elif (
                run == self.calib
                or grown
                or (recs[0]["step"] == 0 and recs[run[0]]["step"] < CALIBRATION_STEPS)
            ):
                normal += run
            else:
                spikes += run
        if spikes:
            self.spikes(spikes)
        if normal:
            skipped = sum(not r["applied"] for r in recs)
            text = (
                f"{len(normal)} isolated gradient overflow(s), each after the scale grew (or at "
                "the start): the dynamic scale probing upward and backing off; normal, nothing "
                f"to fix ({skipped} of {len(recs)} steps skipped)"
            )
            self.add("isolated_overflow", "info", text, normal, [], {"spike": False})

    def spikes(self, idx: list[int]) -> None:
        recs = self.recs
        self.problem += idx
        # one finding, but an episode per cluster: each is checked for a learning-rate rise
        # before it (a rise before a later cluster was missed behind the first one's window)
        for k, i in enumerate(idx):
            if k == 0 or recs[i]["step"] - recs[idx[k - 1]]["step"] > CLUSTER_GAP:
                self.episodes.append(("isolated_overflow", i))
        layer, tensor, phase, layers = _where([recs[i] for i in idx])
        j = idx[0]
        since = max([0] + [i for i in range(1, j + 1) if recs[i]["scale"] != recs[i - 1]["scale"]])
        held = recs[j]["step"] - recs[since]["step"]
        text = (
            f"{len(idx)} gradient overflow(s) with no growth of the scale before, first at step "
            f"{recs[idx[0]]['step']} (the scale {_g(recs[idx[0]]['scale'])} had held for {held} "
            "steps): the gradients spiked, or a layer produced inf or NaN"
            + _nonfinite_text(layer, tensor, phase)
        )
        fixes = []
        if layer:
            check = (
                f"check layer {layer} at step {recs[idx[0]]['step']}: it went non-finite first; "
                "if it recurs, keep it in float32"
            )
            fixes.append(Fix("check_layer", check, layer))
        details = {"spike": True, "layers": layers}
        self.add("isolated_overflow", "warning", text, idx, fixes, details, (layer, tensor, phase))

    def forward_overflow(self) -> None:
        if not self.fwd:
            return
        recs, s = self.recs, self.steps(self.fwd)
        self.episodes.append(("forward_overflow", self.fwd[0]))
        layer, tensor, phase, layers = _where([recs[i] for i in self.fwd])
        fixes = (self.advice.keep(layer) if layer else []) + self.advice.bfloat16()
        text = (
            f"the loss was not finite at {len(s)} step(s), first at step {s[0]} (scale "
            f"{_g(recs[self.fwd[0]]['scale'])}): an overflow in the forward pass, which loss "
            "scaling cannot fix" + _nonfinite_text(layer, tensor, phase)
        )
        severity = "error" if len(s) >= BURST_MIN else "warning"
        where = (layer, tensor, phase)
        self.add("forward_overflow", severity, text, self.fwd, fixes, {"layers": layers}, where)

    def scale_at_cap(self) -> None:
        cap = self.cfg.get("max_scale") if self.cfg else None
        if not cap:
            return
        recs = self.recs
        pinned = [i for i, r in enumerate(recs) if r["scale"] >= cap * (1 - 1e-6)]
        longest = max(_runs(pinned, recs, 0), key=len, default=[])
        if len(longest) < int(self.cfg.get("growth_interval") or 1):
            return
        flush = max(_flush(recs[i]) for i in longest)
        text = (
            f"the scale sat at its cap, max_scale={_g(cap)}, for {len(longest)} steps from step "
            f"{recs[longest[0]]['step']}: growth was blocked"
        )
        fixes = []
        if flush > FLUSH_WARN:
            text += f"; up to {flush:.1%} of a gradient flushed to zero in float16"
            raise_it = (
                f"raise max_scale (now {_g(cap)}) or set it to None, so the scale can lift the "
                "small gradients out of float16's zero"
            )
            fixes.append(Fix("raise_max_scale", raise_it))
        else:
            text += "; fine unless small gradients flush to zero (statistics would show it)"
        severity = "warning" if fixes else "info"
        details = {"steps_at_cap": len(longest), "max_flush": flush}
        self.add("scale_at_cap", severity, text, longest[:1], fixes, details)

    def params_non_finite(self) -> None:
        """An applied step (finite loss and gradients) after which the half-precision
        parameters held inf / NaN (the record's ``params_finite`` false): the update itself
        went non-finite, computed in the parameters' dtype."""
        idx = [i for i, r in enumerate(self.recs) if r.get("params_finite") is False]
        if not idx:
            return
        first = self.recs[idx[0]]
        dtype = self.advice.param or "half-precision"
        how = "an applied step, with a finite loss and finite gradients" if first["applied"] else "a step"
        text = (
            f"the {dtype} parameters went non-finite at step {first['step']}, {how}: the "
            f"optimizer's update overflowed or divided 0 by 0 in {dtype} (it keeps its state and "
            "computes in the parameters' dtype: an epsilon that rounds to 0, a moment that "
            f"flushes); {len(idx)} step(s) ended with non-finite parameters, and every later "
            "gradient is non-finite"
        )
        fixes = [
            Fix(
                "master_weights",
                f"keep float32 master weights and optimizer state: a mixed recipe "
                f"('mixed_{'bfloat16' if dtype == 'bfloat16' else 'float16'}') instead of pure {dtype}",
            ),
            Fix("optimizer_epsilon", "or give the optimizer an epsilon the dtype holds (1e-4 in float16)"),
        ]
        self.add("params_non_finite", "error", text, idx[:1], fixes, {"steps": len(idx)})

    def half_overflow_recorded(self) -> None:
        """Float16 overflows the statistics record in a run that does not compute in float16
        (``unimp audit``'s float32 steps): they trained, a float16 run would not have."""
        if self.advice.float16 and self.advice.compute is not None:
            return  # a float16 run's overflows are its non-finite values, found above
        per: dict[str, list[Any]] = {}  # layer -> [elements, record indices]
        for i, r in enumerate(self.recs):
            stats = r.get("stats") or {}
            for kind in ("activations", "gradients"):
                for name, t in (stats.get(kind) or {}).items():
                    n = (t.get("counts") or {}).get("float16_overflow") or 0
                    if n:
                        entry = per.setdefault(name if kind == "activations" else layer_of(name), [0, []])
                        entry[0] += n
                        entry[1].append(i)
        if not per:
            return
        first = next(iter(per))
        idx = sorted(set(per[first][1]))
        parts = [f"{layer} {n} element(s) over {len(set(ix))} step(s)" for layer, (n, ix) in per.items()]
        text = (
            f"the statistics record values that would overflow float16: {'; '.join(parts)}, "
            f"first at step {self.recs[idx[0]]['step']}; this {self.advice.compute or 'run'} run "
            "holds them, a float16 run would overflow there"
        )
        fixes = [
            Fix("keep_float32", f"to train in float16, keep layer {first} in float32", first),
            Fix("bfloat16", "or train in bfloat16, whose range is float32's"),
        ]
        self.add(
            "half_overflow_recorded", "warning", text, idx, fixes,
            {"elements": {layer: n for layer, (n, _) in per.items()}}, (first, None, "forward"),
        )  # fmt: skip

    def lr_changes(self) -> bool:
        """Adds a finding per rise of the learning rate before an episode, and puts its fix
        first in those episodes' findings; True when there was one."""
        recs = self.recs
        jumps: dict[int, list[tuple[str, int]]] = {}  # record of the rise -> its episodes
        for cls, start in self.episodes:
            lo = recs[start]["step"] - LR_WINDOW
            for i in range(start, 0, -1):
                if recs[i]["step"] < lo:
                    break
                a, b = recs[i - 1]["lr"], recs[i]["lr"]
                if a is not None and b is not None and a > 0 and b >= LR_JUMP * a:
                    jumps.setdefault(i, []).append((cls, recs[start]["step"]))
                    break
        for i, after in sorted(jumps.items()):
            a, b, step = recs[i - 1]["lr"], recs[i]["lr"], recs[i]["step"]
            cls, first = min(after, key=lambda e: e[1])
            fix = Fix(
                "lower_lr",
                f"lower the learning rate or warm it up: it rose {b / a:.3g}x at step {step} "
                f"(from {a:g} to {b:g}) just before the overflows",
            )
            what = {"isolated_overflow": "gradient overflows"}.get(cls, cls.replace("_", " "))
            text = (
                f"the learning rate rose {b / a:.3g}x at step {step}, from {a:g} to {b:g}, and "
                f"the {what} started at step {first}"
            )
            for f in self.found:
                if any((f.cls, s) in after for s in f.steps):
                    f.fixes.insert(0, fix)
            details = {"lr_from": a, "lr_to": b, "before": sorted({c for c, _ in after})}
            self.found.append(
                Finding(
                    "lr_change_before_overflow",
                    "warning",
                    text,
                    sorted({step, first}),
                    fixes=[fix],
                    details=details,
                )
            )
        return bool(jumps)

    def recurring_layer(self, after_lr: bool) -> None:
        recs, idx = self.recs, sorted(set(self.problem))
        layer, tensor, phase, layers = _where([recs[i] for i in idx])
        if not layer or layers[layer] < RECURRING_MIN:
            return
        hits = [i for i in idx if (first_nonfinite(recs[i]) or (0, 0))[1] == layer]
        symptom = " (probably a symptom of the learning-rate rise)" if after_lr else ""
        text = (
            f"layer {layer} went non-finite first in {layers[layer]} of {sum(layers.values())} "
            f"problem steps ({phase} {tensor}){symptom}"
        )
        fixes = self.advice.keep(layer) + self.advice.bfloat16()
        if not after_lr:
            for f in self.found:
                if f.cls in ("scale_collapse", "overflow_burst") and f.layer == layer:
                    f.fixes[:0] = self.advice.keep(layer)
        where = (layer, tensor, phase)
        self.add("recurring_layer", "error", text, hits, fixes, {"layers": layers}, where)


def diagnose_log(log: StepLog, name: str) -> LogDiagnosis:
    """The ranked findings of one log (see :mod:`unimp.doctor`)."""
    recs = log.steps
    d = LogDiagnosis(
        log.path,
        name,
        log.backend,
        len(recs),
        recs[0]["step"] if recs else None,
        recs[-1]["step"] if recs else None,
        log.ended,
        list(log.warnings),
        [],
        log.end,
    )
    if not recs:
        return d
    rules = _Rules(log)
    rules.data()
    rules.params_non_finite()
    rules.calibration()
    rules.scale_collapse()
    rules.gradient_overflows()
    rules.forward_overflow()
    rules.scale_at_cap()
    rules.half_overflow_recorded()
    after_lr = rules.lr_changes()
    rules.recurring_layer(after_lr)
    found = rules.found
    end = log.end or {}
    if end.get("status") in ("exception", "interrupted"):  # the run stopped before its end
        last = end.get("last_step")
        last = last if isinstance(last, int) and not isinstance(last, bool) else recs[-1]["step"]
        found.append(Finding(
            "run_ended_early", "warning",
            f"the run {d.how_ended.replace('crashed', 'crashed on an exception')} after step "
            f"{last}: the log ends there, whatever the rest of the run would have done",
            [last], details={k: end.get(k) for k in ("status", "exception", "signal")},
        ))  # fmt: skip
    if not found:
        skipped = sum(not r["applied"] for r in recs)
        text = (
            f"nothing wrong: {len(recs)} steps, {skipped} skipped, no overflow, the loss and the "
            "gradients finite"
        )
        found.append(Finding("nothing_wrong", "info", text))
    rank = {c: float(i) for i, c in enumerate(CLASSES)}
    if after_lr:  # a layer going non-finite after a rise of the learning rate: its symptom
        rank["recurring_layer"] = rank["scale_at_cap"] + 0.5
    d.findings = sorted(found, key=lambda f: (f.severity == "info", rank[f.cls], f.step or 0))
    return d
