"""The bodies of ``unimp trace`` and ``unimp audit`` (their options are in :mod:`unimp.cli`), and
the usage error and the ``--backends`` parser every command shares."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from typing import Any

__all__ = ["UsageError", "audit_command", "backends_arg", "trace_command"]


class UsageError(Exception):
    """A bad argument: printed as one line, exit code 2."""


def backends_arg(value: str | None) -> tuple[str, ...] | None:
    """``--backends a,b``: the names as a tuple, None for every installed backend."""
    if value is None or not value.strip():
        return None
    backends = tuple(b.strip() for b in value.split(",") if b.strip())
    if not backends:
        raise UsageError(f"--backends {value!r} names no backend; e.g. --backends torch,jax")
    twice = sorted({b for b in backends if backends.count(b) > 1})
    if twice:  # each would be one more identical run under the same label
        raise UsageError(f"--backends {value!r} names {', '.join(twice)} twice; name each backend once.")
    return backends


def _dtype_counts(counter: Any) -> str:
    return ", ".join(f"{d} {n}" for d, n in sorted(counter.items())) or "-"


def trace_command(args: argparse.Namespace) -> int:
    """``unimp trace``: the table per framework, ``--diff``, ``--json``."""
    from unimp.compare.run import CompareConfig, refuse_user_model, validate
    from unimp.compare.trace import trace_report

    cfg = CompareConfig(
        recipe=args.recipe,
        backends=backends_arg(args.backends),
        model=args.model,
        data=args.data,
        batch_size=args.batch_size,
        seed=args.seed,
        device=args.device,
        loss_scale=args.loss_scale,
    )
    refuse_user_model(cfg.model, "unimp trace")  # before validate builds anything
    recipe, _, _ = validate(cfg)  # every bad option fails here, before any framework is imported
    report = trace_report(cfg, with_float32=args.diff)
    traces, reference = report["traces"], report["reference"]
    if recipe.fp8 is not None and not any(r.op == "fp8_quantize" for t in traces.values() for r in t):
        from unimp.compare.fp8_scales import no_fp8_layer_note

        print(no_fp8_layer_note(cfg.model), file=sys.stderr)  # stdout stays the table or JSON
    if args.json:
        print(
            json.dumps(
                {
                    "format": "unimp.trace/1",
                    "recipe": report["recipe"],
                    "model": report["model"],
                    "traces": {k: t.to_dict() for k, t in traces.items()},
                    "reference": {k: t.to_dict() for k, t in reference.items()},
                    "diff": [r.to_dict() for r in report["diff"]],
                }
            )
        )
        return 0
    if args.diff:  # only where the frameworks differ (the table is the run without --diff)
        rows = report["diff"]
        ref = ", ".join(reference) or "none"
        print(f"unimp trace: {report['recipe']}; model {report['model']}")
        print(f"where the frameworks differ (forward pass; reference run: {ref}):")
        print(
            "\n".join(f"  {r}" for r in rows)
            if rows
            else "  nowhere: every op and layer ran in the same dtypes"
        )
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"unimp trace: {report['recipe']}; model {report['model']}, one step")
    table.add_column("forward ops by layer: compute dtype (ops)")
    for name in traces:
        table.add_column(name)
    layers: list[str] = []
    for t in traces.values():
        layers += [k for k in t.by_layer() if k not in layers]
    for layer in layers:
        table.add_row(
            layer or "(outside layers)",
            *(_dtype_counts(t.by_layer().get(layer, {})) for t in traces.values()),
        )
    table.add_section()
    for phase in ("forward", "backward", "update"):
        table.add_row(
            f"{phase}: maths ops", *(_dtype_counts(t.by_dtype(phase)) for t in traces.values())
        )
    table.add_row("casts between float dtypes", *(str(len(t.casts())) for t in traces.values()))
    # float8 recipes: the casts into and out of float8 (by format), the amax reductions and the
    # scale updates (by compute dtype)
    for op in ("fp8_quantize", "fp8_dequantize", "fp8_amax", "fp8_scale_update"):
        pick = {"fp8_quantize": lambda r: r.outputs[0], "fp8_dequantize": lambda r: r.inputs[0]}.get(
            op, lambda r: r.compute)
        counts = [Counter(pick(r) for r in t if r.op == op) for t in traces.values()]
        if any(counts):
            table.add_row(f"{op} ops", *(_dtype_counts(c) for c in counts))
    Console().print(table)
    return 0


def audit_command(args: argparse.Namespace) -> int:
    """``unimp audit``: the findings per framework, or ``--json``."""
    from unimp.compare.run import CompareConfig, run_audit

    cfg = CompareConfig(
        backends=backends_arg(args.backends),
        model=args.model,
        data=args.data,
        batch_size=args.batch_size,
        lr=args.lr,
        optimizer=args.optimizer,
        seed=args.seed,
        device=args.device,
    )
    report = run_audit(
        cfg,
        to=args.to,
        steps=args.steps,
        plant=args.plant,
        underflow_tolerance=args.underflow_tolerance,
        log_dir=args.log_dir,
    )
    if args.json:
        print(json.dumps(report))
        return 0
    target, scale = report["target"], report["scale"]
    planted = report["plant"]
    title = f"unimp audit: {report['model']} on {report['data']}, {report['steps']} float32 steps read as {target}"
    title += f" at loss scale {scale:g}" + (
        f"; planted: {planted['layer']} weights x {planted['factor']:g}" if planted else ""
    )
    print(title)
    limits = report.get("thresholds")  # a block format's: what is named, and why
    if limits:
        print(f"thresholds: {limits['why']}")
    for b, fs in report["findings"].items():
        if not fs:
            if limits:
                print(f"{b}: clean: no layer output would lose more than the thresholds in {target}")
            else:
                print(
                    f"{b}: clean: nothing would overflow, or flush more than "
                    f"{report['underflow_tolerance']:.0%} to zero, in {target}"
                )
            continue
        print(f"{b}:")
        for f in fs:
            then = f"; then {', '.join(f['downstream'])} (carried on)" if f["downstream"] else ""
            room = (
                f"{f['headroom']:+.1f} bits" if math.isfinite(f["headroom"]) else str(f["headroom"])
            )
            if f["kind"].endswith("quantization error"):
                share = f"relative MSE {f['fraction']:.2g} (named above {limits['relative_mse']:.2g})"
            elif limits and f["kind"].endswith("underflow"):
                share = f"{f['fraction']:.2%} of its nonzero elements (named above {limits['underflow']:.1%})"
            else:
                share = f"{f['fraction']:.2%} of its elements"
            print(
                f"  {f['layer']}: {f['kind']} in {f['tensor']} from step {f['step']}, "
                f"{share}, headroom {room}{then}"
            )
            print(f"    fix: {f['fix']}")
    return 0
