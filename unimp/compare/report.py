"""Writes the comparison report: ``report.json``, ``report.md`` and ``report.png``."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import Any

import numpy as np

from unimp.compare.audit import TARGETS, audit_stats
from unimp.policy import get_policy

__all__ = [
    "RECIPE_COLUMNS",
    "cross_framework_difference",
    "disagreements",
    "recipe_rows",
    "summary_rows",
    "write_report",
]

COLUMNS = (
    "backend",
    "framework",
    "device",
    "recipe",
    "final loss",
    "test acc",
    "applied",
    "skipped",
    "final scale",
    "median step ms",
    "memory MB",
    "dev. from f32",
    "max loss diff",
    "disagree at",
)


def _rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def disagreements(runs: dict[str, dict[str, Any]]) -> dict[str, list[int]]:
    """Per backend, the steps where it and another backend disagree on whether the loss is
    finite or on whether the step was applied (a skip in one framework and not in another)."""
    out: dict[str, list[int]] = {}
    for name, run in runs.items():
        steps = set()
        for other, orun in runs.items():
            if other == name:
                continue
            for i, (a, b) in enumerate(zip(run["loss"], orun["loss"], strict=False)):
                if math.isfinite(a) != math.isfinite(b) or run["applied"][i] != orun["applied"][i]:
                    steps.add(i)
        out[name] = sorted(steps)
    return out


def cross_framework_difference(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Per backend, the largest relative per-step loss difference to any other backend.

    Steps where both losses are finite count by their relative difference; a step where the
    two disagree on finiteness or on skipping (:func:`disagreements`) counts as ``inf``, so a
    divergence is never hidden by the steps that agree; steps where both losses are non-finite
    and both skipped agree and count 0. ``nan`` with a single backend.
    """
    split = disagreements(runs)
    out = {}
    for name, run in runs.items():
        worst = math.inf if split[name] else 0.0
        for other, orun in runs.items():
            if other == name:
                continue
            for a, b in zip(run["loss"], orun["loss"], strict=False):
                if math.isfinite(a) and math.isfinite(b):
                    worst = max(worst, _rel(a, b))
        out[name] = worst if len(runs) > 1 else float("nan")
    return out


def _steps(steps: list[int] | None, most: int = 6) -> str:
    if steps is None:
        return "n/a"
    if not steps:
        return "none"
    shown = ", ".join(str(i) for i in steps[:most])
    return shown + (f" ... ({len(steps)} steps)" if len(steps) > most else "")


def _test(run: dict[str, Any]) -> str:
    """The ``test acc`` cell: the accuracy, or ``mse X`` for a regression run (``--loss mse``)."""
    if run.get("test_accuracy") is None and run.get("test_loss") is not None:
        return f"mse {_fmt(run['test_loss'])}"
    return _fmt(run.get("test_accuracy"), ".3f")


def _fmt(v: Any, spec: str = ".4g") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else format(v, spec)
    return str(v)


def _finite_or_nan(x: float) -> float:
    return x if math.isfinite(x) else math.nan


def _memory(device_peak: int | None, rss_growth: int | None) -> str:
    """The device's peak where the framework reports one, else the process RSS growth during
    training (labelled: it counts host memory, allocator caches included)."""
    if device_peak is not None:
        return f"{device_peak / 2**20:.1f} (device peak)"
    if rss_growth is not None:
        return f"{rss_growth / 2**20:.1f} (RSS growth)"
    return "n/a"


def _device(device: str, threads: str | None) -> str:
    """The device, with ``--threads``' count where it was set (``cpu, 1 thread``)."""
    if threads is None or not device.startswith("cpu"):
        return device
    if threads.isdigit():
        return f"{device}, {threads} thread{'s' if threads != '1' else ''}"
    return f"{device}, own threads"


def summary_rows(report: dict[str, Any]) -> list[list[str]]:
    """The table, one row per backend, columns :data:`COLUMNS`."""
    rows = []
    diffs = report["cross_framework_max_rel_loss_diff"]
    split = report.get("cross_framework_disagreements", {})
    for name, run in report["runs"].items():
        base = report.get("baseline_deviation", {}).get(name)
        mem = run.get("peak_memory_bytes")
        rows.append(
            [
                name,
                f"{run['framework']} {run['version']}",
                _device(run["device"], report.get("threads", {}).get(name)),
                report["recipe_name"],
                _fmt(run["loss"][-1] if run["loss"] else None),
                _test(run),
                str(sum(run["applied"])),
                str(len(run["applied"]) - sum(run["applied"])),
                _fmt(run["scale"][-1] if run["scale"] else None, "g"),
                _fmt(float(np.median(run["step_time"])) * 1e3 if run["step_time"] else None, ".2f"),
                _memory(mem, run.get("rss_growth_bytes")),
                _fmt(base, ".2e"),
                _fmt(diffs.get(name), ".2e") if len(report["runs"]) > 1 else "n/a",
                _steps(split.get(name)) if len(report["runs"]) > 1 else "n/a",
            ]
        )
    return rows


#: The columns of :func:`recipe_rows` (``unimp compare --recipes``).
RECIPE_COLUMNS = (
    "backend",
    "recipe",
    "final loss",
    "test acc",
    "skipped",
    "final scale",
    "median step ms",
    "memory MB",
    "max loss diff",
    "layers that do not fit",
)


def _headline(run: dict[str, Any], half: str | None) -> str:
    """The audit's headline for one run: the layers whose activations or gradients overflow, or
    flush more than 1 % of their elements to zero, in the recipe's half dtype (``half``), at
    the steps the run took statistics at (:func:`unimp.compare.audit.audit_stats`); ``-`` for
    a float32 recipe."""
    from unimp.stats import StepStats

    if half not in TARGETS:
        return "-"
    stats = [StepStats.from_dict(d) for _, d in sorted((run.get("stats") or {}).items(), key=lambda kv: int(kv[0]))]
    if not stats:
        return "n/a"
    findings = audit_stats(stats, half)
    if not findings:
        return "none"
    shown = [f"{f.layer} ({f.kind})" for f in findings[:3]]
    return ", ".join(shown) + (f" +{len(findings) - 3} more" if len(findings) > 3 else "")


def recipe_rows(multi: dict[str, Any]) -> list[list[str]]:
    """One row per (framework, recipe) of a several-recipe run (``unimp compare --recipes``),
    columns :data:`RECIPE_COLUMNS`: recipes in the order given, frameworks within each.
    ``max loss diff`` compares the frameworks of the same recipe; ``layers that do not fit``
    is the audit's headline in the recipe's compute dtype (:func:`_headline`)."""
    rows = []
    for name, report in multi["recipes"].items():
        compute = get_policy(report["recipe"]["policy"]).compute_dtype
        unscaled = report["recipe"].get("loss_scale", {}).get("kind") == "none"
        diffs = report["cross_framework_max_rel_loss_diff"]
        for backend, run in report["runs"].items():
            mem = run.get("peak_memory_bytes")
            rows.append(
                [
                    backend,
                    name,
                    _fmt(run["loss"][-1] if run["loss"] else None),
                    _test(run),
                    str(len(run["applied"]) - sum(run["applied"])),
                    "none" if unscaled else _fmt(run["scale"][-1] if run["scale"] else None, "g"),
                    _fmt(float(np.median(run["step_time"])) * 1e3 if run["step_time"] else None, ".2f"),
                    _memory(mem, run.get("rss_growth_bytes")),
                    _fmt(diffs.get(backend), ".2e") if len(report["runs"]) > 1 else "n/a",
                    _headline(run, compute),
                ]
            )
    return rows


def _recipes_markdown(multi: dict[str, Any]) -> str:
    """report.md of a several-recipe run: the table of every (framework, recipe), then each
    recipe's own report."""
    from tabulate import tabulate

    first = next(iter(multi["recipes"].values()))
    lines = [
        f"# unimp compare: {', '.join(multi['recipes'])}",
        "",
        f"Model {first['config']['model']}, data {first['data']}, {first['steps']} steps per run, "
        f"optimizer {first['config']['optimizer']} lr {first['config']['lr']}, seed {first['config']['seed']}: "
        "the same initial weights and batches in every run.",
        "",
        tabulate(multi["rows"], headers=list(RECIPE_COLUMNS), tablefmt="github"),
        "",
        "`max loss diff`: between the frameworks of the same recipe. `layers that do not fit`: "
        "the layers whose activations or gradients overflow, or flush more than 1 % of their "
        "elements to zero, in the recipe's compute dtype, at the first and the last step "
        "(`unimp audit` explains each and its fix); `-` for a float32 recipe.",
        "",
    ]
    for report in multi["recipes"].values():
        section = _markdown(report).split("\n")
        lines += ["#" + section[0], *section[1:], ""]
    return "\n".join(lines)


def _markdown(report: dict[str, Any]) -> str:
    from tabulate import tabulate

    lines = [
        f"# unimp compare: {report['recipe_name']}",
        "",
        f"Recipe: {report['recipe_description']}",
        "",
        f"Model {report['config']['model']}, data {report['data']}, {report['steps']} steps, "
        f"optimizer {report['config']['optimizer']} lr {report['config']['lr']}, seed {report['config']['seed']}.",
        "",
        tabulate(summary_rows(report), headers=list(COLUMNS), tablefmt="github"),
        "",
        *(
            [f"CPU threads (--threads): {', '.join(f'{b} {t}' for b, t in report['threads'].items())}.", ""]
            if report.get("threads") else []
        ),
        "`max loss diff`: largest relative per-step loss difference to the other frameworks, over "
        "the steps where both losses are finite; a step where the frameworks disagree on whether "
        "the loss is finite or on skipping the step makes it `inf`, and is listed under "
        "`disagree at` (step numbers from 0). "
        "`dev. from f32`: largest relative per-step loss difference to the same framework's float32 run "
        "(with `--baseline`). Step time includes reading the loss back each step. "
        "`memory MB`: the device's peak where the framework reports one, else the growth of the "
        "process's resident memory (RSS) during training.",
        "",
    ]
    if "fp8" in report:
        from unimp.compare.fp8_scales import fp8_markdown

        lines += fp8_markdown(report["fp8"])
    if "block" in report:
        from unimp.compare.block_report import block_markdown

        lines += block_markdown(report["block"])
    lines += _layer_stats_markdown(report)
    if len(report["runs"]) > 1:  # every run is traced (a keras-* run: unimp's step on its model)
        lines += ["## Where the frameworks' dtypes differ (first step, forward pass)", ""]
        lines += [f"* {row}" for row in report.get("trace_diff_text", [])] or [
            f"Nowhere: every op and layer ran in the same dtypes ({', '.join(report['runs'])})."
        ]
        lines += [
            "",
            "From each framework's dtype trace (`unimp trace`): compute dtypes per shared op and "
            "per layer; `-`: the framework has no such op or layer.",
            "",
        ]
    return "\n".join(lines)


def _layer_stats_markdown(report: dict[str, Any]) -> list[str]:
    """Per-layer statistics at the first and the last step, every framework side by side."""
    from tabulate import tabulate

    per = report.get("layer_stats") or {}
    if not any(per.values()):
        return []
    lines = []
    for label in ("first", "last"):
        rows = []
        step = None
        seen = {b: set(s[label]["layers"]) for b, s in per.items() if label in s}
        shared = set.intersection(*seen.values()) if len(seen) > 1 else set().union(*seen.values())
        only = {b: sorted(names - shared) for b, names in seen.items() if names - shared}
        for backend, s in per.items():
            if label not in s:
                continue
            step = s[label]["step"]
            for layer, d in s[label]["layers"].items():
                if layer not in shared:  # a framework's own helper layer (Keras's Flatten, ...)
                    continue
                rows.append(
                    [
                        layer,
                        backend,
                        _fmt(d.get("grad_amax"), ".3g"),
                        _fmt(d.get("grad_headroom"), ".1f"),
                        _share(d, "grad", "flush"),
                        _share(d, "grad", "overflow"),
                        _fmt(d.get("act_amax"), ".3g"),
                        _fmt(d.get("act_headroom"), ".1f"),
                    ]
                )
        rows.sort(key=lambda r: (r[0], r[1]))
        lines += [
            f"## Per-layer statistics, {label} step ({step})",
            "",
            tabulate(
                rows,
                headers=[
                    "layer", "backend", "grad max", "grad headroom f16 (bits)", "grad flush f16",
                    "grad overflow f16", "act max", "act headroom f16 (bits)",
                ],
                tablefmt="github",
            ),
            "",
        ]  # fmt: skip
        if only:
            lines += [
                "Layers one framework has and the others do not (not compared): "
                + "; ".join(f"{b}: {', '.join(names)}" for b, names in only.items()) + ".",
                "",
            ]
    lines += [
        "Gradients at the step's loss scale, activations (layer outputs) at 1; headroom: powers "
        "of two between the largest value and float16's largest (negative: it overflows); "
        "shares of the layer's elements that would flush to zero / overflow in float16.",
        "",
    ]
    return lines


def _share(d: dict[str, Any], kind: str, what: str) -> str:
    size = d.get(f"{kind}_size")
    if not size:
        return "n/a"
    return f"{d.get(f'{kind}_{what}', 0) / size:.2%}"


def _plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_diff, ax_scale) = plt.subplots(3, 1, figsize=(8, 8.5), sharex=True)
    styles = ["-", "--", ":", "-."]  # identical curves lie on top of each other: keep each visible
    multi = "recipes" in report
    if multi:  # every (framework, recipe) row; differences to the first row
        runs = {f"{b} {name}": run for name, r in report["recipes"].items() for b, run in r["runs"].items()}
    else:
        runs = report["runs"]
    first = next(iter(runs))
    for i, (name, run) in enumerate(runs.items()):
        steps = np.arange(len(run["loss"]))  # from 0, as report.md and unimp doctor count
        style = styles[i % len(styles)]
        line = ax_loss.plot(steps, run["loss"], style, label=name, linewidth=1.2)[0]
        skipped = [j for j, a in enumerate(run["applied"]) if not a]
        if skipped:  # where each framework skipped a step, on its own loss curve
            finite = [j for j in skipped if math.isfinite(run["loss"][j])]
            ax_loss.plot(
                steps[finite], np.asarray(run["loss"])[finite], "x", color=line.get_color(),
                label=f"{name} skipped ({len(skipped)})",
            )
        if name != first:  # per-step relative difference to the first framework
            ax_diff.plot(
                steps[: len(runs[first]["loss"])],
                [_finite_or_nan(_rel(a, b)) for a, b in zip(run["loss"], runs[first]["loss"], strict=False)],
                style, color=line.get_color(), label=f"{name} vs {first}", linewidth=1.0,
            )
        ax_scale.step(steps, run["scale"], where="post", linestyle=style, label=name, linewidth=1.2)
    ax_loss.set_ylabel("loss")
    one = next(iter(report["recipes"].values())) if multi else report
    names = ", ".join(report["recipes"]) if multi else report["recipe_name"]
    model = os.path.basename(one["config"]["model"])  # a user's FILE.py:FUNCTION without its folder
    ax_loss.set_title(f"unimp compare: {names}\nmodel {model}, data {one['data']}", fontsize="medium")
    ax_loss.legend(fontsize="x-small" if len(runs) > 4 else "small")
    ax_diff.set_ylabel("relative loss difference")
    if len(runs) > 1:
        ax_diff.set_yscale("symlog", linthresh=1e-7)
        ax_diff.legend(fontsize="x-small" if len(runs) > 4 else "small", loc="best")
    else:
        ax_diff.text(0.5, 0.5, "one framework: nothing to compare", ha="center", transform=ax_diff.transAxes)
    ax_scale.set_ylabel("loss scale (used)")
    ax_scale.set_xlabel("step")
    if any(min(r["scale"], default=1) > 0 for r in runs.values()):
        ax_scale.set_yscale("log", base=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def strict_json(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` as standard JSON holds it: every non-finite float (a NaN loss, the loss
    difference of a one-framework run, an infinite headroom) is ``null``, and the top-level
    ``"nonfinite"`` says what each was, by JSON Pointer (RFC 6901): ``{"/runs/torch/loss/3":
    "inf"}``. Python's ``json`` would write ``NaN`` / ``Infinity``, which strict parsers
    (JavaScript's ``JSON.parse``, most JSON tools) refuse.

    Returns:
        A new dict; ``report`` is not changed.
    """
    found: dict[str, str] = {}

    def walk(x: Any, path: str) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            found[path] = "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
            return None
        if isinstance(x, dict):
            return {k: walk(v, f"{path}/{str(k).replace('~', '~0').replace('/', '~1')}") for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(x)]
        return x

    out = walk(report, "")
    out["nonfinite"] = found
    return out


def write_report(report: dict[str, Any], out_dir: str) -> list[str]:
    """Writes the three files into ``out_dir`` all at once: they are built in a temporary
    folder beside it and moved in only when all three exist, so a failure leaves nothing
    half-written. ``report`` is :func:`unimp.compare.run.run_compare`'s, or
    :func:`unimp.compare.run.run_recipes`' (one row per framework and recipe).

    Returns:
        The written paths.
    """
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".unimp-report-", dir=parent)
    try:
        with open(os.path.join(tmp, "report.json"), "w") as f:
            json.dump(strict_json(report), f, indent=1, allow_nan=False)
        with open(os.path.join(tmp, "report.md"), "w") as f:
            f.write(_recipes_markdown(report) if "recipes" in report else _markdown(report))
        _plot(report, os.path.join(tmp, "report.png"))
        os.makedirs(out_dir, exist_ok=True)
        written = []
        for name in ("report.json", "report.md", "report.png"):
            dest = os.path.join(out_dir, name)
            os.replace(os.path.join(tmp, name), dest)
            written.append(dest)
        return written
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
