"""``unimp compare`` with a block-scaled recipe (``mxfp8``, ``fp8-block``, ``nvfp4``,
``mxfp4``): the layers each framework put in the format, the accuracy against the same recipe
without them (bfloat16), and what the published recipe keeps in higher precision.
Framework-free (the runners hand in the layers' paths and accuracies)."""

from __future__ import annotations

from typing import Any

from unimp.compare.fp8_scales import accuracy_against

__all__ = ["block_markdown", "block_section", "block_terminal_lines"]


def block_section(runs: dict[str, dict[str, Any]], bf16: dict[str, dict[str, Any]], block: Any) -> dict[str, Any]:
    """The report's ``block`` part (a block-scaled recipe).

    Args:
        runs: the recipe's runs by backend (each with ``block_layers``: the paths its recipe
            put in the format).
        bf16: the same runs without the block-scaled layers (the recipe's bfloat16 policy);
            empty: no reference (the accuracy's ``bfloat16`` and ``diff`` are None).
        block: the recipe's :class:`unimp.blockscale_recipe.BlockRecipe`.

    Returns:
        ``{"rule", "description", "guidance", "layers": {backend: [paths]}, "accuracy":
        {backend: {"block", "bfloat16", "diff"}}, "max_abs_accuracy_diff"}``.
    """
    accuracy, largest = accuracy_against(runs, bf16, "block")
    for b, run in runs.items():  # without a reference run (compare --recipes: a row of its own)
        accuracy.setdefault(b, {"block": run["test_accuracy"], "bfloat16": None, "diff": None})
    return {
        "rule": block.rule.name,
        "description": block.describe(),
        "guidance": block.guidance,
        "layers": {b: list(run.get("block_layers") or []) for b, run in runs.items()},
        "accuracy": accuracy,
        "max_abs_accuracy_diff": largest,
    }


def block_terminal_lines(section: dict[str, Any]) -> list[str]:
    """``unimp compare``'s block-scaled lines under its table: per framework the layers in the
    format and the accuracy against bfloat16, then the published recipe's guidance."""
    out = [f"block-scaled ({section['rule']}):"]
    for b, a in section["accuracy"].items():
        layers = section["layers"].get(b, [])
        what = f"{len(layers)} layer(s) ({', '.join(layers)})" if layers else "no layer in the format"
        against = "" if a["bfloat16"] is None else f" against bfloat16 {a['bfloat16']:.4f}"
        out.append(f"  {b}: {what}; test accuracy {a['block']:.4f}{against}")
    return [*out, f"  guidance: {section['guidance']}"]


def block_markdown(section: dict[str, Any]) -> list[str]:
    """The report's block-scaled table: layers and accuracy against bfloat16 per framework."""
    out = [f"## Block-scaled ({section['rule']})", "", section["description"] + ".", "",
           "| framework | layers in the format | test accuracy | bfloat16 | difference |", "|---|---|---|---|---|"]
    for b, a in section["accuracy"].items():
        layers = ", ".join(section["layers"].get(b, [])) or "none (first and last are out)"
        ref = ("-", "-") if a["bfloat16"] is None else (f"{a['bfloat16']:.4f}", f"{a['diff']:+.4f}")
        out.append(f"| {b} | {layers} | {a['block']:.4f} | {ref[0]} | {ref[1]} |")
    return [*out, "", f"The published recipe: {section['guidance']}", ""]
