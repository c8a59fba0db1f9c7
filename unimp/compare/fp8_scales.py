"""``unimp compare`` with an FP8 recipe: the float8 scales each framework ended its first and
last step with, per layer and tensor, whether the frameworks agree bit for bit, and the
accuracy against a bfloat16 run. Framework-free (the runners hand in floats)."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any

from unimp.fp8 import LAYER_TENSORS

__all__ = ["TENSORS", "accuracy_against", "capture_first", "fp8_markdown", "fp8_section"]

#: the quantized tensors of a float8 layer, in the order of its states (the core's names)
TENSORS = LAYER_TENSORS


def capture_first(spec: Any, read: Callable[[], dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Chains ``spec.progress`` so the scales are read once, after the first step.

    Args:
        spec: the :class:`unimp.compare.run.RunSpec` whose ``progress(i)`` runs after step i.
        read: returns ``{layer: {tensor: scale}}`` of the model now (one host read).

    Returns:
        A dict filled with ``read()``'s result after step 0.
    """
    first: dict[str, Any] = {}
    previous = spec.progress

    def progress(i: int) -> None:
        if i == 0:
            first.update(read())
        previous(i)

    spec.progress = progress
    return first


def scales_record(first: dict[str, dict[str, float]], last: dict[str, dict[str, float]]) -> dict[str, Any]:
    """``{layer: {tensor: [scale after step 0, scale after the last step]}}``."""
    return {layer: {t: [first.get(layer, {}).get(t), last[layer][t]] for t in TENSORS} for layer in last}


def _bits(x: float | None) -> str | None:
    return None if x is None else struct.pack(">f", x).hex()


def fp8_section(runs: dict[str, dict[str, Any]], bf16: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The report's ``fp8`` part.

    Returns:
        ``{"layers": {backend: [paths]}, "scales": {layer: {tensor: {backend: [first, last]}}},
        "agree": {layer: {tensor: [first, last]}}`` (booleans: every framework holding that
        layer, two or more, has the same float32 bits), ``"accuracy": {backend: {"fp8", "bfloat16", "diff"}}``,
        ``"max_abs_accuracy_diff"``.
    """
    scales: dict[str, dict[str, dict[str, Any]]] = {}
    for b, run in runs.items():
        for layer, per in (run.get("fp8_scales") or {}).items():
            for t, pair in per.items():
                scales.setdefault(layer, {}).setdefault(t, {})[b] = pair
    agree = {
        layer: {t: [len(by_b) > 1 and len({_bits(pair[i]) for pair in by_b.values()}) == 1 for i in (0, 1)]
                for t, by_b in per.items()}
        for layer, per in scales.items()
    }
    accuracy, largest = accuracy_against(runs, bf16, "fp8")
    return {
        "layers": {b: sorted(run.get("fp8_scales") or {}) for b, run in runs.items()},
        "scales": scales,
        "agree": agree,
        "accuracy": accuracy,
        "max_abs_accuracy_diff": largest,
    }


def accuracy_against(runs: dict[str, dict[str, Any]], bf16: dict[str, dict[str, Any]], key: str) -> tuple[dict, float]:
    """Each run's test accuracy against the same run without the low-precision layers:
    ``{backend: {key: accuracy, "bfloat16": ..., "diff": ...}}`` and the largest ``|diff|``
    (``key``: ``"fp8"`` or ``"block"``)."""
    accuracy = {
        b: {key: runs[b]["test_accuracy"], "bfloat16": bf16[b]["test_accuracy"],
            "diff": runs[b]["test_accuracy"] - bf16[b]["test_accuracy"]}
        for b in runs if b in bf16
    }
    diffs = [abs(a["diff"]) for a in accuracy.values() if math.isfinite(a["diff"])]
    return accuracy, max(diffs, default=float("nan"))


def fp8_terminal_lines(section: dict[str, Any], model: str) -> list[str]:
    """``unimp compare``'s float8 lines under its table: per framework the float8 layers and the
    accuracy against bfloat16, or, where no layer ran in float8, that and why."""
    out = []
    for b, a in section["accuracy"].items():
        layers = section["layers"].get(b, [])
        what = f"{len(layers)} float8 layer(s) ({', '.join(layers)})" if layers else "no float8 layer"
        out.append(f"  {b}: {what}; test accuracy {a['fp8']:.4f} against bfloat16 {a['bfloat16']:.4f}")
    if not any(section["layers"].get(b) for b in section["accuracy"]):
        out.append(no_fp8_layer_note(model))
    return ["float8 (FP8 recipe):", *out]


def no_fp8_layer_note(model: str) -> str:
    """The line that says a float8 recipe selected no layer of ``model``."""
    return (
        f"note: no layer of model {model!r} ran in float8: the recipe keeps the first and last "
        "Dense/Linear/Conv layers out (the usual FP8 guidance), and this model has no other; "
        "--model vit has float8 layers (docs/fp8.md)"
    )


def fp8_markdown(section: dict[str, Any]) -> list[str]:
    """The report's float8 tables: accuracy against bfloat16, then the scales (first/last per
    tensor per framework) and whether the frameworks agree bit for bit."""
    out = ["## Float8 (FP8 recipe)", "", "| framework | float8 layers | test accuracy | bfloat16 | difference |",
           "|---|---|---|---|---|"]
    for b, a in section["accuracy"].items():
        layers = ", ".join(section["layers"].get(b, [])) or "none (first and last are out)"
        out.append(f"| {b} | {layers} | {a['fp8']:.4f} | {a['bfloat16']:.4f} | {a['diff']:+.4f} |")
    if not section["scales"]:
        return [*out, ""]
    backends = list(section["accuracy"])
    out += ["", "Scales (after the first step -> after the last), float32:", "",
            "| layer | tensor | " + " | ".join(backends) + " | bit-identical (first/last) |",
            "|---|---|" + "---|" * len(backends) + "---|"]
    for layer, per in section["scales"].items():
        for t, by_b in per.items():
            cells = [("-" if b not in by_b else f"{by_b[b][0]:.6g} -> {by_b[b][1]:.6g}") for b in backends]
            same = "/".join("yes" if a else "no" for a in section["agree"][layer][t])
            out.append(f"| {layer} | {t} | " + " | ".join(cells) + f" | {same} |")
    return [*out, ""]
