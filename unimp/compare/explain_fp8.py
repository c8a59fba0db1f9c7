"""``unimp explain --fp8``: the float8 scale each implementation would quantize with, step by step,
on one sequence of per-tensor maxima. Framework-free (the :mod:`unimp.fp8` presets)."""

from __future__ import annotations

import math
from typing import Any

from unimp import fp8

__all__ = ["DEFAULT_AMAXES", "FP8_PRESETS", "fp8_table", "parse_amaxes"]

#: A sequence with a zero (step 3) and an inf (step 6) in it, a rise after the inf, and a tiny
#: amax at the end (step 13: where current-scaling rules differ, a scale past 2**126).
DEFAULT_AMAXES = (3.0, 5.0, 0.0, 4.0, 2.0, math.inf, 2.0, 2.0, 8.0, 1.0, 1.0, 1.0, 1e-40)

#: The presets compared, with what each stands for and its rule in a few words.
FP8_PRESETS = {
    "unimp_delayed": ("unimp DelayedScaling", "steps t-L..t-1; 0/inf/NaN window keeps the scale"),
    "transformer_engine": ("TE DelayedScaling", "steps t-L..t-1; a 0 amax is not recorded; NaN skipped"),
    "flax": ("flax fp8_ops", "steps t-L..t-1; stores a divisor: 1/(1/s) on 0/inf/NaN"),
    "keras": ('Keras quantize("float8")', "steps t-L-1..t-2 (two late); stores a divisor"),
    "unimp_current": ("unimp CurrentScaling", "step t; 0/inf/NaN: scale 1; at most 2**126"),
    "transformer_engine_current": ("TE Float8CurrentScaling", "step t; 0/inf/NaN: scale 1"),
    "torchao": ("torchao Float8Linear", "step t; 0: max/1e-12, inf: 0, NaN: NaN"),
}


def parse_amaxes(text: str) -> list[float]:
    """``"3,5,0,inf,nan"`` -> floats.

    Raises:
        ValueError: an empty list or an entry that is not a number or negative (named).
    """
    out = []
    for i, part in enumerate(p.strip() for p in text.split(",")):
        try:
            v = float(part)
        except ValueError:
            raise ValueError(f"--amaxes entry {i} ({part!r}) is not a number (use e.g. 0, inf, nan, 3.5)") from None
        if v < 0:
            raise ValueError(f"--amaxes entry {i} ({part!r}) is negative: an amax is max(abs(x)) >= 0")
        out.append(v)
    if not out:
        raise ValueError("--amaxes needs at least one number")
    return out


def fp8_table(amaxes: list[float], history_len: int = 3, role: str = "forward") -> dict[str, Any]:
    """The scale each preset quantizes with at each step, and where they differ.

    Args:
        amaxes: per step, the tensor's ``max(abs(x))`` (0, inf and NaN allowed).
        history_len: L for the delayed presets (their 1024 would hide the window in a short run).
        role: ``"forward"`` (e4m3, max 448) or ``"backward"`` (e5m2, max 57344).

    Returns:
        ``{"amaxes": [...], "history_len": L, "format": dtype, "presets": {name: {"native": str,
        "rule": str, "scale": [float per step]}}, "differences": [str, ...]}``: each preset
        against unimp's rule of its kind (delayed scaling against ``unimp_delayed``, current
        scaling against ``unimp_current``), naming the first step, counted from 1, and the
        values.
    """
    out: dict[str, Any] = {"amaxes": list(amaxes), "history_len": history_len, "presets": {}, "differences": []}
    for name, (native, rule) in FP8_PRESETS.items():
        delayed = fp8.PRESETS[name][0] is fp8.DelayedScaling
        cfg = fp8.fp8_preset(name, **({"amax_history_len": history_len} if delayed else {}))
        out["format"] = cfg.dtype(role)
        scales = [float(s) for s, _, _ in fp8.simulate(cfg, amaxes, role)]
        out["presets"][name] = {"native": native, "rule": rule, "scale": scales}
    for name, row in out["presets"].items():
        ours = "unimp_delayed" if fp8.PRESETS[name][0] is fp8.DelayedScaling else "unimp_current"
        if name == ours:
            continue
        base = out["presets"][ours]["scale"]
        diff = [i for i, (a, b) in enumerate(zip(base, row["scale"], strict=True)) if not _same(a, b)]
        if not diff:
            out["differences"].append(f"{name}: same scale as {ours} at every step")
            continue
        steps = ", ".join(str(i + 1) for i in diff[:8]) + (" ..." if len(diff) > 8 else "")
        i = diff[0]
        out["differences"].append(
            f"{name}: differs from {ours} at step(s) {steps}; first at step {i + 1} (amax "
            f"{amaxes[i]:g}): {row['scale'][i]:.9g} vs {base[i]:.9g}"
        )
    return out


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))
