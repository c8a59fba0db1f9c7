"""``unimp audit --to mxfp8`` (and ``fp8-block``, ``nvfp4``, ``mxfp4``): which layers' tensors a
block-scaled recipe would lose, read from float32 steps whose statistics take the format's
quantization error (``train_step(stats_formats=[...])``, :mod:`unimp.stats`). Framework-free.

A block format scales every block of 16, 32 or 128 elements by its own largest magnitude, so,
unlike float16, no tensor is too large or too small as a whole (its scale follows it): a tensor
suffers where its blocks are not, where values within one block lie too far apart for the
element type (E4M3 keeps about 2**17 between a block's largest and smallest nonzero value, E2M1
only 12), or where a rule leaves a block unscaled (Transformer Engine's MXFP8 leaves blocks
below ``448 * 2**-127`` as they are, and E4M3 rounds them to 0). Each tensor is measured as
the recipe quantizes activations (:data:`unimp.stats.BLOCK_FORMATS`: the rule's 1-D blocks
along the last axis, nearest-even rounding), and named when it loses clearly more than an
ordinary tensor does in that format:

* ``underflow``: more of its finite nonzero elements round to 0 than twice the share a standard
  normal tensor loses (:data:`TYPICAL`), and than ``underflow_tolerance``;
* ``quantization error``: its relative MSE, ``sum((q - x)**2) / sum(x**2)``, is more than four
  times a standard normal tensor's (the error an ordinary tensor has in the format, two
  mantissa bits' worth of headroom: 6 dB).

A tensor with fewer nonzero elements than one block of the format (a bias of 10) is not named:
its shares are a few elements' worth.

The tensors named are layer outputs: a layer's output is the input of the layers after it,
which is what the recipe quantizes (the fix names those). The parameters' gradients, which the
statistics record too (``--log-dir``), are named only where they are already non-finite in
float32: the recipes never quantize them (they quantize the gradient flowing into each GEMM,
which the statistics do not record), and their last axis is the framework's layout (torch's
``(out, in)`` weight, Keras's and JAX's ``(in, out)`` kernel), so their blocks, and shares,
differ between frameworks where a layer output's do not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from unimp.blockscale_linear import BLOCK_LINEAR_RULES
from unimp.recipe import BLOCK_RECIPES
from unimp.stats import StepStats, TensorStats, layer_of

__all__ = ["TYPICAL", "audit_block_stats", "thresholds"]


#: Per format, ``(underflow share, relative MSE)`` of a standard normal float32 tensor (256 x 512,
#: ``numpy.random.default_rng(0)``) as the statistics measure them, two digits: what an ordinary
#: tensor loses. FP8 keeps every element of it (E4M3 spans 2**17 within a block) and errs by its
#: 3 mantissa bits; FP4 rounds what lies below a 12th of its block's largest value to 0
#: (tests/test_audit.py recomputes them).
TYPICAL = {
    "mxfp8": (0.0, 7.0e-4),
    "fp8_block": (0.0, 7.0e-4),
    "nvfp4": (0.068, 9.1e-3),
    "mxfp4": (0.088, 1.3e-2),
}

_UNDERFLOW_TIMES, _ERROR_TIMES = 2.0, 4.0


def thresholds(target: str, underflow_tolerance: float = 0.01) -> dict[str, Any]:
    """Where ``unimp audit --to <target>`` names a tensor, and why (module docstring).

    Args:
        target: a key of :data:`unimp.recipe.BLOCK_RECIPES` (``"mxfp8"``, ``"fp8-block"``, ``"nvfp4"``,
            ``"mxfp4"``).
        underflow_tolerance: the least underflow share that is named (``--underflow-tolerance``).

    Returns:
        ``{"format", "underflow", "relative_mse", "typical": {"underflow", "relative_mse"},
        "why"}``: a tensor is named above either threshold; ``why`` says so in one sentence.

    Raises:
        ValueError: an unknown target, naming the choices.

    Example:
        >>> t = thresholds("nvfp4")
        >>> t["underflow"], round(t["relative_mse"], 4)
        (0.136, 0.0364)
    """
    if target not in BLOCK_RECIPES:
        raise ValueError(f"unknown block format {target!r}; choose one of {', '.join(BLOCK_RECIPES)}.")
    fmt = BLOCK_RECIPES[target]
    under, mse = TYPICAL[fmt]
    u = max(underflow_tolerance, _UNDERFLOW_TIMES * under)
    m = _ERROR_TIMES * mse
    why = (
        f"a tensor is named when more than {u:.1%} of its nonzero values would round to 0 in {target} "
        f"(twice what a standard normal tensor loses, {under:.1%}, and at least --underflow-tolerance) "
        f"or when its relative MSE exceeds {m:.2g} (four times a standard normal tensor's, {mse:.2g})"
    )
    return {
        "format": fmt,
        "underflow": u,
        "relative_mse": m,
        "typical": {"underflow": under, "relative_mse": mse},
        "why": why,
    }


def _fix(kind: str, layer: str, target: str) -> str:
    if kind.endswith("non-finite"):
        return (
            f"already non-finite in float32: no format can fix it; find what makes {layer} "
            "inf or NaN (its weights, its input data, the learning rate) first"
        )
    what = "lose values to 0" if kind.endswith("underflow") else "lose precision"
    return (  # a layer output: the only tensors named for what the format does
        f"the layers that read {layer}'s output would {what} in {target}: keep them in bfloat16 "
        "(the recipe's exclude patterns, BlockRecipe(exclude=[...]), or a per-layer override), "
        f"or bring {layer}'s outputs to one scale (a normalization before them)"
    )


def audit_block_stats(
    steps: Sequence[StepStats], target: str, *, underflow_tolerance: float = 0.01
) -> list[tuple[str, str, str, int, float, float, str, tuple[str, ...]]]:
    """The findings of one framework's audited steps for a block format, as the fields of
    :class:`unimp.compare.audit.Finding` (``layer, kind, tensor, step, fraction, headroom,
    fix, downstream``; :func:`unimp.compare.audit.audit_stats` builds them): layer outputs that would
    lose more than :func:`thresholds` (``activation underflow``: ``fraction`` is the share of
    the nonzero elements; ``activation quantization error``: the relative MSE; the worst over
    the steps), and tensors already non-finite in float32 (gradients too); ``headroom`` is
    bfloat16's (the recipe's dtype around its block-scaled GEMMs; a block format itself
    overflows only where float32 does). As float16's activation overflows, a layer output
    named for what the one before it (in forward order) was named for is listed in that
    finding's ``downstream``: it carries those values on.

    Args:
        steps: statistics taken with the target's format (``stats_formats=[format]``).
        target: a key of :data:`unimp.recipe.BLOCK_RECIPES`.
        underflow_tolerance: see :func:`thresholds`.

    Returns:
        Findings: non-finite tensors first (layer outputs, then gradients), then layer outputs
        in forward order.

    Raises:
        ValueError: an unknown target.
        KeyError: statistics taken without the target's format.
    """
    limits = thresholds(target, underflow_tolerance)
    fmt = limits["format"]
    block = BLOCK_LINEAR_RULES[fmt].tile("activation")[1]
    worst: dict[tuple[str, str, str], tuple[float, int, TensorStats]] = {}
    order: list[str] = []
    for st in steps:
        order += [n for n in st.activations if n not in order]
        for role, tensors in (("activation", st.activations), ("gradient", st.gradients)):
            for name, s in tensors.items():
                layer = name if role == "activation" else layer_of(name)
                checks = [("non-finite", s.fraction("nonfinite"), 0.0)]
                # a layer output is what the recipe quantizes (module docstring); one with fewer
                # nonzero elements than a block has a few elements' shares: not a finding
                if role == "activation":
                    share = s.underflow(fmt)  # a KeyError naming the fix if it was not measured
                    if s.counts[f"{fmt}_nonzero"] >= block:
                        checks += [
                            ("underflow", share, limits["underflow"]),
                            ("quantization error", s.relative_mse(fmt), limits["relative_mse"]),
                        ]
                for kind, value, limit in checks:
                    key = (f"{role} {kind}", layer, name)
                    if value > limit and value > worst.get(key, (-math.inf,))[0]:
                        worst[key] = (value, worst[key][1] if key in worst else st.step, s)

    def rank(key: tuple[str, str, str]) -> tuple[Any, ...]:
        kind, layer, tensor = key
        first = 0 if kind.endswith("non-finite") else 1
        gradient = kind.startswith("gradient")
        where = order.index(tensor) if not gradient and tensor in order else len(order)
        return (first, gradient, where, tensor, kind)

    out: list[tuple[str, str, str, int, float, float, str, tuple[str, ...]]] = []
    origin: dict[str, int] = {}  # kind -> the finding the layers just after it carry on
    for (kind, layer, tensor), (value, step, s) in sorted(worst.items(), key=lambda kv: rank(kv[0])):
        i = order.index(tensor) if tensor in order else -1
        o = origin.get(kind)
        if kind.startswith("activation") and not kind.endswith("non-finite") and o is not None and (
            i > 0 and (kind, order[i - 1], order[i - 1]) in worst
        ):  # the layer before it was named for the same: it carries those values on, as float16's overflows
            f = out[o]
            out[o] = (*f[:7], (*f[7], layer))
            continue
        origin[kind] = len(out)
        out.append((layer, kind, tensor, step, value, s.headroom("bfloat16"), _fix(kind, layer, target), ()))
    return out
