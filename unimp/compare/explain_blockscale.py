"""``unimp explain --block-format``: where the block-scaled presets part, element by element, on
a few blocks of values (a zero block, an inf, a NaN, a maximum just above 448, a tiny block).
Framework-free: every value comes from the NumPy reference (:mod:`unimp.blockscale_presets`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from unimp.blockscale_presets import (
    BLOCK_PRESETS,
    block_preset,
    block_preset_scales,
    block_quantize_dequantize,
)

__all__ = ["DEFAULT_BLOCKS", "WIDTH", "block_format_table", "parse_block_values", "parse_presets"]

#: The blocks shown, each as its distinct values; a block is repeated to :data:`WIDTH` columns,
#: so every preset's block (16, 32 or 128 along a row) holds the same values and the same amax.
DEFAULT_BLOCKS: dict[str, tuple[float, ...]] = {
    "zero": (0.0,) * 8,
    "inf": (math.inf, 1.0, -0.75, 0.3, 0.01, 2.0, -3.5, 0.001),
    "nan": (math.nan, 1.0, -0.75, 0.3, 0.01, 2.0, -3.5, 0.001),
    "above 448": (449.0, -300.0, 17.0, 3.0, 0.3, 0.01, 0.001, -0.0005),
    "tiny": tuple(v * 2.0**-120 for v in (1.0, 0.75, -0.5, 0.375, 0.25, 0.2, 0.125, 0.0625)),
}

#: Columns each block is repeated to: a multiple of every preset's activation block (1x16, 1x32,
#: 1x128).
WIDTH = 128


def parse_presets(text: str) -> list[str]:
    """``"ocp_mx,jax_mxfp8"`` -> the names, in order; ``"all"`` -> every preset.

    Raises:
        ValueError: an empty list or an unknown name (one line: the valid names and the closest).
    """
    names = [p.strip() for p in text.split(",") if p.strip()]
    if names == ["all"]:
        return list(BLOCK_PRESETS)
    if not names:
        raise ValueError(f"--block-format needs preset names (or all): {', '.join(BLOCK_PRESETS)}")
    for name in names:
        block_preset(name)
    return list(dict.fromkeys(names))


def parse_block_values(text: str) -> tuple[float, ...]:
    """``"449,3,0.001,-inf"`` -> floats: one block's distinct values, 1, 2, 4, 8, 16 or 32 of
    them (repeated to fill every preset's block).

    Raises:
        ValueError: an entry that is not a number (named), or a count that does not divide 32.
    """
    out = []
    for i, part in enumerate(p.strip() for p in text.split(",")):
        try:
            out.append(float(part))
        except ValueError:
            raise ValueError(f"--values entry {i} ({part!r}) is not a number (use e.g. 449, -0.5, inf, nan)") from None
    if len(out) not in (1, 2, 4, 8, 16, 32):
        raise ValueError(
            f"--values takes 1, 2, 4, 8, 16 or 32 numbers (repeated to fill a block), got {len(out)}; "
            "pad with zeros"
        )
    return tuple(out)


def block_format_table(presets: list[str], blocks: dict[str, tuple[float, ...]] | None = None) -> dict[str, Any]:
    """Each preset's dequantized values and block scale on each block, and where they differ.

    Args:
        presets: names of :data:`unimp.blockscale_presets.BLOCK_PRESETS`; the first is the
            baseline the others are compared with.
        blocks: name -> a block's distinct values (default :data:`DEFAULT_BLOCKS`); each is
            repeated to one float32 row of :data:`WIDTH` and quantized as an activation (a row
            is one tensor: NVFP4's global scale is the row's amax).

    Returns:
        ``{"presets": {name: {"implementation", "element", "scale", "source", "notes"}},
        "blocks": [{"name", "values": [...], "presets": {name: {"scale": float, "values":
        [...], "differs": [bool, ...]}}, "differences": [str, ...]}]}``: ``differs`` marks the
        values unlike the first preset's (-0 unlike +0); values as float (inf and NaN), the
        scale being the one the block dequantizes with (E8M0 ``2**(b - 127)``, block FP8's
        ``1 / S``, NVFP4's ``s_block * s_global``).

    Raises:
        ValueError: an unknown preset name, or a block whose length does not divide
            :data:`WIDTH`.
    """
    blocks = DEFAULT_BLOCKS if blocks is None else blocks
    out: dict[str, Any] = {"presets": {}, "blocks": []}
    for name in presets:
        p = block_preset(name)
        out["presets"][name] = {
            "implementation": p.implementation,
            "element": p.elements[0],
            "scale": f"{p.scale_type}, {p.scale_rounding}",
            "source": p.source,
            "notes": p.notes,
        }
    for label, values in blocks.items():
        if WIDTH % len(values):
            raise ValueError(f"block {label!r} has {len(values)} values; give a count that divides {WIDTH}.")
        x = np.tile(np.asarray(values, np.float32), WIDTH // len(values))[None, :]
        rows = {}
        with np.errstate(all="ignore"):
            for name in presets:
                q = block_quantize_dequantize(x, name)[0, : len(values)]
                rows[name] = {
                    "scale": float(block_preset_scales(x, name)[0, 0]),
                    "values": [float(v) for v in q],
                }
        base = rows[presets[0]]["values"]
        for row in rows.values():
            row["differs"] = [not _same(u, v) for u, v in zip(row["values"], base, strict=True)]
        shown = [float(v) for v in np.float32(values)]
        out["blocks"].append(
            {"name": label, "values": shown, "presets": rows, "differences": _differences(presets, rows, shown)}
        )
    return out


def _differences(presets: list[str], rows: dict[str, Any], values: list[float]) -> list[str]:
    base = presets[0]
    lines = []
    for name in presets[1:]:
        a, b = rows[base], rows[name]
        diff = [i for i, d in enumerate(b["differs"]) if d]  # unlike the first preset's, i.e. a's
        parts = []
        if not _same(a["scale"], b["scale"]):
            parts.append(f"scale {b['scale']:.6g} vs {a['scale']:.6g}")
        parts += [f"element {i + 1} ({values[i]:.6g}): {b['values'][i]:.6g} vs {a['values'][i]:.6g}" for i in diff[:3]]
        if len(diff) > 3:
            parts.append(f"and {len(diff) - 3} more element(s)")
        lines.append(f"{name} vs {base}: " + ("; ".join(parts) if parts else "same scale and values"))
    return lines


def _same(a: float, b: float) -> bool:
    return (a == b and math.copysign(1.0, a) == math.copysign(1.0, b)) or (math.isnan(a) and math.isnan(b))
