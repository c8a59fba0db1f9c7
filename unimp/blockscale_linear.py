"""The block-scaled linear layer's rule: which operand of ``y = x @ W`` is quantized along which
axis for each of its three GEMMs, written once over an array namespace (issue 33).
Framework-free.

A block-scaled GEMM multiplies two operands whose blocks of 16, 32 or 128 elements lie along
the GEMM's reduction axis, so that every product of the sum meets one scale per operand. A
linear layer runs three GEMMs, each reducing over another axis, so Transformer Engine keeps two
copies of an operand that two GEMMs read along different axes ("rowwise" and "columnwise"),
both quantized from the high-precision tensor, never one from the other (its
``MXFP8BlockScaling``, ``Float8BlockScaling`` and ``NVFP4BlockScaling`` docstrings,
``transformer_engine/common/recipe/__init__.py``). With ``x`` flattened to ``(M, K)`` (``M`` the
product of its leading axes, ``K`` its features) and ``W`` of ``K`` inputs and ``N`` outputs:

==========  =====================  ===================================  ======================
GEMM        product                operands (role), blocks along         reduction axis
==========  =====================  ===================================  ======================
forward     ``y = x @ W``          x (activation) K; W (weight) K        K, the inputs
input grad  ``dx = g @ W^T``       g (gradient) N; W (weight) N          N, the outputs
weight grad ``dW = x^T @ g``       x (activation) M; g (gradient) M      M, the batch rows
==========  =====================  ===================================  ======================

so ``x``, ``W`` and ``g`` are each quantized twice (:data:`GEMMS`); under ``nvfp4`` the
weight-gradient GEMM's two operands go through the random Hadamard transform along ``M`` first
(:attr:`BlockLinearRule.hadamard`). A role whose tile is
two-dimensional (Transformer Engine's 128x128 block FP8 and 16x16 NVFP4 weights) has one copy:
a square tile holds the same elements whichever axis the GEMM reduces over, so its transpose
is its columnwise copy, bit for bit (Transformer Engine stores it so).

Each rule of :data:`BLOCK_LINEAR_RULES` names one preset of :mod:`unimp.blockscale_presets`
(its tiles per role, scale rule and variant) and the element format per role:

* ``mxfp8``: Transformer Engine ``MXFP8BlockScaling`` (1x32 blocks, E8M0 scales rounded up;
  ``fp8_format=Format.E4M3``, its default, for every tensor, as arXiv 2506.08027 recommends).
* ``fp8_block``: Transformer Engine ``Float8BlockScaling`` (DeepSeek-V3 style: 1x128 blocks for
  ``x`` and ``g`` (``x_block_scaling_dim = grad_block_scaling_dim = 1``), 128x128 tiles for
  ``W`` (``w_block_scaling_dim = 2``), power-of-two float32 scales, E4M3 for every tensor).
* ``nvfp4``: Transformer Engine ``NVFP4BlockScaling`` (E2M1 elements, E4M3 block scales and a
  float32 tensor scale; 1x16 blocks for ``x`` and ``g``, 16x16 tiles for ``W``; the gradient's
  two copies rounded stochastically, ``fp4_quant_bwd_grad.stochastic_rounding``), and the
  weight-gradient GEMM's operands (``x`` and ``g`` blocked along ``M``) put through the 16-point
  random Hadamard transform along ``M`` before they are quantized
  (:func:`unimp.blockscale.random_hadamard_transform`, Transformer Engine's default,
  ``fp4_quant_fwd_inp`` / ``fp4_quant_bwd_grad.random_hadamard_transform``), their tensor
  scales taken from the transformed tensors (its post-RHT amax). The transform is orthogonal,
  so ``dW = (x T)^T (g T)`` is ``x^T g`` in exact arithmetic; it spreads an outlier over its 16
  rows, which changes what NVFP4 rounds away.
* ``nvfp4_no_rht``: ``nvfp4`` without the transform (Transformer Engine's
  ``NVFP4BlockScaling(disable_rht=True)``, ``NVTE_NVFP4_DISABLE_RHT=1``).
* ``mxfp4``: OCP MX v1.0's MXFP4 (1x32 blocks, E2M1 elements, the OCP floor scale rule;
  microsoft/microxcaling), every tensor alike. Transformer Engine has no MXFP4 recipe.

Emulation only: the operands are quantized and dequantized to float32
(:func:`unimp.blockscale_presets.block_quantize_dequantize`) and each GEMM is a float32 matmul
of the dequantized values, whose scales are inside them (a native block-scaled GEMM applies
them per block inside its accumulation: the same sum, in another order). NVFP4 as Transformer
Engine's GEMM computes it: the matmul multiplies ``q * s_block``
(:func:`unimp.blockscale.nvfp4_block_values`, at most 6 significant bits) and the result is
multiplied by ``alpha`` from the two tensor maxima (:func:`unimp.blockscale.nvfp4_gemm_alpha`,
``cublaslt_gemm.cu``: the tensor scales are applied to the output, not the inputs). The
backends cast the result to the compute dtype. Every quantized operand is the same in every framework, bit for
bit; a GEMM's float32 result is too wherever its sums are exact (small-significand values, a
limited spread of exponents), otherwise each framework's summation order decides its last bits,
as for any float32 matmul.

The namespace is :mod:`unimp.blockscale`'s (each backend's ``FP8Ops``) plus ``matmul`` (2-D
float32 product) and ``transpose`` (2-D): :class:`NumpyLinearOps` is the reference's, and each
backend's ``blockscale`` module (``unimp/backends/*/blockscale.py``) has its own.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, NamedTuple

import numpy as np

from unimp.blockscale import (
    RHT_SIZE,
    nvfp4_block_values,
    nvfp4_gemm_alpha,
    random_hadamard_transform,
)
from unimp.blockscale_presets import block_preset, block_quantize_dequantize
from unimp.fp8.rule import NumpyOps

__all__ = [
    "BLOCK_LINEAR_RULES",
    "GEMMS",
    "LAYOUTS",
    "BlockLinearRule",
    "GemmOperand",
    "NumpyLinearOps",
    "Saved",
    "block_linear_reference",
    "block_linear_rule",
    "check_layer_sizes",
    "check_linear_shapes",
    "gradient_bits",
    "linear_backward",
    "linear_forward",
    "quantize_along",
]

_E4M3, _E2M1 = "float8_e4m3fn", "float4_e2m1fn"

#: The weight layouts: ``"in_out"`` is ``(K, N)`` (Keras's and flax's kernel, JAX's ``x @ w``),
#: ``"out_in"`` is ``(N, K)`` (torch's ``nn.Linear.weight``, Transformer Engine's).
LAYOUTS = ("in_out", "out_in")


class GemmOperand(NamedTuple):
    """One operand of one of a linear layer's GEMMs and the axis its blocks lie along."""

    gemm: str  # "forward", "input_grad" or "weight_grad"
    operand: str  # "x", "w" or "g"
    role: str  # the preset's tensor role: "activation", "weight" or "gradient"
    along: str  # "K" (in features), "N" (out features) or "M" (batch rows): the GEMM's reduction


#: The six quantized operands of a linear layer's three GEMMs (module docstring): each GEMM's
#: two operands are blocked along its reduction axis.
GEMMS = (
    GemmOperand("forward", "x", "activation", "K"),
    GemmOperand("forward", "w", "weight", "K"),
    GemmOperand("input_grad", "g", "gradient", "N"),
    GemmOperand("input_grad", "w", "weight", "N"),
    GemmOperand("weight_grad", "x", "activation", "M"),
    GemmOperand("weight_grad", "g", "gradient", "M"),
)


@dataclasses.dataclass(frozen=True)
class BlockLinearRule:
    """One block-scaled linear recipe: a preset of :mod:`unimp.blockscale_presets` and the
    element format of each role (``formats``: activation, weight, gradient)."""

    name: str  # the key of BLOCK_LINEAR_RULES
    preset: str  # a key of unimp.blockscale_presets.BLOCK_PRESETS: tiles, scale rule, variant
    formats: tuple[str, str, str]  # element format per role: activation, weight, gradient
    source: str  # the recipe it follows
    notes: str = ""  # where the emulation departs from it
    hadamard: bool = False  # the weight-gradient GEMM's operands go through the random Hadamard transform

    def tile(self, role: str) -> tuple[int, int]:
        """The block shape ``(rows, columns)`` of ``role`` (one of ``"activation"``,
        ``"weight"``, ``"gradient"``), blocks lying along the columns."""
        return block_preset(self.preset).tile(role)

    def format(self, role: str) -> str:
        """The element format of ``role``."""
        return self.formats[("activation", "weight", "gradient").index(role)]

    def stochastic(self, role: str) -> bool:
        """Whether ``role``'s elements round stochastically (NVFP4's gradients)."""
        return block_preset(self.preset).rounding(role) == "stochastic"


#: Every block-scaled linear rule, by name (module docstring).
BLOCK_LINEAR_RULES: dict[str, BlockLinearRule] = {
    r.name: r
    for r in (
        BlockLinearRule(
            "mxfp8", "transformer_engine_mxfp8", (_E4M3,) * 3,
            "Transformer Engine MXFP8BlockScaling (fp8_format=Format.E4M3, its default)",
            "every tensor E4M3; x, W and g each quantized rowwise and columnwise from the input",
        ),
        BlockLinearRule(
            "fp8_block", "transformer_engine_block_fp8", (_E4M3,) * 3,
            "Transformer Engine Float8BlockScaling (x and g 1x128, W 128x128, power-of-two scales)",
            "the GEMMs are float32 matmuls of the dequantized values (TE: split accumulation)",
        ),
        BlockLinearRule(
            "nvfp4", "transformer_engine_nvfp4", (_E2M1,) * 3,
            "Transformer Engine NVFP4BlockScaling (x and g 1x16, W 16x16, gradients rounded stochastically, "
            "16-point random Hadamard transform on the weight-gradient GEMM's operands)",
            "stochastic rounding from unimp's seeded counter-based bits, not the hardware's; the Hadamard "
            "transform's float32 sums in a fixed order (TE's tensor cores' order where they are inexact)",
            hadamard=True,
        ),
        BlockLinearRule(
            "nvfp4_no_rht", "transformer_engine_nvfp4", (_E2M1,) * 3,
            "Transformer Engine NVFP4BlockScaling(disable_rht=True) (NVTE_NVFP4_DISABLE_RHT=1)",
            "stochastic rounding from unimp's seeded counter-based bits, not the hardware's",
        ),
        BlockLinearRule(
            "mxfp4", "ocp_mx", (_E2M1,) * 3,
            "OCP MX v1.0 MXFP4 (microsoft/microxcaling): 1x32 blocks, E8M0 floor scale, E2M1 elements",
            "Transformer Engine has no MXFP4 recipe; every tensor rounds to nearest even",
        ),
    )
}


def block_linear_rule(rule: Any) -> BlockLinearRule:
    """A :class:`BlockLinearRule`, given as itself or by name.

    Raises:
        ValueError: an unknown name, listing the valid ones and the closest match.
        TypeError: neither a rule nor a string.

    Example:
        >>> block_linear_rule("fp8_block").tile("weight")
        (128, 128)
    """
    if isinstance(rule, BlockLinearRule):
        return rule
    if not isinstance(rule, str):
        raise TypeError(f"a block-scaled linear rule is a name ({', '.join(BLOCK_LINEAR_RULES)}) or a "
                        f"BlockLinearRule, got {type(rule).__name__} {rule!r}.")
    key = rule.replace("-", "_")
    if key in BLOCK_LINEAR_RULES:
        return BLOCK_LINEAR_RULES[key]
    close = difflib.get_close_matches(key, list(BLOCK_LINEAR_RULES), n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown block-scaled linear rule {rule!r}; choose one of "
                     f"{', '.join(BLOCK_LINEAR_RULES)}.{hint}")


def _layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown weight layout {layout!r}; choose 'in_out' (W of shape (in, out), "
                         "Keras and JAX) or 'out_in' ((out, in), torch's nn.Linear).")
    return layout


def check_linear_shapes(rule: Any, m: int | None, k: int, n: int) -> None:
    """Checks that ``x`` ``(M, K)`` and ``W`` (``K`` inputs, ``N`` outputs) split into the
    rule's blocks along every axis a GEMM reduces over: ``K`` and ``N`` by the weight's tile
    (and the activation's / gradient's block), ``M`` by the activation's and the gradient's
    block (the weight-gradient GEMM blocks along the batch rows, as Transformer Engine's
    MXFP8 needs "the product of the other dimensions divisible by 32"). ``m=None`` checks
    ``K`` and ``N`` only: a forward pass without a backward quantizes nothing along ``M``.

    Raises:
        ValueError: the first size that does not split, naming it and the fix.
    """
    r = block_linear_rule(rule)
    need = {
        "M (the batch rows: the product of x's leading dimensions)":
            (m, math.lcm(r.tile("activation")[1], r.tile("gradient")[1], RHT_SIZE if r.hadamard else 1)),
        "K (in features)": (k, math.lcm(r.tile("activation")[1], *r.tile("weight"))),
        "N (out features)": (n, math.lcm(r.tile("gradient")[1], *r.tile("weight"))),
    }
    for what, (size, block) in need.items():
        if size is not None and size % block:
            raise ValueError(
                f"block-scaled linear {r.name!r}: {what} is {size}, not a multiple of {block}, the "
                f"block its GEMMs quantize along it; pad it to a multiple of {block} or keep this "
                "layer out of the recipe (its per-layer overrides, or the first/last-layer rule)."
            )


def check_layer_sizes(rule: Any, layers: list[tuple[str, int, int]]) -> None:
    """Refuses, before a swap changes anything, the layers whose in / out features do not split
    into ``rule``'s blocks (:func:`check_linear_shapes` with a batch that does; the batch rows
    are checked at call time), all of them named.

    Args:
        rule: a :class:`BlockLinearRule` or its name.
        layers: ``(path, in_features, out_features)`` of each selected layer.

    Raises:
        ValueError: every layer that does not split, with the fix.
    """
    r = block_linear_rule(rule)
    m = r.tile("activation")[1] * r.tile("gradient")[1]  # any multiple of both passes
    bad = []
    for path, k, n in layers:
        try:
            check_linear_shapes(r, m, k, n)
        except ValueError as err:
            bad.append(f"{path!r} ({str(err).split(': ', 1)[1].split(';')[0]})")
    if bad:
        raise ValueError(f"block-scaled recipe {r.name!r}: layers {', '.join(bad)}; keep them out "
                         f"(BlockRecipe(exclude=[...their paths...])) or pad their features.")


def quantize_along(ops: Any, a: Any, rule: Any, role: str, axis: int, bits: Any = None) -> Any:
    """``a`` (2-D, float32) quantized and dequantized by ``rule``'s preset for ``role`` with its
    blocks along ``axis`` (1: the rows' elements, "rowwise"; 0: the columns', "columnwise",
    quantized as ``transpose(Q(transpose(a)))`` from ``a`` itself).

    Args:
        ops: the namespace (:class:`NumpyLinearOps`, a backend's ``BlockOps``).
        a: float32 array ``(R, C)``.
        rule: a :class:`BlockLinearRule` or its name.
        role: ``"activation"``, ``"weight"`` or ``"gradient"``.
        axis: 0 or 1.
        bits: int32 random bits of the blocked layout's shape (``a``'s, or its transpose's for
            ``axis=0``) where the role rounds stochastically; else ignored.

    Returns:
        float32 array, ``a``'s shape.

    Raises:
        ValueError: an axis other than 0 or 1, or what
            :func:`unimp.blockscale_presets.block_quantize_dequantize` raises.
    """
    r = block_linear_rule(rule)
    if axis not in (0, 1):
        raise ValueError(f"quantize_along: axis must be 0 (columnwise) or 1 (rowwise), got {axis!r}.")
    b = bits if r.stochastic(role) else None
    if axis == 1:
        return block_quantize_dequantize(a, r.preset, role, r.format(role), b, ops)
    return ops.transpose(block_quantize_dequantize(ops.transpose(a), r.preset, role, r.format(role), b, ops))


class Saved(NamedTuple):
    """What the backward pass keeps from the forward pass: the columnwise copies, quantized
    there from the high-precision tensors (Transformer Engine quantizes both at once)."""

    x_m: Any  # (M, K), float32: x blocked along M (after the rule's Hadamard transform), for the weight-gradient GEMM
    w_n: Any  # W's layout, float32: W blocked along N, for the input-gradient GEMM
    amax_x: Any = None  # shape=(), float32: max|x_m's input| (x, or its transform), NVFP4's GEMM scale (None otherwise)
    amax_w: Any = None  # shape=(), float32: max|W|, likewise


def _tensor_scaled(r: BlockLinearRule) -> bool:
    """Whether the GEMMs apply the tensor scales to their result (Transformer Engine's NVFP4)."""
    p = block_preset(r.preset)
    return p.family == "nvfp4" and p.variant == "transformer_engine"


def _operand(ops: Any, a: Any, r: BlockLinearRule, role: str, axis: int, bits: Any = None) -> Any:
    """What a GEMM multiplies: :func:`quantize_along`'s values, or under NVFP4 ``q * s_block``
    (the tensor scale goes to the GEMM's result, :func:`unimp.blockscale.nvfp4_gemm_alpha`)."""
    if not _tensor_scaled(r):
        return quantize_along(ops, a, r, role, axis, bits)
    if axis not in (0, 1):
        raise ValueError(f"quantize_along: axis must be 0 (columnwise) or 1 (rowwise), got {axis!r}.")
    preset = block_preset(r.preset)
    b = bits if r.stochastic(role) else None
    if axis == 1:
        return nvfp4_block_values(a, preset.tile(role), preset.rounding(role), b, ops)
    return ops.transpose(nvfp4_block_values(ops.transpose(a), preset.tile(role), preset.rounding(role), b, ops))


def _scaled(ops: Any, r: BlockLinearRule, product: Any, amax_a: Any, amax_b: Any) -> Any:
    """A GEMM's float32 result, times NVFP4's ``alpha`` where the rule applies it."""
    if not _tensor_scaled(r):
        return product
    with np.errstate(over="ignore", invalid="ignore"):
        return product * nvfp4_gemm_alpha(amax_a, amax_b, ops)


def _amax(ops: Any, r: BlockLinearRule, a: Any) -> Any:
    return ops.amax(ops.abs(a)) if _tensor_scaled(r) else None


def _weight_grad_operand(ops: Any, a: Any, r: BlockLinearRule, role: str, bits: Any = None) -> tuple[Any, Any]:
    """The weight-gradient GEMM's operand from ``a`` (``(M, C)``: ``x`` or ``g``), blocked along
    ``M``, and its tensor amax (None unless NVFP4's GEMM scale takes one). Under a rule with
    ``hadamard``, ``a``'s columns go through the random Hadamard transform along ``M`` first
    and the amax is the transformed tensor's, as Transformer Engine's columnwise copy."""
    if r.hadamard:  # down M's columns: TE's transform of a's transpose, the same values
        a = random_hadamard_transform(a, axis=0, ops=ops)
    return _operand(ops, a, r, role, 0, bits), _amax(ops, r, a)


def _w_axis(layout: str, along: str) -> int:
    """The axis of ``W`` that is its ``along`` (``"K"`` or ``"N"``) in ``layout``."""
    return {("in_out", "K"): 0, ("in_out", "N"): 1, ("out_in", "K"): 1, ("out_in", "N"): 0}[(layout, along)]


def _quantize_w(ops: Any, w: Any, r: BlockLinearRule, layout: str, along: str) -> Any:
    return _operand(ops, w, r, "weight", _w_axis(layout, along))


def linear_forward(ops: Any, x2: Any, w: Any, rule: Any, layout: str = "in_out",
                   backward: bool = True) -> tuple[Any, Saved | None]:
    """The forward GEMM ``y = Q_K(x) @ Q_K(W)`` and the copies the backward pass needs.

    Args:
        ops: the namespace (:class:`NumpyLinearOps`, a backend's ``BlockOps``).
        x2: float32 ``(M, K)``: the input, flattened.
        w: float32 weight, ``(K, N)`` for ``layout="in_out"``, ``(N, K)`` for ``"out_in"``.
        rule: a :class:`BlockLinearRule` or its name.
        layout: one of :data:`LAYOUTS`.
        backward: whether a backward pass follows: without one (inference, evaluation) the
            columnwise copies are not made and ``M`` need not split into blocks.

    Returns:
        ``(y, saved)``: float32 ``(M, N)`` and :class:`Saved` (None without ``backward``). A
        weight with a 2-D tile is quantized once (its two copies are equal).

    Raises:
        ValueError: an unknown rule or layout, or sizes that do not split into the rule's
            blocks (:func:`check_linear_shapes`).
    """
    r = block_linear_rule(rule)
    layout = _layout(layout)
    # an unknown M (a traced batch, as Keras's predict traces the last partial batch) only
    # where nothing is quantized along it: a forward pass without a backward
    m = None if x2.shape[0] is None and not backward else int(x2.shape[0])
    k = int(x2.shape[1])
    n = int(w.shape[1 if layout == "in_out" else 0])
    check_linear_shapes(r, m if backward else None, k, n)
    x2, w = ops.f32(x2), ops.f32(w)
    qx_k = _operand(ops, x2, r, "activation", 1)
    qw_k = _quantize_w(ops, w, r, layout, "K")
    amax_x, amax_w = _amax(ops, r, x2), _amax(ops, r, w)
    y = _scaled(ops, r, ops.matmul(qx_k, qw_k if layout == "in_out" else ops.transpose(qw_k)), amax_x, amax_w)
    if not backward:
        return y, None
    qw_n = qw_k if r.tile("weight")[0] > 1 else _quantize_w(ops, w, r, layout, "N")
    qx_m, amax_x_m = _weight_grad_operand(ops, x2, r, "activation")
    return y, Saved(qx_m, qw_n, amax_x_m, amax_w)


def linear_backward(ops: Any, saved: Saved, g2: Any, rule: Any, layout: str = "in_out",
                    bits: tuple[Any, Any] | None = None) -> tuple[Any, Any]:
    """The input-gradient GEMM ``dx = Q_N(g) @ Q_N(W)^T`` and the weight-gradient GEMM
    ``dW = Q_M(x)^T @ Q_M(g)``, the output gradient ``g`` quantized twice from itself (under a
    rule with ``hadamard``, ``Q_M`` of ``x`` and ``g`` put through the random Hadamard
    transform along ``M``, :func:`unimp.blockscale.random_hadamard_transform`).

    Args:
        ops: the namespace, as :func:`linear_forward`.
        saved: :func:`linear_forward`'s :class:`Saved`.
        g2: float32 ``(M, N)``: the output gradient as it flows in (scaled, when a loss scale
            is on), flattened.
        rule: a :class:`BlockLinearRule` or its name.
        layout: one of :data:`LAYOUTS`.
        bits: where the rule rounds gradients stochastically (``nvfp4``): int32 random bits
            ``(row_bits (M, N), column_bits (N, M))`` (:func:`gradient_bits`).

    Returns:
        ``(dx, dW)``: float32 ``(M, K)`` and float32 in ``W``'s layout.

    Raises:
        ValueError: stochastic rounding without ``bits``, or an unknown rule or layout.
    """
    r = block_linear_rule(rule)
    layout = _layout(layout)
    row_bits = col_bits = None
    if r.stochastic("gradient"):
        if bits is None:
            raise ValueError(
                f"block-scaled linear {r.name!r} rounds gradients stochastically: pass "
                "bits=gradient_bits(ops, seed, step, M, N) (one seed and step give the same "
                "bits in every framework)."
            )
        row_bits, col_bits = bits
    g2 = ops.f32(g2)
    qg_n = _operand(ops, g2, r, "gradient", 1, row_bits)
    qg_m, amax_g_m = _weight_grad_operand(ops, g2, r, "gradient", col_bits)
    amax_g = _amax(ops, r, g2)
    qw_n = saved.w_n
    dx = _scaled(ops, r, ops.matmul(qg_n, ops.transpose(qw_n) if layout == "in_out" else qw_n), amax_g, saved.amax_w)
    if layout == "in_out":
        dw = ops.matmul(ops.transpose(saved.x_m), qg_m)
    else:
        dw = ops.matmul(ops.transpose(qg_m), saved.x_m)
    return dx, _scaled(ops, r, dw, saved.amax_x, amax_g_m)


def gradient_bits(ops: Any, seed: Any, step: Any, m: int, n: int) -> tuple[Any, Any]:
    """The random bits of a stochastically rounded ``(M, N)`` output gradient's two copies:
    :func:`unimp.rounding.random_bits` of ``(seed, step)`` with index 0 for the rowwise copy
    ``(M, N)`` and 1 for the columnwise one (blocked as the transpose, ``(N, M)``). unimp's
    seeded rule: Transformer Engine takes the hardware's random bits, which no framework
    reproduces.

    Args:
        ops: :mod:`unimp.rounding`'s namespace (a backend's ``UpdateOps``, or
            ``unimp.rounding.NumpyOps``).
        seed: an int (or int32 scalar); step: an int or an int32 device counter.
        m, n: the gradient's rows and columns.

    Returns:
        ``(row_bits, column_bits)``, int32 ``(M, N)`` and ``(N, M)``.
    """
    from unimp.rounding import random_bits

    return random_bits(ops, seed, step, 0, (m, n)), random_bits(ops, seed, step, 1, (n, m))


class NumpyLinearOps(NumpyOps):
    """The reference namespace: :class:`unimp.fp8.rule.NumpyOps` plus a float32 ``matmul``
    and a 2-D ``transpose``."""

    @staticmethod
    def matmul(a: Any, b: Any) -> Any:
        """``a @ b`` of 2-D float32 arrays, float32."""
        return np.matmul(np.asarray(a, np.float32), np.asarray(b, np.float32))

    @staticmethod
    def transpose(a: Any) -> Any:
        """The 2-D transpose."""
        return np.ascontiguousarray(np.transpose(a))


def block_linear_reference(x: Any, w: Any, g: Any, rule: Any, layout: str = "in_out",
                           seed: int = 0, step: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The NumPy reference of a block-scaled linear layer's forward and backward passes.

    Args:
        x: float32 ``(..., K)``; w: float32 in ``layout``; g: float32 ``(..., N)``, the output
            gradient.
        rule: a :class:`BlockLinearRule` or its name.
        layout: one of :data:`LAYOUTS`.
        seed, step: the stochastic rounding's bits (:func:`gradient_bits`), where the rule
            rounds gradients stochastically.

    Returns:
        ``(y, dx, dW)``: float32, of ``g``'s, ``x``'s and ``w``'s shapes.

    Raises:
        ValueError: as :func:`linear_forward` and :func:`linear_backward`.

    Example:
        >>> import numpy as np
        >>> x = np.full((32, 32), 0.3, np.float32); x[0, 0] = 449.0
        >>> w = np.eye(32, dtype=np.float32)
        >>> y, dx, dw = block_linear_reference(x, w, np.ones((32, 32), np.float32), "mxfp8")
        >>> y[0, :2].tolist()  # x's row 0 blocked along K: scale 2, 0.3 / 2 -> 0.15625 -> 0.3125
        [448.0, 0.3125]
        >>> dw[0, 0]  # x's column 0 blocked along M: 449 -> 448, 31 times 0.3 -> 0.3125
        np.float32(457.6875)
    """
    from unimp import rounding

    ops = NumpyLinearOps
    x, w, g = (np.asarray(a, np.float32) for a in (x, w, g))
    k = int(x.shape[-1])
    x2 = x.reshape(-1, k)
    with np.errstate(all="ignore"):
        y, saved = linear_forward(ops, x2, w, rule, layout)
        g2 = g.reshape(-1, int(y.shape[1]))
        bits = gradient_bits(rounding.NumpyOps, seed, step, *g2.shape) if block_linear_rule(rule).stochastic(
            "gradient") else None
        dx, dw = linear_backward(ops, saved, g2, rule, layout, bits)
    return y.reshape(*x.shape[:-1], -1), dx.reshape(x.shape), dw
