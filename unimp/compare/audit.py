"""``unimp audit``: float32 steps with tensor statistics on, read as "what would a half dtype do".

Each framework trains the model in float32 (the same weights and batches as ``unimp compare``)
with a static loss scale equal to the target recipe's initial scale (float16: 2**15, bfloat16:
1), so the gradient statistics are taken at the scale the half-precision run would start at.
Then, per layer:

* an activation overflow (a layer output that would round to inf in the target dtype) is
  flagged at the layer where it starts: the first layer in forward order whose outputs
  overflow, after a layer whose outputs did not; the layers after it that only carry its
  values on are reported as downstream of it, not flagged;
* a gradient overflow (a gradient that would round to inf at the initial scale);
* an underflow: more than ``underflow_tolerance`` of a tensor's elements would flush to zero.

For a block-scaled format (``mxfp8``, ``fp8-block``, ``nvfp4``, ``mxfp4``: the block recipes,
which run without a loss scale) the statistics take the format's quantization error and the
findings are :mod:`unimp.compare.audit_block`'s: the tensors that lose more to 0, or more
precision, than an ordinary tensor does in that format.

Each finding carries the fix. Framework-free: the statistics come from each backend's
``stats`` module through the compare runners (:func:`unimp.compare.run.run_audit` runs them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from unimp.compare.audit_block import audit_block_stats
from unimp.recipe import BLOCK_RECIPES
from unimp.stats import StepStats, TensorStats, layer_of

__all__ = [
    "Finding",
    "audit_stats",
    "findings_table",
    "initial_scale",
    "parse_plant",
    "plant_form",
]

#: What ``unimp audit --to`` reads the statistics as: a half dtype or a block recipe's format.
TARGETS = ("float16", "bfloat16", *BLOCK_RECIPES)
#: The most steps ``unimp audit`` runs: statistics on every step of the first steps.
MAX_STEPS = 1000


@dataclass(frozen=True)
class Finding:
    """One layer that would not fit the target dtype.

    Attributes:
        layer: the layer name (a parameter's layer for gradients).
        kind: ``activation non-finite`` or ``gradient non-finite`` (inf or NaN already in
            float32: listed first), ``activation overflow``, ``gradient overflow``,
            ``activation underflow`` or ``gradient underflow``.
        tensor: the tensor that showed it (the layer output, or the parameter).
        step: the first audited step (0-based) it showed at.
        fraction: the largest fraction of elements affected, over the audited steps.
        headroom: bits between ``amax * scale`` and the dtype's largest value (negative:
            overflows by that many powers of two).
        fix: what to change.
        downstream: layers after this one whose outputs overflow only because of it.
    """

    layer: str
    kind: str
    tensor: str
    step: int
    fraction: float
    headroom: float
    fix: str
    downstream: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["downstream"] = list(self.downstream)
        return d


def _fix(kind: str, layer: str, target: str, scale: float, s: TensorStats) -> str:
    room = s.headroom(target)
    if kind.endswith("non-finite"):
        return (
            f"already non-finite in float32: no half dtype can fix it; find what makes {layer} "
            "inf or NaN (its weights, its input data, the learning rate) first"
        )
    if kind == "activation overflow":
        return (
            f"keep {layer} in float32 (torch: run it under torch.autocast(..., enabled=False); "
            f"Keras: dtype='float32' on the layer; JAX: compute it in float32), or train in "
            "bfloat16 (float32's range)"
        )
    if kind == "gradient overflow":
        bits = max(1, math.ceil(-room)) if math.isfinite(room) else None
        start = f"{scale / 2**bits:g}" if bits is not None else "a smaller scale"
        return (
            f"start the loss scale at {start} instead of {scale:g} (a dynamic scale backs off "
            "there by itself, skipping a step each halving), or train in bfloat16"
        )
    if kind == "gradient underflow":
        if target == "float16" and math.isfinite(room) and room >= 1:
            return (
                f"a larger loss scale: {scale * 2 ** math.floor(room):g} still fits the largest "
                f"gradient of {layer}; or train in bfloat16"
            )
        return "train in bfloat16 (float32's range), or keep this layer's gradients in float32"
    return f"keep {layer} in float32, or train in bfloat16"


def audit_stats(
    steps: Sequence[StepStats],
    target: str,
    *,
    underflow_tolerance: float = 0.01,
) -> list[Finding]:
    """The findings of one framework's audited steps.

    Args:
        steps: the statistics of each audited step (taken at the target's initial scale).
        target: ``float16``, ``bfloat16`` or a block format of
            :data:`unimp.recipe.BLOCK_RECIPES` (statistics taken with it).
        underflow_tolerance: flag a tensor when more than this fraction of its elements would
            flush to zero (0 <= tolerance < 1); for a block format, the least share named
            (:func:`unimp.compare.audit_block.thresholds`).

    Returns:
        :class:`Finding` s, activations first (in forward order), then gradients (sorted).

    Raises:
        ValueError: an unknown target or a tolerance outside [0, 1).
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target dtype {target!r}; choose one of {', '.join(TARGETS)}.")
    if not (0 <= underflow_tolerance < 1):
        raise ValueError(f"underflow tolerance must be in [0, 1), got {underflow_tolerance}.")
    if target in BLOCK_RECIPES:
        return [Finding(*f) for f in audit_block_stats(steps, target, underflow_tolerance=underflow_tolerance)]
    worst: dict[tuple[str, str, str], tuple[float, int, TensorStats]] = {}
    order: list[str] = []

    def note(kind: str, layer: str, tensor: str, frac: float, step: int, s: TensorStats) -> None:
        key = (kind, layer, tensor)
        old = worst.get(key)
        if old is None:
            worst[key] = (frac, step, s)
        elif frac > old[0] or s.headroom(target) < old[2].headroom(target):
            worst[key] = (max(frac, old[0]), old[1], s)

    for st in steps:
        for name in st.activations:
            if name not in order:
                order.append(name)
        for kind_of, tensors in (("activation", st.activations), ("gradient", st.gradients)):
            for name, s in tensors.items():
                layer = name if kind_of == "activation" else layer_of(name)
                bad = s.fraction("nonfinite")
                if bad > 0:  # inf / NaN in float32 itself: the run is broken before any cast
                    note(f"{kind_of} non-finite", layer, name, bad, st.step, s)
                over = s.fraction(f"{target}_overflow")
                if over > 0:
                    note(f"{kind_of} overflow", layer, name, over, st.step, s)
                flush = s.fraction(f"{target}_flush")
                if flush > underflow_tolerance:
                    note(f"{kind_of} underflow", layer, name, flush, st.step, s)
    out: list[Finding] = []
    # non-finite in float32 first: the root cause of everything after it
    for (kind, layer, tensor), (frac, step, s) in sorted(
        ((k, v) for k, v in worst.items() if k[0].endswith("non-finite")),
        key=lambda kv: (kv[1][1], kv[0][0].startswith("gradient"), order.index(kv[0][1]) if kv[0][1] in order else 0),
    ):
        out.append(Finding(layer, kind, tensor, step, frac, s.headroom(target), _fix(kind, layer, target, s.scale, s)))
    first = len(out)
    # activation overflows: flagged where they start, in forward order
    overflowing = [n for n in order if ("activation overflow", n, n) in worst]
    origin = None
    for i, name in enumerate(order):
        if name not in overflowing:
            origin = None
            continue
        frac, step, s = worst[("activation overflow", name, name)]
        if origin is not None and order[i - 1] in overflowing and origin >= first:
            out[origin] = _with_downstream(out[origin], name)
            continue
        out.append(
            Finding(
                name, "activation overflow", name, step, frac, s.headroom(target),
                _fix("activation overflow", name, target, s.scale, s),
            )
        )  # fmt: skip
        origin = len(out) - 1
    carried = {}  # layer -> the activation overflow it comes after
    for f in out:
        for later in (f.layer, *f.downstream):
            carried.setdefault(later, f.layer)
    for (kind, layer, tensor), (frac, step, s) in sorted(
        worst.items(), key=lambda kv: (kv[0][0].startswith("gradient"), kv[0][1], kv[0][0])
    ):
        if kind == "activation overflow" or kind.endswith("non-finite"):
            continue
        fix = _fix(kind, layer, target, s.scale, s)
        origin = carried.get(layer)
        if kind == "gradient overflow" and origin is not None:
            fix = f"it follows from the activation overflow in {origin}: fix that first; else {fix}"
        out.append(Finding(layer, kind, tensor, step, frac, s.headroom(target), fix))
    return out


def _with_downstream(f: Finding, layer: str) -> Finding:
    return Finding(
        f.layer, f.kind, f.tensor, f.step, f.fraction, f.headroom, f.fix, (*f.downstream, layer)
    )


def initial_scale(target: str) -> float:
    """The loss scale a half-precision run of ``target`` starts at: the ``mixed_<target>``
    recipe's initial scale, or a block format's recipe's (1 where it does not scale the loss:
    the block recipes)."""
    from unimp.recipe import get_recipe

    if target not in TARGETS:
        raise ValueError(f"unknown target dtype {target!r}; choose one of {', '.join(TARGETS)}.")
    recipe = target if target in BLOCK_RECIPES else f"mixed_{target}"
    return float(get_recipe(recipe).loss_scale.initial_scale())


def findings_table(findings: Mapping[str, Sequence[Finding]]) -> list[list[str]]:
    """Rows for a table: backend, layer, kind, tensor, step, fraction, headroom, fix."""
    rows = []
    for backend, fs in findings.items():
        for f in fs:
            rows.append(
                [
                    backend,
                    f.layer + (f" (then {', '.join(f.downstream)})" if f.downstream else ""),
                    f.kind,
                    f.tensor,
                    str(f.step),
                    f"{f.fraction:.2%}",
                    f"{f.headroom:+.1f}" if math.isfinite(f.headroom) else str(f.headroom),
                    f.fix,
                ]
            )
    return rows


def parse_plant(spec: str, model: str, weight_names: Sequence[str]) -> tuple[str, float]:
    """``--plant LAYER=FACTOR``: multiply that layer's weights by FACTOR (a planted fault).

    Raises:
        ValueError: not ``LAYER=FACTOR``, an unknown layer (the model's layers are listed), or a
            factor that is not a finite number > 0.
    """
    from unimp.compare.models import weight_layer

    layer, value = plant_form(spec)
    layers = sorted({weight_layer(n) for n in weight_names})
    if layer not in layers:
        raise ValueError(
            f"--plant {spec!r}: model {model} has no layer {layer!r}; its layers are "
            f"{', '.join(layers)}."
        )
    return layer, value


def plant_form(spec: str) -> tuple[str, float]:
    layer, sep, factor = spec.partition("=")
    if not sep or not layer.strip():
        raise ValueError(f"--plant {spec!r}: use LAYER=FACTOR, e.g. --plant l1=1e5.")
    try:
        value = float(factor)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"--plant {spec!r}: FACTOR must be a finite number > 0, e.g. 1e5.")
    # the weights are float32: a factor that is inf or 0 there plants no fault a run can show
    if not np.isfinite(np.float32(value)):
        raise ValueError(f"--plant {spec!r}: FACTOR overflows float32 (max 3.4e38); use at most 1e38.")
    if np.float32(value) == 0:
        raise ValueError(f"--plant {spec!r}: FACTOR rounds to 0 in float32 (min 1.4e-45); use at least 1e-44.")
    return layer.strip(), value
