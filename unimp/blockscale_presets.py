"""Block-scaled format presets: each implementation's MXFP8, MXFP4, NVFP4 and block FP8 rule as
one row of a table over :mod:`unimp.blockscale`'s reference (issue 33). Framework-free.

A preset names the block shape per tensor role, the element format, the scale's type and
rounding, the element rounding, and the arithmetic variant of the reference function that
reproduces the implementation, with the file it was transcribed from (a path in that
implementation's repository). :func:`block_quantize_dequantize` runs one by name on any
namespace's tensors; :func:`block_preset_scales` gives the scale it picks for each block.

=============================  ======  =====  =======================  ===============================
preset                         blocks  elems  scale                    transcribed from
=============================  ======  =====  =======================  ===============================
ocp_mx                         1x32    E4M3*  E8M0, floor              microxcaling mx/mx_ops.py
transformer_engine_mxfp8       1x32    E4M3*  E8M0, round up           TE common/util/ptx.cuh
transformer_engine_block_fp8   1x128,  E4M3*  float32 2**k, floor      TE common/recipe/
                               128x128                                 recipe_common.cuh
transformer_engine_nvfp4       1x16,   E2M1   E4M3 x float32 global    TE pytorch/custom_recipes/
                               16x16                                   reference_nvfp4.py
torchao_mx                     1x32    E4M3*  E8M0, floor              torchao .../mx_tensor.py
torchao_mx_rceil               1x32    E4M3*  E8M0, round up (RCEIL)   torchao .../mx_tensor.py
torchao_nvfp4                  1x16    E2M1   E4M3 (>= 2**-6) x global torchao .../nvfp4_tensor.py
jax_mxfp8                      1x32    E4M3   E8M0, round up           jax/_src/cudnn/
                                                                       scaled_matmul_stablehlo.py
jax_nvfp4                      1x16    E2M1   E4M3 x float32 global    (same file)
=============================  ======  =====  =======================  ===============================

(* the default; the preset's ``elements`` lists the others it takes.)
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, NamedTuple

import numpy as np

from unimp import blockscale as bs
from unimp.fp8.rule import NumpyOps

__all__ = [
    "BLOCK_PRESETS",
    "BlockPreset",
    "QuantizationError",
    "QuantizationSums",
    "ROLES",
    "block_preset",
    "block_preset_scales",
    "block_quantize_dequantize",
    "quantization_error",
    "quantization_sums",
]

#: The tensor roles a preset gives a block shape and an element rounding for.
ROLES = ("activation", "weight", "gradient")

_E4M3, _E5M2, _E2M1 = "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"
_MX_TILES = ((1, 32), (1, 32), (1, 32))


@dataclasses.dataclass(frozen=True)
class BlockPreset:
    """One implementation's block-scaled rule.

    ``tiles`` and the roundings are per role of :data:`ROLES`; a tile is ``(rows, columns)``,
    rows being every axis but the last, flattened.
    """

    name: str  # the key of BLOCK_PRESETS
    implementation: str  # the native API, in words
    family: str  # "mx", "block_fp8" or "nvfp4": which reference function runs it
    elements: tuple[str, ...]  # element formats (keys of ELEMENT_FORMATS); the first is the default
    tiles: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]  # activation, weight, gradient
    scale_type: str  # "e8m0", "float32 power of two", "e4m3 x float32"
    scale_rounding: str  # "floor", "round_up", "pow2_floor" or "e4m3_nearest_even"
    element_rounding: tuple[str, str, str]  # per role: "nearest_even" or "stochastic" (NVFP4_ROUNDINGS)
    variant: str  # the reference function's variant
    source: str  # "owner/repo: path (function)" it was transcribed from
    notes: str = ""  # where the transcription stops

    def tile(self, role: str) -> tuple[int, int]:
        """The block shape for ``role`` (one of :data:`ROLES`)."""
        return self.tiles[_role(role)]

    def rounding(self, role: str) -> str:
        """The element rounding for ``role`` (one of :data:`ROLES`)."""
        return self.element_rounding[_role(role)]


def _role(role: str) -> int:
    if role not in ROLES:
        raise ValueError(f"unknown tensor role {role!r}; choose one of {', '.join(ROLES)}.")
    return ROLES.index(role)


_NEAREST = ("nearest_even",) * 3

#: Every preset, by name.
BLOCK_PRESETS: dict[str, BlockPreset] = {
    p.name: p
    for p in (
        BlockPreset(
            "ocp_mx", "OCP MX v1.0 (microsoft/microxcaling)", "mx", (_E4M3, _E5M2, _E2M1), _MX_TILES,
            "e8m0", "floor", _NEAREST, "reference",
            "microsoft/microxcaling: mx/mx_ops.py (_quantize_mx, shared_exp_method='max')",
            "elements round to nearest even as the OCP spec converts; microxcaling's emulator "
            "defaults to round='nearest', ties away from zero (not transcribed)",
        ),
        BlockPreset(
            "transformer_engine_mxfp8", "Transformer Engine MXFP8BlockScaling", "mx", (_E4M3, _E5M2),
            _MX_TILES, "e8m0", "round_up", _NEAREST, "transformer_engine",
            "NVIDIA/TransformerEngine: transformer_engine/common/util/ptx.cuh (float_to_e8m0, exp2f_rcp)",
            "rowwise 1x32 and columnwise 32x1 copies are quantized separately from the input; a "
            "byte-0 block (zero or tiny) is not scaled",
        ),
        BlockPreset(
            "transformer_engine_block_fp8", "Transformer Engine Float8BlockScaling", "block_fp8",
            (_E4M3, _E5M2), ((1, 128), (128, 128), (1, 128)), "float32 power of two", "pow2_floor",
            _NEAREST, "kernel",
            "NVIDIA/TransformerEngine: transformer_engine/common/recipe/recipe_common.cuh "
            "(compute_scale_from_amax)",
            "the CUDA kernels' amax skips NaN; the PyTorch reference (variant 'reference') gives "
            "an infinite amax S = 0",
        ),
        BlockPreset(
            "transformer_engine_nvfp4", "Transformer Engine NVFP4BlockScaling", "nvfp4", (_E2M1,),
            ((1, 16), (16, 16), (1, 16)), "e4m3 x float32", "e4m3_nearest_even",
            ("nearest_even", "nearest_even", "stochastic"), "transformer_engine",
            "NVIDIA/TransformerEngine: transformer_engine/pytorch/custom_recipes/reference_nvfp4.py "
            "(_quantize_blockwise_reference)",
            "gradients round stochastically with unimp's seeded bits (TE's cvt.rs bits are not "
            "reproducible); the random Hadamard transform of the weight-gradient GEMM's operands is the "
            "linear rule's (unimp.blockscale.random_hadamard_transform), not the quantizer's",
        ),
        BlockPreset(
            "torchao_mx", "torchao MXTensor.to_mx, ScaleCalculationMode.FLOOR (its default)", "mx",
            (_E4M3, _E5M2, _E2M1), _MX_TILES, "e8m0", "floor", _NEAREST, "torchao",
            "pytorch/ao: torchao/prototype/mx_formats/mx_tensor.py (to_mx)",
            "a byte-0 block divides by 2**-126 and multiplies back by 2**-127",
        ),
        BlockPreset(
            "torchao_mx_rceil", "torchao MXTensor.to_mx, ScaleCalculationMode.RCEIL", "mx",
            (_E4M3, _E5M2, _E2M1), _MX_TILES, "e8m0", "round_up", _NEAREST, "torchao",
            "pytorch/ao: torchao/prototype/mx_formats/mx_tensor.py (_to_mx_rceil)",
            "a byte-0 block is not scaled; its float32 log2 is taken as exact",
        ),
        BlockPreset(
            "torchao_nvfp4", "torchao NVFP4Tensor (dynamic per-tensor scale)", "nvfp4", (_E2M1,),
            ((1, 16),) * 3, "e4m3 x float32", "e4m3_nearest_even", _NEAREST, "torchao",
            "pytorch/ao: torchao/prototype/mx_formats/nvfp4_tensor.py (nvfp4_quantize)",
            "block scales clamped below at 2**-6",
        ),
        BlockPreset(
            "jax_mxfp8", 'jax.nn.scaled_dot_general, get_scaled_dot_general_config("mxfp8")', "mx",
            (_E4M3,), _MX_TILES, "e8m0", "round_up", _NEAREST, "jax",
            "jax-ml/jax: jax/_src/cudnn/scaled_matmul_stablehlo.py (quantize, cast_to_e8m0_with_rounding_up)",
            "inf amax gives byte 255 (a NaN block), NaN amax byte 0",
        ),
        BlockPreset(
            "jax_nvfp4", 'jax.nn.scaled_dot_general, get_scaled_dot_general_config("nvfp4")', "nvfp4",
            (_E2M1,), ((1, 16),) * 3, "e4m3 x float32", "e4m3_nearest_even", _NEAREST, "jax",
            "jax-ml/jax: jax/_src/cudnn/scaled_matmul_stablehlo.py (quantize)",
            "JAX takes the global scale from the user; unimp passes amax / (448 * 6)",
        ),
    )
}


def block_preset(name: str) -> BlockPreset:
    """The preset called ``name``.

    Raises:
        ValueError: an unknown name, listing the valid ones and the closest match.

    Example:
        >>> block_preset("transformer_engine_nvfp4").tile("weight")
        (16, 16)
    """
    if isinstance(name, str) and name in BLOCK_PRESETS:
        return BLOCK_PRESETS[name]
    close = difflib.get_close_matches(str(name), list(BLOCK_PRESETS), n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown block format preset {name!r}; choose one of {', '.join(BLOCK_PRESETS)}.{hint}")


def _element_of(p: BlockPreset, fmt: str | None) -> str:
    if fmt is None:
        return p.elements[0]
    if fmt not in p.elements:
        raise ValueError(f"preset {p.name!r} stores {', '.join(p.elements)} elements, got {fmt!r}.")
    return fmt


def block_quantize_dequantize(
    x: Any,
    preset: str,
    role: str = "activation",
    fmt: str | None = None,
    bits: Any = None,
    ops: Any = NumpyOps,
) -> Any:
    """``x`` quantized and dequantized as the implementation ``preset`` would, as float32.

    Runs the preset's family (:func:`unimp.blockscale.mx_quantize_dequantize`,
    :func:`~unimp.blockscale.block_fp8_quantize_dequantize` or
    :func:`~unimp.blockscale.nvfp4_quantize_dequantize`) with its tile for ``role``, its scale
    rule and its variant.

    Args:
        x: float32 array; its last dimension a multiple of the tile's columns and the product
            of the others of its rows (:meth:`BlockPreset.tile`).
        preset: a name of :data:`BLOCK_PRESETS`.
        role: one of :data:`ROLES`; picks the tile and the element rounding.
        fmt: an element format of the preset's ``elements`` (default: its first).
        bits: int32 random bits of ``x``'s shape, where the role rounds stochastically
            (Transformer Engine's NVFP4 gradients): :func:`unimp.rounding.random_bits`.
        ops: the array namespace (default NumPy, the reference; any backend's ``FP8Ops``).

    Returns:
        float32 array, ``x``'s shape.

    Raises:
        ValueError: an unknown preset (with the closest name) or role, an element format the
            preset does not store, a shape that does not split into its tiles, or stochastic
            rounding without ``bits``.

    Example:
        A block of 32 whose amax is 449: OCP's floor rule takes the scale 1 (449 is clipped to
        448) and keeps 0.001 as E4M3's smallest subnormal 2**-9; Transformer Engine's round-up
        rule takes the scale 2, and 0.001 / 2 rounds to 0.

        >>> import numpy as np
        >>> x = np.full((1, 32), 0.001, np.float32)
        >>> x[0, 0] = 449.0
        >>> [block_quantize_dequantize(x, p)[0, :2].tolist() for p in ("ocp_mx", "transformer_engine_mxfp8")]
        [[448.0, 0.001953125], [448.0, 0.0]]
    """
    p = block_preset(preset)
    tile = p.tile(role)
    elem = _element_of(p, fmt)
    if p.family == "mx":
        return bs.mx_quantize_dequantize(x, elem, p.scale_rounding, tile[1], ops, variant=p.variant)
    if p.family == "block_fp8":
        return bs.block_fp8_quantize_dequantize(x, elem, tile, True, p.variant, ops)
    return bs.nvfp4_quantize_dequantize(x, tile, p.rounding(role), bits, p.variant, ops)


def block_preset_scales(
    x: Any, preset: str, role: str = "activation", fmt: str | None = None, ops: Any = NumpyOps
) -> Any:
    """The scale each block of ``x`` dequantizes with under ``preset``: the E8M0 value
    ``2**(byte - 127)`` (NaN for byte 255), block FP8's ``1 / S``, or NVFP4's
    ``s_block * s_global``.

    Args:
        x, preset, role, fmt, ops: as :func:`block_quantize_dequantize`.

    Returns:
        float32 array ``(rows // tile[0], x.shape[-1] // tile[1])``, rows being the product of
        every axis but the last.

    Raises:
        ValueError: as :func:`block_quantize_dequantize`.
    """
    p = block_preset(preset)
    tile = p.tile(role)
    elem = _element_of(p, fmt)
    if p.family == "mx":  # mx_scales keeps x's leading axes: flattened to rows like the others
        byte = bs.mx_scales(x, elem, p.scale_rounding, tile[1], p.variant, ops)
        return ops.reshape(bs.e8m0_value(byte, ops), (-1, int(x.shape[-1]) // tile[1]))
    if p.family == "block_fp8":
        return ops.reciprocal(bs.block_fp8_scales(x, elem, tile, True, p.variant, ops))
    d, g = bs.nvfp4_scales(x, tile, p.variant, ops)
    with np.errstate(invalid="ignore", over="ignore"):  # torchao's and JAX's 0 / 0 of a zero tensor
        return d * g


class QuantizationError(NamedTuple):
    """What a block-scaled format does to one tensor (:func:`quantization_error`), as arrays of
    the namespace's framework."""

    underflow: Any  # shape=(), float32: share of the finite nonzero elements that became 0
    nonfinite: Any  # shape=(), float32: share of the finite elements that became inf or NaN
    relative_mse: Any  # shape=(), float32: sum((q - x)**2) / sum(x**2) where x and q are finite


class QuantizationSums(NamedTuple):
    """The counts and sums :func:`quantization_error`'s shares and ratio are made of
    (:func:`quantization_sums`), as arrays of the namespace's framework: what two tensors'
    errors add up from (the tensor statistics keep them so, :mod:`unimp.stats`)."""

    underflow: Any  # shape=(), int32: finite nonzero elements that became 0
    nonzero: Any  # shape=(), int32: finite nonzero elements
    nonfinite: Any  # shape=(), int32: finite elements that became inf or NaN
    finite: Any  # shape=(), int32: finite elements
    error: Any  # shape=(), float32: sum(((q - x) / unit)**2) where x and q are finite
    energy: Any  # shape=(), float32: sum((x / unit)**2) over the same elements
    unit: Any  # shape=(), float32: the largest finite |x| (1 when there is none)


def quantization_sums(
    x: Any,
    preset: str,
    role: str = "activation",
    fmt: str | None = None,
    bits: Any = None,
    ops: Any = NumpyOps,
) -> QuantizationSums:
    """The counts and sums behind :func:`quantization_error`, with the same arguments.

    The squared errors are taken relative to ``unit``, the tensor's largest finite magnitude,
    before squaring (``((q - x) / unit)**2``), so that no square overflows float32 nor
    underflows for ordinary tensors; ``error / energy`` is the relative MSE whatever the unit.

    Returns:
        :class:`QuantizationSums` of 0-d arrays (int32 counts, float32 sums).

    Raises:
        ValueError: as :func:`block_quantize_dequantize`.

    Example:
        >>> import numpy as np
        >>> x = np.full((1, 32), 0.001, np.float32)
        >>> x[0, 0] = 449.0
        >>> s = quantization_sums(x, "transformer_engine_mxfp8")
        >>> int(s.underflow), int(s.nonzero), float(s.unit)
        (31, 32, 449.0)
    """
    q = block_quantize_dequantize(x, preset, role, fmt, bits, ops)
    x = ops.f32(x)
    zero = ops.f32(0.0)
    finite = ops.isfinite(x)
    nonzero = finite & (x != zero)
    kept = finite & ops.isfinite(q)
    unit = ops.amax(ops.where(finite, ops.abs(x), zero))
    unit = ops.where(unit > zero, unit, ops.f32(1.0))  # no finite nonzero element: every sum is 0

    def count(mask: Any) -> Any:
        return ops.to_i32(ops.sum(ops.to_i32(mask)))

    with np.errstate(invalid="ignore", over="ignore"):
        err = ops.where(kept, (q - x) / unit, zero)
        ref = ops.where(kept, x / unit, zero)
        return QuantizationSums(
            underflow=count(nonzero & (q == zero)),
            nonzero=count(nonzero),
            nonfinite=count(finite & ~ops.isfinite(q)),
            finite=count(finite),
            error=ops.f32(ops.sum(err * err)),
            energy=ops.f32(ops.sum(ref * ref)),
            unit=unit,
        )


def quantization_error(
    x: Any,
    preset: str,
    role: str = "activation",
    fmt: str | None = None,
    bits: Any = None,
    ops: Any = NumpyOps,
) -> QuantizationError:
    """How much of ``x`` the format of ``preset`` loses: the share of its finite nonzero
    elements that quantize to zero (underflow: a block whose amax is far above them, or one
    that a rule leaves unscaled), the share of its finite elements that come back inf or NaN
    (a NaN block), and the relative mean squared error over the elements that stay finite.

    unimp's definitions, from :func:`quantization_sums`: the errors are taken relative to the
    tensor's largest finite magnitude before squaring (``((q - x) / amax)**2``), so no square
    overflows float32 nor underflows for ordinary tensors; a tensor without finite nonzero
    elements has all three 0.

    Args:
        x: float32 array, as :func:`block_quantize_dequantize` takes it.
        preset: a name of :data:`BLOCK_PRESETS`.
        role, fmt, bits: as :func:`block_quantize_dequantize`.
        ops: the array namespace (default NumPy, the reference; any backend's ``FP8Ops``); it
            needs ``sum`` besides the quantizer's names.

    Returns:
        :class:`QuantizationError` of float32 scalars.

    Raises:
        ValueError: as :func:`block_quantize_dequantize`.

    Example:
        One block of 32: 449 and 31 times 0.001. Round-up scales it by 2 and every 0.001
        underflows (0.0005 is below half of E4M3's smallest subnormal 2**-9); OCP's floor keeps
        them as 2**-9.

        >>> import numpy as np
        >>> x = np.full((1, 32), 0.001, np.float32)
        >>> x[0, 0] = 449.0
        >>> [float(quantization_error(x, p).underflow) for p in ("ocp_mx", "transformer_engine_mxfp8")]
        [0.0, 0.96875]
    """
    s = quantization_sums(x, preset, role, fmt, bits, ops)
    one, zero = ops.f32(1.0), ops.f32(0.0)

    def ratio(num: Any, den: Any) -> Any:
        num, den = ops.f32(num), ops.f32(den)
        return ops.where(den > zero, num / ops.where(den > zero, den, one), zero)

    return QuantizationError(
        underflow=ratio(s.underflow, s.nonzero),
        nonfinite=ratio(s.nonfinite, s.finite),
        relative_mse=ratio(s.error, s.energy),
    )
