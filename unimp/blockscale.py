"""Block-scaled low-precision formats (MXFP8, MXFP4, NVFP4, block FP8): the scale rules and
quantize-dequantize emulation, written once over an array namespace (issue 33). Framework-free.

A block-scaled tensor stores each block of 16 or 32 elements as low-precision elements and one
shared scale. The MX formats (OCP Microscaling v1.0) keep the scale as E8M0: an unsigned byte
``b`` standing for ``2**(b - 127)`` (byte 255 is NaN; there is no zero). Implementations differ
in how they derive that byte from the block's largest magnitude (amax), and the difference is
visible in training (arXiv 2506.08027), so unimp writes each rule out from the float32 bits,
never through a dtype cast (ml_dtypes rounds float32 -> E8M0 to nearest and turns 0 and inf
into NaN):

* :func:`e8m0_floor`, the OCP MX v1.0 rule (microsoft/microxcaling ``mx/mx_ops.py``; torchao
  ``ScaleCalculationMode.FLOOR``): ``floor(log2(amax)) - emax_elem``, clamped to
  ``[-127, 127]``, where ``emax_elem`` is the element format's largest power-of-two exponent
  (E4M3 8, E5M2 15, E2M1 2). A block amax between the element maximum and the next power of
  two (449 for E4M3) then scales to above the maximum, and its largest elements are clipped.
* :func:`e8m0_round_up`, NVIDIA's rule (Transformer Engine ``float_to_e8m0`` in
  ``common/util/ptx_arch_spec.cuh``, cuBLAS, JAX's ``scaled_dot_general`` mxfp8, torchao's
  MXFP8 training recipes): ``amax / elem_max`` rounded UP to a power of two, saturating at
  byte 254; NaN gives 255, inf 254, 0 gives 0.

Around these rules the implementations part on the smallest and the special blocks
(Transformer Engine leaves a byte-0 block unscaled, torchao's FLOOR divides it by 2**-126, JAX
gives inf byte 255): :data:`MX_VARIANTS`, described at :func:`mx_scales`. Each
implementation's whole rule (block shape per role, element, scale, variant, source) is a preset
of :mod:`unimp.blockscale_presets`.

Block FP8 (Transformer Engine ``Float8BlockScaling``, the DeepSeek-V3 recipe) keeps a float32
scale per 1x128 or 128x128 tile instead: ``S = fmax / amax``, floored to a power of two by
default (:func:`block_fp8_scale`, :func:`block_fp8_quantize_dequantize`). NVFP4 (Transformer
Engine ``NVFP4BlockScaling``) stores E2M1 elements with an E4M3 scale per 1x16 or 16x16 tile and
one float32 scale per tensor, ``x = q * s_block * s_global``
(:func:`nvfp4_quantize_dequantize`); before quantizing the weight-gradient GEMM's operands it
applies a 16-point random Hadamard transform (:func:`random_hadamard_transform`).

The namespace is :class:`unimp.fp8.rule.NumpyOps`'s (``bits``, ``from_bits``, ``where``,
``isnan``, ``isinf``, ``f32``, ``to_i32``, and ``reshape``, ``amax``, ``amax_axes``,
``clip``, ``round``, ``round_fp8``, ``pow2_floor``, ``reciprocal``, ``floor`` for the
quantizers, ``concat`` for the Hadamard transform); every backend's ``FP8Ops``
(``unimp/backends/*/fp8.py``) has the same names and gives the same bits on its own tensors,
eagerly and compiled by XLA (``tests/conformance/test_blockscale_conformance.py``). Integer
fields are taken with ``//`` and ``%`` (TensorFlow's tensors have no shift operators), and no
step multiplies or divides by a float32 subnormal, which XLA and TensorFlow flush to 0; results
that are themselves subnormal (below 2**-126) are flushed there and are not promised alike.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from unimp.fp8.rule import NumpyOps

__all__ = [
    "BLOCK_FP8_TILES",
    "BLOCK_FP8_VARIANTS",
    "ELEMENT_FORMATS",
    "E8M0_NAN",
    "MX_BLOCK",
    "MX_VARIANTS",
    "NVFP4_ROUNDINGS",
    "NVFP4_TILES",
    "NVFP4_VARIANTS",
    "RHT_SIGNS",
    "RHT_SIZE",
    "SCALE_RULES",
    "block_fp8_quantize_dequantize",
    "block_fp8_scale",
    "block_fp8_scales",
    "e8m0_floor",
    "e8m0_round_up",
    "e8m0_value",
    "hadamard_matrix",
    "mx_quantize_dequantize",
    "mx_scales",
    "nvfp4_block_scale",
    "nvfp4_block_values",
    "nvfp4_gemm_alpha",
    "nvfp4_global_scale",
    "nvfp4_quantize_dequantize",
    "nvfp4_scales",
    "random_hadamard_transform",
    "round_bf16",
    "round_e2m1",
    "round_e2m1_stochastic",
]

#: The MX block size along the reduction (last) axis (OCP MX v1.0).
MX_BLOCK = 32

#: The element formats: name -> (largest finite value, its power-of-two exponent ``emax_elem``).
ELEMENT_FORMATS = {
    "float8_e4m3fn": (448.0, 8),
    "float8_e5m2": (57344.0, 15),
    "float4_e2m1fn": (6.0, 2),
}

#: The E8M0 byte that stands for NaN (OCP MX v1.0: there is no zero and no infinity).
E8M0_NAN = 255

# float32 fields in integer arithmetic (// and % floor, as shifts and masks would; TensorFlow's
# tensors have no shift operators): bits // _MANTISSA % _EXPONENTS is the biased exponent
_MANTISSA = 2**23
_EXPONENTS = 256


def _element(fmt: str) -> tuple[float, int]:
    try:
        return ELEMENT_FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown element format {fmt!r}; choose one of {', '.join(ELEMENT_FORMATS)}.") from None


def e8m0_floor(amax: Any, fmt: str, ops: Any = NumpyOps) -> Any:
    """The OCP MX v1.0 shared-scale byte of blocks whose largest magnitude is ``amax``.

    ``floor(log2(amax)) - emax_elem`` clamped to ``[-127, 127]``, plus the bias 127: from the
    float32 exponent bits (an amax of 0 or a subnormal one gives byte 0, the smallest scale);
    a NaN amax gives :data:`E8M0_NAN`, an infinite one byte 254 (the largest scale).

    Args:
        amax: float32 array of block maxima (any shape), finite values >= 0, inf or NaN.
        fmt: the element format, a key of :data:`ELEMENT_FORMATS`.
        ops: the array namespace (default NumPy, the reference).

    Returns:
        int32 array of E8M0 bytes, ``amax``'s shape.

    Raises:
        ValueError: an unknown element format.
    """
    _, emax = _element(fmt)
    biased = (ops.bits(ops.f32(amax)) // _MANTISSA) % _EXPONENTS  # floor(log2(amax)) + 127
    byte = biased - emax  # the bias stays: byte = floor(log2(amax)) - emax + 127
    byte = ops.where(biased == 0, 0, byte)  # 0 and subnormal maxima: the smallest scale
    byte = ops.where(byte < 0, 0, ops.where(byte > 254, 254, byte))
    byte = ops.where(ops.isinf(ops.f32(amax)), 254, byte)  # floor(log2(inf)) clamps to 127
    return ops.to_i32(ops.where(ops.isnan(ops.f32(amax)), E8M0_NAN, byte))


def e8m0_round_up(amax: Any, fmt: str, ops: Any = NumpyOps) -> Any:
    """NVIDIA's shared-scale byte: ``amax / elem_max`` rounded up to a power of two.

    Matches Transformer Engine's ``float_to_e8m0`` of ``amax * rn(1 / elem_max)``
    (``__nv_cvt_float_to_e8m0`` with round toward +inf and saturation to finite): NaN gives
    255, inf 254, 0 gives 0; otherwise the float32 exponent of the quotient, plus one where its
    mantissa is not zero (not past 254, and a subnormal quotient at most 2**-127 stays at byte
    0, which stands for 2**-127). ``amax / elem_max`` and ``amax * rn(1 / elem_max)`` give the
    same byte for the formats here (a test checks it on two million amaxes).

    Args, returns and errors: as :func:`e8m0_floor`.
    """
    fmax, _ = _element(fmt)
    a = ops.f32(amax)
    inv = ops.f32(1.0) / ops.f32(fmax)  # rn(1 / elem_max), as Transformer Engine takes it
    v = a * inv
    b = ops.bits(v)
    exponent = (b // _MANTISSA) % _EXPONENTS
    mantissa = b % _MANTISSA
    up = (mantissa > 0) & (exponent != 254) & ~((exponent == 0) & (mantissa <= 0x400000))
    byte = ops.where(up, exponent + 1, exponent)
    byte = ops.where(v == ops.f32(0.0), 0, byte)
    byte = ops.where(ops.isinf(v), 254, byte)
    return ops.to_i32(ops.where(ops.isnan(v), E8M0_NAN, byte))


def e8m0_value(byte: Any, ops: Any = NumpyOps) -> Any:
    """The scale an E8M0 byte stands for, float32 ``2**(byte - 127)`` from its bits (byte 0 is
    the subnormal 2**-127, byte 255 NaN).

    Args:
        byte: int32 array of bytes in [0, 255].
        ops: the array namespace (default NumPy, the reference).

    Returns:
        float32 array, ``byte``'s shape.
    """
    bits = ops.where(byte == 0, 0x400000, byte * _MANTISSA)
    return ops.where(byte == E8M0_NAN, ops.f32(float("nan")), ops.from_bits(bits))


def round_e2m1(x: Any, ops: Any = NumpyOps) -> Any:
    """``x`` (float32, within [-6, 6]: callers clip first) rounded to the nearest E2M1 (FP4)
    value, ties to even, as float32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.

    Written in arithmetic, not a dtype cast (ml_dtypes' float4_e2m1fn turns inf into 6 and NaN
    into -0): the spacing is 0.5 below 2, 1 below 4 and 2 from 4 on, and ``round(|x| / s) * s``
    rounds half to even (a tie between 4 and 6 goes to 4, whose mantissa bit is 0). NaN stays
    NaN and the sign (of -0.0 too) is kept.
    """
    return _on_e2m1_grid(x, ops.round, ops)


def _on_e2m1_grid(x: Any, to_integer: Any, ops: Any) -> Any:
    """``to_integer(|x| / s) * s`` with the sign of ``x`` (-0.0 and NaN kept), ``s`` being
    E2M1's spacing at ``|x|``: 0.5 below 2, 1 below 4, 2 from 4 on (``|x| / s`` is exact)."""
    a = ops.abs(ops.f32(x))
    s = ops.where(a < ops.f32(2.0), ops.f32(0.5), ops.where(a < ops.f32(4.0), ops.f32(1.0), ops.f32(2.0)))
    q = to_integer(a / s) * s
    return ops.where(x < ops.f32(0.0), -q, ops.where(x > ops.f32(0.0), q, x))


#: How an MX block's E8M0 scale is derived from its amax: the OCP rule or NVIDIA's.
SCALE_RULES = {"floor": e8m0_floor, "round_up": e8m0_round_up}


#: Whose MX arithmetic around the scale rule (see :func:`mx_scales`): the OCP spec's exact
#: division, or what Transformer Engine, torchao or JAX do with the smallest and the special bytes.
MX_VARIANTS = ("reference", "transformer_engine", "torchao", "jax")

#: The variants that define one rule only: Transformer Engine's MXFP8 and JAX's mxfp8 round up.
_MX_VARIANT_RULES = {"transformer_engine": "round_up", "jax": "round_up"}


def _mx_blocks(ops: Any, x: Any, fmt: str, rule: str, block: int, variant: str) -> tuple[Any, tuple[int, ...]]:
    """``x`` (float32) as ``(..., n_blocks, block)``, and its shape, after checking the arguments."""
    _element(fmt)
    if rule not in SCALE_RULES:
        raise ValueError(f"unknown scale rule {rule!r}; choose one of {', '.join(SCALE_RULES)}.")
    if variant not in MX_VARIANTS:
        raise ValueError(f"unknown MX variant {variant!r}; choose one of {', '.join(MX_VARIANTS)}.")
    if _MX_VARIANT_RULES.get(variant, rule) != rule:
        raise ValueError(
            f"the {variant!r} MX variant rounds the scale up only: pass rule='round_up', or "
            "variant='reference' for the OCP floor rule."
        )
    shape = _shape(x)
    if not shape or shape[-1] % block:
        raise ValueError(
            f"the last dimension ({shape[-1] if shape else 'none'}) must be a multiple of the "
            f"block size {block}; pad the tensor or pick layers whose width is."
        )
    return ops.reshape(ops.f32(x), (*shape[:-1], shape[-1] // block, block)), shape


def _mx_exponents(ops: Any, blocks: Any, fmt: str, rule: str, variant: str) -> tuple[Any, Any, Any]:
    """Blocks -> (E8M0 byte, the exponent ``e`` dequantization multiplies by ``2**e``, the
    exponent quantization divides by), each ``(..., n_blocks, 1)``; see :func:`mx_scales`."""
    _, emax = _element(fmt)
    amax = ops.amax_axes(ops.abs(blocks), (-1,))
    byte = SCALE_RULES[rule](amax, fmt, ops)
    if variant == "jax":  # cast_to_e8m0_with_rounding_up: inf's exponent 255 stays, NaN's wraps
        byte = ops.where(ops.isinf(amax), E8M0_NAN, ops.where(ops.isnan(amax), 0, byte))
    if variant == "torchao" and rule == "floor":  # clamped to [-127, 128]: inf keeps its exponent
        byte = ops.where(ops.isinf(amax), 255 - emax, byte)
    e = ops.where(byte == E8M0_NAN, 127, byte) - 127
    if variant == "transformer_engine" or (variant == "torchao" and rule == "round_up"):
        e_q = ops.where(byte == 0, 0, e)  # exp2f_rcp(0) is 1: the block is not scaled
    elif variant == "torchao":
        e_q = ops.where(byte == 0, -126, e)  # divides by max(2**-127, F32_MIN_NORMAL)
    else:
        e_q = e
    return byte, e, e_q


def mx_scales(
    x: Any, fmt: str, rule: str, block: int = MX_BLOCK, variant: str = "reference", ops: Any = NumpyOps
) -> Any:
    """The E8M0 byte each MX block of ``x`` takes: :data:`SCALE_RULES` of its amax (NaN
    propagating), as the ``variant`` turns it.

    The variants agree wherever the block's amax is finite and its byte is not 0 (an amax
    above ``elem_max * 2**-127``); they differ on the smallest blocks and the special values:

    * ``"reference"``: OCP MX v1.0 (and NVIDIA's rule with ``rule="round_up"``): elements are
      ``x / 2**(byte - 127)``, exactly, byte 0 included (2**-127).
    * ``"transformer_engine"`` (round-up only; ``common/util/ptx.cuh``): elements are
      ``x * exp2f_rcp(byte)``, and ``exp2f_rcp(0)`` is 1, so a block with byte 0 (a zero or
      tiny block, amax at most ``448 * 2**-127`` for E4M3) is not scaled at all: its tiny
      elements round to 0.
    * ``"torchao"`` (``torchao/prototype/mx_formats/mx_tensor.py``, ``to_mx``): with
      ``ScaleCalculationMode.RCEIL`` (``rule="round_up"``), ``_to_mx_rceil`` likewise leaves a
      byte-0 block unscaled; with ``FLOOR`` the scale it divides by is clamped below at
      ``F32_MIN_NORMAL`` (2**-126) while dequantization multiplies by 2**-127, so a tiny block
      comes back at about half its values; and an infinite amax keeps its float32 exponent
      (byte ``255 - emax_elem``: 247 for E4M3, not 254). Not transcribed: RCEIL takes
      ``ceil(torch.log2(amax / max))`` in float32, which can miss the round-up of a quotient a
      few ulps above a large power of two.
    * ``"jax"`` (round-up only; ``jax/_src/cudnn/scaled_matmul_stablehlo.py``,
      ``cast_to_e8m0_with_rounding_up``): the same bits as NVIDIA's rule, but an infinite amax
      gives byte 255 (so the block is NaN) and a NaN amax byte 0 (its exponent 255 + 1 wraps).

    Args:
        x: float32 array whose last dimension is a multiple of ``block``.
        fmt: the element format, a key of :data:`ELEMENT_FORMATS`.
        rule: ``"floor"`` (OCP MX v1.0) or ``"round_up"`` (NVIDIA).
        block: elements per block (32 for MX).
        variant: one of :data:`MX_VARIANTS`.
        ops: the array namespace (default NumPy, the reference); it needs ``reshape`` and
            ``amax_axes`` (the NaN-propagating max over some axes, keeping them) besides the
            scale rules' names.

    Returns:
        int32 array of bytes, shape ``(*x.shape[:-1], x.shape[-1] // block)``; the block's
        scale is :func:`e8m0_value` of it.

    Raises:
        ValueError: an unknown format, rule or variant, a variant that has no floor rule, or a
            last dimension that is not a multiple of ``block``.
    """
    blocks, shape = _mx_blocks(ops, x, fmt, rule, block, variant)
    byte, _, _ = _mx_exponents(ops, blocks, fmt, rule, variant)
    return ops.reshape(byte, (*shape[:-1], shape[-1] // block))


def mx_quantize_dequantize(
    x: Any, fmt: str, rule: str, block: int = MX_BLOCK, ops: Any = NumpyOps, variant: str = "reference"
) -> Any:
    """The MX format's values of ``x``, as float32: each block of ``block`` consecutive elements
    along the last axis shares one E8M0 scale (:func:`mx_scales`); its elements are
    ``x / scale`` clipped to the element format's range and rounded to nearest even (E4M3 /
    E5M2: :meth:`round_fp8`; E2M1: :func:`round_e2m1`), times the scale again. A block whose
    byte is 255 (NaN) becomes NaN.

    Args:
        x, fmt, rule, block, variant: as :func:`mx_scales`.
        ops: the array namespace (default NumPy, the reference); as :func:`mx_scales`.

    Returns:
        float32 array, ``x``'s shape.

    Raises:
        ValueError: as :func:`mx_scales`.
    """
    fmax, _ = _element(fmt)
    blocks, shape = _mx_blocks(ops, x, fmt, rule, block, variant)
    byte, e, e_q = _mx_exponents(ops, blocks, fmt, rule, variant)
    nan = byte == E8M0_NAN
    with np.errstate(over="ignore"):  # an infinite block's 448 * 2**127 is inf, as in division
        y = ops.clip(_times_pow2(blocks, -e_q, ops), -fmax, fmax)
        q = round_e2m1(y, ops) if fmt == "float4_e2m1fn" else ops.round_fp8(y, fmt)
        out = ops.where(nan, ops.f32(float("nan")), _times_pow2(q, e, ops))
    return ops.reshape(out, shape)


def _times_pow2(x: Any, e: Any, ops: Any) -> Any:
    """``x * 2**e`` (float32 ``x``, int32 ``e`` in [-254, 254]) as two factors ``2**(e // 2)``
    and ``2**(e - e // 2)``, each a normal float32: exact wherever the result is a normal
    float32, as dividing by the E8M0 scale is, and no subnormal operand (the scale 2**-127 of
    byte 0) meets a framework that flushes them to 0 (XLA and TensorFlow: ``0 / 2**-127``
    would be NaN). The factor lying between ``x`` and the result in size, it underflows only
    where the result does."""
    h = e // 2
    return (x * ops.from_bits((h + 127) * _MANTISSA)) * ops.from_bits((e - h + 127) * _MANTISSA)


# --- Block FP8 (Transformer Engine Float8BlockScaling, DeepSeek-V3 style) ---------------------

#: Transformer Engine ``Float8BlockScaling``'s tiles, ``(rows, columns)``: 1x128 along the last
#: axis for activations and gradients, 128x128 for weights (``transformer_engine/common/recipe``).
BLOCK_FP8_TILES = {"activation": (1, 128), "gradient": (1, 128), "weight": (128, 128)}

#: The largest finite float32 (``FLT_MAX``).
_F32_MAX = float(np.finfo(np.float32).max)

#: How a block FP8 scale treats an infinite or NaN amax: Transformer Engine's PyTorch reference
#: or its CUDA kernels (see :func:`block_fp8_scale`).
BLOCK_FP8_VARIANTS = ("reference", "kernel")


def _shape(x: Any) -> tuple[int, ...]:
    """``x``'s shape for the reshapes into blocks and back: a dimension not known while tracing
    (TensorFlow's traced batch, as Keras's predict traces its last batch) as -1, what is left."""
    return tuple(-1 if d is None else int(d) for d in x.shape)


def _tiled(ops: Any, x: Any, tile: tuple[int, int], what: str) -> tuple[Any, tuple[int, ...]]:
    """``x`` (float32) as ``(rows // tr, tr, cols // tc, tc)`` tiles (rows: every axis but the
    last, flattened), and ``x``'s shape (:func:`_shape`); raises ValueError naming the fix."""
    shape = _shape(x)
    tr, tc = tile
    if tr < 1 or tc < 1:
        raise ValueError(f"{what}: a tile is two positive sizes (rows, columns), got {tile!r}.")
    if len(shape) < (2 if tr > 1 else 1):
        raise ValueError(
            f"{what}: a {tr}x{tc} tile needs a tensor of {2 if tr > 1 else 1} or more dimensions, "
            f"got shape {shape}; reshape it to (rows, columns) first."
        )
    # rows not known while tracing (a traced batch) split into 1-row tiles only
    if tr > 1 and -1 in shape[:-1]:
        raise ValueError(f"{what}: a {tr}x{tc} tile needs the rows known, got a traced shape {shape}; "
                         "give the traced function static shapes (an input_signature with the batch size).")
    rows = None if -1 in shape[:-1] else math.prod(shape[:-1])
    if shape[-1] % tc or (rows is not None and rows % tr):
        raise ValueError(
            f"{what}: shape {shape} does not split into {tr}x{tc} tiles (the last dimension must "
            f"be a multiple of {tc}" + (f" and the product of the others of {tr}" if tr > 1 else "")
            + "); pad the tensor or pick layers whose sizes are."
        )
    return ops.reshape(ops.f32(x), (-1 if rows is None else rows // tr, tr, shape[-1] // tc, tc)), shape


def _check_block_fp8(fmt: str, variant: str) -> float:
    """The element format's largest value, after checking ``fmt`` and ``variant``."""
    if fmt not in ("float8_e4m3fn", "float8_e5m2"):
        raise ValueError(f"block FP8 stores float8_e4m3fn or float8_e5m2 elements, got {fmt!r}.")
    if variant not in BLOCK_FP8_VARIANTS:
        raise ValueError(f"unknown block FP8 variant {variant!r}; choose one of {', '.join(BLOCK_FP8_VARIANTS)}.")
    return _element(fmt)[0]


def block_fp8_scale(
    amax: Any, fmt: str = "float8_e4m3fn", pow2: bool = True, variant: str = "reference", ops: Any = NumpyOps
) -> Any:
    """The quantization scale ``S`` of block FP8 tiles whose largest magnitude is ``amax``.

    ``S = fmax / amax`` (a float32 division, correctly rounded: TE's ``__fdiv_rn``); a quotient
    past float32's range becomes ``FLT_MAX``; with ``pow2`` (the recipe's default) the power of
    two at or below it, by clearing the mantissa bits (TE's ``scale_bits &= 0xFF800000``; the
    reference's ``frexp`` / ``ldexp`` is the same floor). An amax of 0 gives ``S = 1``. Elements
    are stored as ``x * S``; the tile's dequantization scale is ``1 / S``.

    The two variants differ only where the amax is not finite:

    * ``"reference"``: Transformer Engine's PyTorch reference
      (``tests/pytorch/references/quantize_scale_calc.py``, ``scale_from_amax_tensor``, the
      issue's rule): an infinite amax gives ``S = 0`` (so ``1 / S`` is inf and the tile
      dequantizes to NaN); a NaN amax gives ``S = NaN`` (the reference divides by it; its
      ``frexp`` of NaN is platform-defined, unimp keeps the NaN).
    * ``"kernel"``: Transformer Engine's CUDA kernels (``common/recipe/recipe_common.cuh``,
      ``compute_scale_from_amax``): an infinite or NaN amax gives ``S = 1``. (The kernels take
      the amax with ``fmaxf``, which skips NaN: :func:`block_fp8_quantize_dequantize` does.)

    Args:
        amax: float32 array of tile maxima (any shape), values >= 0, inf or NaN.
        fmt: ``"float8_e4m3fn"`` (448) or ``"float8_e5m2"`` (57344).
        pow2: round ``S`` down to a power of two (Transformer Engine's default for this recipe,
            and required on Blackwell, where it runs as MXFP8).
        variant: one of :data:`BLOCK_FP8_VARIANTS`.
        ops: the array namespace (default NumPy, the reference).

    Returns:
        float32 array of scales, ``amax``'s shape.

    Raises:
        ValueError: an unknown or non-FP8 element format, or an unknown variant.
    """
    fmax = _check_block_fp8(fmt, variant)
    a = ops.f32(amax)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = ops.f32(fmax) / a  # amax 0: inf (replaced below); amax inf: 0; NaN: NaN
    s = ops.where(ops.isinf(s), ops.f32(_F32_MAX), s)
    if pow2:
        s = ops.where(ops.isnan(s), s, ops.pow2_floor(s))
    special = ops.f32(0.0) if variant == "reference" else ops.f32(1.0)
    s = ops.where(ops.isinf(a), special, s)
    if variant == "kernel":
        s = ops.where(ops.isnan(a), ops.f32(1.0), s)
    return ops.where(a == ops.f32(0.0), ops.f32(1.0), s)


def _block_fp8_tile_scales(ops: Any, tiles: Any, fmt: str, pow2: bool, variant: str) -> Any:
    """Tiles ``(R, tr, C, tc)`` -> their scales ``S``, ``(R, 1, C, 1)``; the kernels' amax skips NaN."""
    mag = ops.abs(tiles)
    if variant == "kernel":
        mag = ops.where(ops.isnan(mag), ops.f32(0.0), mag)  # fmaxf skips NaN
    return block_fp8_scale(ops.amax_axes(mag, (1, 3)), fmt, pow2, variant, ops)


def block_fp8_scales(
    x: Any,
    fmt: str = "float8_e4m3fn",
    tile: tuple[int, int] = BLOCK_FP8_TILES["activation"],
    pow2: bool = True,
    variant: str = "reference",
    ops: Any = NumpyOps,
) -> Any:
    """The scale ``S`` of each tile of ``x`` (:func:`block_fp8_scale` of its amax; with
    ``variant="kernel"`` an amax that skips NaN); the tile dequantizes by ``1 / S``.

    Args:
        x, fmt, tile, pow2, variant, ops: as :func:`block_fp8_quantize_dequantize`.

    Returns:
        float32 array ``(rows // tile[0], x.shape[-1] // tile[1])``, rows being the product of
        every axis but the last.

    Raises:
        ValueError: as :func:`block_fp8_quantize_dequantize`.
    """
    _check_block_fp8(fmt, variant)
    tiles, _ = _tiled(ops, x, tile, "block FP8")
    s = _block_fp8_tile_scales(ops, tiles, fmt, pow2, variant)
    return ops.reshape(s, (int(tiles.shape[0]), int(tiles.shape[2])))


def block_fp8_quantize_dequantize(
    x: Any,
    fmt: str = "float8_e4m3fn",
    tile: tuple[int, int] = BLOCK_FP8_TILES["activation"],
    pow2: bool = True,
    variant: str = "reference",
    ops: Any = NumpyOps,
) -> Any:
    """The block FP8 values of ``x``, as float32 (Transformer Engine ``Float8BlockScaling``,
    the DeepSeek-V3 recipe): every ``tile`` of ``x`` (rows: all axes but the last, flattened)
    has its own scale ``S`` (:func:`block_fp8_scale`) from its amax; its elements are
    ``x * S`` clipped to the format's range, rounded to nearest even (``round_fp8``), times
    ``1 / S``.

    Matches Transformer Engine's ``BlockwiseQuantizerReference``
    (``tests/pytorch/references/blockwise_quantizer_reference.py``: multiply, clamp, cast) with
    ``variant="reference"``; with ``variant="kernel"`` its CUDA kernels
    (``common/transpose/quantize_transpose_{vector,square}_blockwise.cu``), whose amax skips
    NaN, so NaN elements stay NaN, infinite ones saturate to the format's maximum and the rest
    of their tile is quantized as if they were absent. Transformer Engine quantizes a partial
    last tile over the elements it has; unimp asks for whole tiles.

    Args:
        x: float32 array; its last dimension a multiple of ``tile[1]`` and the product of the
            others a multiple of ``tile[0]``.
        fmt: ``"float8_e4m3fn"`` (the recipe's default for every tensor) or ``"float8_e5m2"``.
        tile: ``(rows, columns)``, a value of :data:`BLOCK_FP8_TILES` (1x128 activations and
            gradients, 128x128 weights) or any other.
        pow2, variant: as :func:`block_fp8_scale`.
        ops: the array namespace (default NumPy, the reference); besides the scale rule's
            names it needs ``reshape``, ``amax_axes``, ``clip``, ``reciprocal`` and
            ``round_fp8``.

    Returns:
        float32 array, ``x``'s shape.

    Raises:
        ValueError: a shape that does not split into tiles, or what :func:`block_fp8_scale`
            raises.

    Example:
        A row whose amax is 449 gets ``S = 0.5`` (448 / 449 floored): 449 -> 224.5 -> 224 ->
        448, and 0.3 -> 0.15 -> 0.15625 -> 0.3125.

        >>> import numpy as np
        >>> x = np.full((1, 128), 0.3, np.float32)
        >>> x[0, 0] = 449.0
        >>> block_fp8_quantize_dequantize(x)[0, :2].tolist()
        [448.0, 0.3125]
    """
    fmax = _check_block_fp8(fmt, variant)
    tiles, shape = _tiled(ops, x, tile, "block FP8")
    s = _block_fp8_tile_scales(ops, tiles, fmt, pow2, variant)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = ops.round_fp8(ops.clip(tiles * s, -fmax, fmax), fmt)
        if not pow2:
            return ops.reshape(q * ops.reciprocal(s), shape)
        # S = 2**k: times 1 / S = 2**-k by its exponent, no division (TensorFlow's graphs divide
        # vectors approximately) and no subnormal factor (1 / 2**127 is one); S = 0 (an
        # infinite amax, the reference's rule) has 1 / S = inf: q * inf is NaN, q being 0 or NaN
        k = (ops.bits(s) // _MANTISSA) % _EXPONENTS - 127
        out = ops.where(s == ops.f32(0.0), ops.f32(float("nan")), _times_pow2(q, -k, ops))
    return ops.reshape(out, shape)


# --- NVFP4 (Transformer Engine NVFP4BlockScaling) ---------------------------------------------

#: NVFP4's tiles, ``(rows, columns)``: 1x16 along the last axis for activations and gradients,
#: 16x16 for weights (Transformer Engine ``NVFP4BlockScaling``).
NVFP4_TILES = {"activation": (1, 16), "gradient": (1, 16), "weight": (16, 16)}

#: How NVFP4 rounds its elements: to nearest even, or stochastically (gradients).
NVFP4_ROUNDINGS = ("nearest_even", "stochastic")

#: Whose NVFP4 scale arithmetic: Transformer Engine's, torchao's or JAX's (see
#: :func:`nvfp4_quantize_dequantize`).
NVFP4_VARIANTS = ("transformer_engine", "torchao", "jax")

#: torchao's lower bound on an NVFP4 block scale: the smallest normal E4M3, 2**-6.
_TORCHAO_E4M3_TINY = 2.0**-6

_E4M3_MAX = 448.0
_E2M1_MAX = 6.0


def nvfp4_global_scale(global_amax: Any, ops: Any = NumpyOps) -> Any:
    """NVFP4's global encode scale ``S_enc = 448 * 6 / global_amax`` (float32), at most
    ``FLT_MAX``; 1 where the amax is 0 or infinite (the quotient is 0).

    Matches Transformer Engine's ``compute_global_encode_scaling_factor_FP4``
    (``common/cast/nvfp4/core_nvfp4.cuh``). Its PyTorch reference
    (``pytorch/custom_recipes/reference_nvfp4.py``) gives ``FLT_MAX`` for an amax of 0, not 1:
    the tensor is then all zeros and dequantizes to zeros either way. A NaN amax gives NaN.

    Args:
        global_amax: float32 scalar (or array) ``max(|x|)`` over the tensor.
        ops: the array namespace (default NumPy, the reference).

    Returns:
        float32, ``global_amax``'s shape.
    """
    a = ops.f32(global_amax)
    with np.errstate(divide="ignore", over="ignore"):
        s = ops.f32(_E4M3_MAX * _E2M1_MAX) / a  # 2688, exact in float32
    s = ops.where(s > ops.f32(_F32_MAX), ops.f32(_F32_MAX), s)
    return ops.where((a == ops.f32(0.0)) | (s == ops.f32(0.0)), ops.f32(1.0), s)


def nvfp4_block_scale(block_amax: Any, global_scale: Any, ops: Any = NumpyOps) -> Any:
    """NVFP4's block decode scale: ``e4m3(block_amax * (S_enc * rn(1/6)))``, as float32.

    Matches Transformer Engine's reference and kernels: the product (float32, rounded once
    each: ``rn(1/6)`` first, then ``S_enc * rn(1/6)``, then times the amax) clipped to
    ``[-448, 448]`` and rounded to the nearest E4M3 value, ties to even. A block holding the
    tensor's amax gets ``448 * 6 / amax * rn(1/6) * amax``, within a few ulps of 448 (E4M3's
    spacing there is 32), hence exactly 448 after rounding, unless ``S_enc`` was capped at
    ``FLT_MAX`` (a tensor amax below 2688 / FLT_MAX, about 7.9e-36). NaN stays NaN.

    Args:
        block_amax: float32 array of block maxima.
        global_scale: float32 ``S_enc`` (:func:`nvfp4_global_scale`), broadcastable.
        ops: the array namespace (default NumpyOps); needs ``clip`` and ``round_fp8``.

    Returns:
        float32 array of E4M3 values, ``block_amax``'s shape.
    """
    mult = ops.f32(global_scale) * (ops.f32(1.0) / ops.f32(_E2M1_MAX))
    with np.errstate(over="ignore"):
        d = ops.f32(block_amax) * mult
    return ops.round_fp8(ops.clip(d, -_E4M3_MAX, _E4M3_MAX), "float8_e4m3fn")


def round_e2m1_stochastic(x: Any, bits: Any, ops: Any = NumpyOps) -> Any:
    """``x`` (float32, within [-6, 6]) rounded to one of its two E2M1 neighbours, up (away
    from 0) with probability equal to its distance from the lower one over their spacing.

    unimp's seeded rule, not a transcription: Transformer Engine rounds NVFP4 gradients
    stochastically with the hardware's ``cvt.rs`` and its own random bits, which no other
    framework reproduces. Here the random fraction is the top 24 bits of ``bits`` (e.g.
    :func:`unimp.rounding.random_bits` of a seed, step and tensor index, the same counter-based
    hash every backend computes), ``u = (bits >>> 8) * 2**-24`` in [0, 1), and the magnitude
    rounds up where ``frac > u``; everything is exact in float32, so one seed gives the same
    values in every framework. NaN stays NaN, the sign is kept.

    Args:
        x: float32 array within [-6, 6] (callers clip first).
        bits: int32 array, ``x``'s shape: 32 random bits per element.
        ops: the array namespace (default NumPy, the reference).

    Returns:
        float32 array of E2M1 values, ``x``'s shape.
    """
    u = ops.to_f32((bits // 256) % 2**24) * ops.f32(2.0**-24)

    def up_with_probability_frac(t: Any) -> Any:  # t = |x| / s: exact, and so is t - floor(t)
        low = ops.floor(t)
        return ops.where(t - low > u, low + ops.f32(1.0), low)

    return _on_e2m1_grid(x, up_with_probability_frac, ops)


def _nvfp4_transformer_engine(ops: Any, tiles: Any) -> tuple[Any, Any, Any]:
    """Tiles -> (elements scaled and clipped, block decode scales, global decode scale)."""
    mag = ops.abs(tiles)
    s_enc = nvfp4_global_scale(ops.amax(mag), ops)
    g = ops.reciprocal(s_enc)
    d = nvfp4_block_scale(ops.amax_axes(mag, (1, 3)), s_enc, ops)
    enc = ops.reciprocal(d * g)
    enc = ops.where(enc > ops.f32(_F32_MAX), ops.f32(_F32_MAX), enc)
    return ops.clip(tiles * enc, -_E2M1_MAX, _E2M1_MAX), d, g


def _nvfp4_torchao(ops: Any, tiles: Any) -> tuple[Any, Any, Any]:
    mag = ops.abs(tiles)
    g = ops.amax(mag) / ops.f32(_E4M3_MAX * _E2M1_MAX)
    d = ops.clip((ops.amax_axes(mag, (1, 3)) / ops.f32(_E2M1_MAX)) / g, _TORCHAO_E4M3_TINY, _E4M3_MAX)
    d = ops.round_fp8(d, "float8_e4m3fn")
    return ops.clip(tiles * ((ops.f32(1.0) / g) / d), -_E2M1_MAX, _E2M1_MAX), d, g


def _nvfp4_jax(ops: Any, tiles: Any) -> tuple[Any, Any, Any]:
    g = ops.amax(ops.abs(tiles)) / ops.f32(_E4M3_MAX * _E2M1_MAX)
    z = tiles / g
    d = ops.round_fp8(ops.clip(ops.amax_axes(ops.abs(z), (1, 3)) / ops.f32(_E2M1_MAX), 0.0, _E4M3_MAX), "float8_e4m3fn")
    return ops.clip(z / d, -_E2M1_MAX, _E2M1_MAX), d, g


_NVFP4_SCALES = {"transformer_engine": _nvfp4_transformer_engine, "torchao": _nvfp4_torchao, "jax": _nvfp4_jax}


def nvfp4_scales(
    x: Any, tile: tuple[int, int] = NVFP4_TILES["activation"], variant: str = "transformer_engine", ops: Any = NumpyOps
) -> tuple[Any, Any]:
    """NVFP4's decode scales of ``x``: each tile's E4M3 ``s_block`` and the tensor's float32
    ``s_global``, as :func:`nvfp4_quantize_dequantize`'s ``variant`` computes them; a tile's
    elements dequantize as ``q * s_block * s_global``.

    Args:
        x, tile, variant, ops: as :func:`nvfp4_quantize_dequantize`.

    Returns:
        ``(s_block, s_global)``: float32 ``(rows // tile[0], x.shape[-1] // tile[1])`` (rows
        being the product of every axis but the last) and a float32 scalar.

    Raises:
        ValueError: a shape that does not split into tiles, or an unknown variant.
    """
    if variant not in NVFP4_VARIANTS:
        raise ValueError(f"unknown NVFP4 variant {variant!r}; choose one of {', '.join(NVFP4_VARIANTS)}.")
    tiles, _ = _tiled(ops, x, tile, "NVFP4")
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        _, d, g = _NVFP4_SCALES[variant](ops, tiles)
    return ops.reshape(d, (int(tiles.shape[0]), int(tiles.shape[2]))), ops.reshape(g, ())


def nvfp4_quantize_dequantize(
    x: Any,
    tile: tuple[int, int] = NVFP4_TILES["activation"],
    rounding: str = "nearest_even",
    bits: Any = None,
    variant: str = "transformer_engine",
    ops: Any = NumpyOps,
) -> Any:
    """The NVFP4 values of ``x``, as float32: ``q * s_block * s_global`` with ``q`` in E2M1.

    Matches Transformer Engine's ``NVFP4BlockScaling`` as its PyTorch reference quantizer
    writes it (``pytorch/custom_recipes/reference_nvfp4.py``,
    ``_quantize_blockwise_reference``, the kernels' default path): the global amax is
    ``max(|x|)`` over the tensor (NaN propagating), ``S_enc`` is :func:`nvfp4_global_scale`
    and ``s_global = 1 / S_enc``; each tile's decode scale ``s_block`` is
    :func:`nvfp4_block_scale` of its amax (a 16x16 weight tile shares one); the elements are
    ``x * min(1 / (s_block * s_global), FLT_MAX)`` clipped to [-6, 6] and rounded to E2M1
    (nearest even, where an exact zero becomes +0 as the reference's ``cast_to_fp4x2`` makes
    it; or :func:`round_e2m1_stochastic`). The dequantized value is ``(q * s_block) *
    s_global``: the first product is exact, so it is the exact ``q * s_block * s_global``
    rounded once. A NaN anywhere makes the whole tensor NaN: the global amax is NaN, so is
    every scale (the reference's ``torch.max`` and ``torch.min`` propagate it). The random
    Hadamard transform Transformer Engine applies to the weight-gradient GEMM's operands
    before this quantization is :func:`random_hadamard_transform` (the linear rule runs it,
    :mod:`unimp.blockscale_linear`). Not included: the ``pow_2_scales`` and "4 over 6" options.

    ``variant="torchao"`` transcribes torchao's ``nvfp4_quantize`` with its dynamic per-tensor
    scale (``torchao/prototype/mx_formats/nvfp4_tensor.py``, read at its source, not run):
    ``p = amax / (448 * 6)``; a block's scale is ``e4m3(clip((block_amax / 6) / p, 2**-6,
    448))``, clamped below at 2**-6 where Transformer Engine keeps E4M3's subnormals and 0, so
    a block far below the tensor's amax quantizes differently; the elements are
    ``x * ((1 / p) / s_block)`` and dequantize as ``q * (p * s_block)``. An all-zero tensor
    makes ``p = 0`` and every scale ``0 / 0``: NaN, as in torchao.

    ``variant="jax"`` transcribes JAX's ``quantize`` for ``jax.nn.scaled_dot_general``'s
    ``nvfp4`` config (``jax/_src/cudnn/scaled_matmul_stablehlo.py``), which divides where
    Transformer Engine multiplies: ``z = x / g``, a block's scale ``e4m3(clip(max|z| / 6, 0,
    448))``, elements ``z / s_block``, dequantized ``(q * s_block) * g``. JAX takes the global
    scale ``g`` from the user; unimp passes ``g = amax / (448 * 6)``, so a tensor of zeros is
    NaN here too, while a block of zeros is ``0 / 0`` cast to E2M1, which XLA (as ml_dtypes)
    makes -0. (It has no stochastic rounding or Hadamard transform.)

    Args:
        x: float32 array; its last dimension a multiple of ``tile[1]`` and the product of the
            others a multiple of ``tile[0]``.
        tile: ``(rows, columns)``, a value of :data:`NVFP4_TILES`.
        rounding: one of :data:`NVFP4_ROUNDINGS`; Transformer Engine rounds gradients
            stochastically, everything else to nearest.
        bits: ``"stochastic"``: int32 random bits, ``x``'s shape (:func:`unimp.rounding.random_bits`).
        variant: one of :data:`NVFP4_VARIANTS`.
        ops: the array namespace (default NumPy, the reference); besides the block FP8 rule's
            names it needs ``floor``.

    Returns:
        float32 array, ``x``'s shape.

    Raises:
        ValueError: a shape that does not split into tiles, an unknown rounding or variant, or
            stochastic rounding without ``bits`` (or with bits of another shape).

    Example:
        Global amax 2688 = 448 * 6 makes ``S_enc = 1``; the second block's amax 5 gives the
        decode scale e4m3(5/6) = 0.8125, so 5 -> 6.15 -> 6 -> 4.875 and 2 -> 2.46 -> 2 -> 1.625.

        >>> import numpy as np
        >>> x = np.zeros((1, 32), np.float32)
        >>> x[0, 0], x[0, 16], x[0, 17] = 2688.0, 5.0, 2.0
        >>> nvfp4_quantize_dequantize(x)[0, [0, 16, 17]].tolist()
        [2688.0, 4.875, 1.625]
    """
    q, d, g, shape = _nvfp4_elements(x, tile, rounding, bits, variant, ops)
    with np.errstate(over="ignore", invalid="ignore"):
        out = q * (g * d) if variant == "torchao" else (q * d) * g
    return ops.reshape(out, shape)


def _nvfp4_elements(x: Any, tile: tuple[int, int], rounding: str, bits: Any, variant: str,
                    ops: Any) -> tuple[Any, Any, Any, tuple[int, ...]]:
    """:func:`nvfp4_quantize_dequantize`'s checks and quantization: ``(q, s_block, s_global,
    x's shape)``, ``q`` the E2M1 elements as float32 tiles ``(R, tr, C, tc)``."""
    if rounding not in NVFP4_ROUNDINGS:
        raise ValueError(f"unknown NVFP4 rounding {rounding!r}; choose one of {', '.join(NVFP4_ROUNDINGS)}.")
    if rounding == "stochastic" and (bits is None or tuple(bits.shape) != tuple(x.shape)):
        raise ValueError(
            "NVFP4 stochastic rounding needs int32 random bits of x's shape "
            f"{tuple(x.shape)}: pass bits=unimp.rounding.random_bits(ops, seed, step, index, x.shape)."
        )
    if variant not in NVFP4_VARIANTS:
        raise ValueError(f"unknown NVFP4 variant {variant!r}; choose one of {', '.join(NVFP4_VARIANTS)}.")
    tiles, shape = _tiled(ops, x, tile, "NVFP4")
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        y, d, g = _NVFP4_SCALES[variant](ops, tiles)
        if rounding == "stochastic":
            q = round_e2m1_stochastic(y, ops.reshape(bits, tuple(tiles.shape)), ops)
        else:
            q = round_e2m1(y, ops)
            if variant == "transformer_engine":  # cast_to_fp4x2 tests x >= 0.0: -0 is code 0
                q = ops.where(y == ops.f32(0.0), ops.f32(0.0), q)
        if variant == "jax":  # its float32 -> float4_e2m1fn cast makes NaN (a zero block's 0 / 0) -0
            q = ops.where(ops.isnan(y), -ops.f32(0.0), q)
    return q, d, g, shape


def nvfp4_block_values(
    x: Any,
    tile: tuple[int, int] = NVFP4_TILES["activation"],
    rounding: str = "nearest_even",
    bits: Any = None,
    ops: Any = NumpyOps,
) -> Any:
    """The values an NVFP4 GEMM multiplies, ``q * s_block`` (float32, exact: two bits of
    element times four of E4M3 scale), before the tensor scales, which Transformer Engine
    applies to the GEMM's result instead (:func:`nvfp4_gemm_alpha`). The elements and block
    scales are :func:`nvfp4_quantize_dequantize`'s with ``variant="transformer_engine"``.

    Args:
        x, tile, rounding, bits, ops: as :func:`nvfp4_quantize_dequantize`.

    Returns:
        float32 array, ``x``'s shape.

    Raises:
        ValueError: as :func:`nvfp4_quantize_dequantize`.
    """
    q, d, _, shape = _nvfp4_elements(x, tile, rounding, bits, "transformer_engine", ops)
    with np.errstate(invalid="ignore"):
        return ops.reshape(q * d, shape)


def nvfp4_gemm_alpha(amax_a: Any, amax_b: Any, ops: Any = NumpyOps) -> Any:
    """The factor Transformer Engine's NVFP4 GEMM multiplies its result by, from the two
    operands' tensor maxima: ``((1 * amax_a) * amax_b) * rn(1 / (6 * 6 * 448 * 448))`` in
    float32, as ``compute_nvfp4_per_tensor_scale_kernel`` (``common/recipe/nvfp4.cu``, called
    by ``cublaslt_gemm.cu``: "we only need to apply NVFP4 tensor scales in matmul output").
    Not the product of the two decode scales ``1 / S_enc``: the two can differ in the last
    bits. NaN propagates; an amax of 0 gives 0.

    Args:
        amax_a, amax_b: float32 scalars, ``max(|a|)`` and ``max(|b|)``.
        ops: the array namespace (default NumPy, the reference).

    Returns:
        float32 scalar.
    """
    inv = ops.f32(float(np.float32(1.0) / np.float32(_E2M1_MAX * _E2M1_MAX * _E4M3_MAX * _E4M3_MAX)))
    with np.errstate(over="ignore", invalid="ignore"):
        return ((ops.f32(1.0) * ops.f32(amax_a)) * ops.f32(amax_b)) * inv


# --- The random Hadamard transform (NVFP4's weight-gradient operands) -------------------------

#: The 16-point random Hadamard transform's fixed sign vector: Transformer Engine's
#: ``get_wgrad_sign_vector`` (``pytorch/tensor/nvfp4_tensor.py`` and
#: ``pytorch/custom_recipes/reference_nvfp4.py``; ``jax/quantize/hadamard.py`` has the same).
#: One vector, hard-coded, no seed.
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)

#: The transform's length: 16 consecutive elements along the last axis, NVFP4's block.
RHT_SIZE = 16

_BF16_DROP = 2**16  # float32 bits below bfloat16's: bits // _BF16_DROP is a bfloat16's bits
_F32_INF_BITS = 0x7F800000


def hadamard_matrix(signs: Any = RHT_SIGNS) -> np.ndarray:
    """The matrix the random Hadamard transform multiplies each row chunk by:
    ``T = diag(signs) @ H / 4``, with ``H`` the 16x16 Sylvester Hadamard matrix
    (``H[i, j] = (-1)**popcount(i & j)``, entries +-1, ``H @ H.T = 16 I``) and ``1 / 4 =
    1 / sqrt(16)``, so ``T`` is orthogonal (``T @ T.T = I``): a chunk ``v`` (a row of 16)
    becomes ``v @ T``.

    Matches Transformer Engine's ``get_rht_matrix`` (``pytorch/tensor/nvfp4_tensor.py``: the
    sign matrix times ``get_hadamard_matrix``, scaled by ``1 / sqrt(16)``, stored in bfloat16,
    where every entry, +-0.25, is exact) and its reference's ``_build_hadamard_matrix`` times
    ``1 / sqrt(16)`` (``pytorch/custom_recipes/reference_nvfp4.py``).

    Args:
        signs: 16 values, each 1 or -1 (default :data:`RHT_SIGNS`).

    Returns:
        float32 NumPy array ``(16, 16)`` with entries +-0.25.

    Raises:
        ValueError: ``signs`` not 16 values of +-1.

    Example:
        >>> t = hadamard_matrix()
        >>> bool((t @ t.T == np.eye(16)).all()), t[3, :4].tolist()
        (True, [-0.25, 0.25, 0.25, -0.25])
    """
    s = _rht_signs(signs)
    h = np.ones((1, 1))
    while h.shape[0] < RHT_SIZE:  # Sylvester: [[H, H], [H, -H]]
        h = np.block([[h, h], [h, -h]])
    return (s[:, None] * h * 0.25).astype(np.float32)


def _rht_signs(signs: Any) -> np.ndarray:
    s = np.asarray(signs, np.float64).reshape(-1)
    if s.shape != (RHT_SIZE,) or not np.all(np.abs(s) == 1.0):
        raise ValueError(f"the random Hadamard transform's signs are {RHT_SIZE} values of 1 or -1, got "
                         f"{signs!r}; pass unimp.blockscale.RHT_SIGNS (Transformer Engine's) or your own 16.")
    return s


def round_bf16(x: Any, ops: Any = NumpyOps) -> Any:
    """``x`` (float32) rounded to the nearest bfloat16, ties to even, as float32, from its bits
    (``cvt.rn.bf16.f32``): the low 16 bits are dropped, rounding up where they exceed half,
    or are exactly half and the kept last bit is odd; a finite value past bfloat16's largest
    by half an ulp or more becomes inf. inf, NaN and the sign (-0.0 too) are kept.

    Not a dtype cast: XLA may delete a ``float32 -> bfloat16 -> float32`` pair (its
    excess-precision simplification), which integer arithmetic on the bits never is.

    Args:
        x: float32 array.
        ops: the array namespace (default NumPy, the reference).

    Returns:
        float32 array of bfloat16 values, ``x``'s shape.
    """
    x = ops.f32(x)
    b = ops.bits(ops.abs(x))  # >= 0: the magnitude's bits
    b = ops.where(b > _F32_INF_BITS, _F32_INF_BITS, b)  # NaN (restored below): no int32 overflow
    # half an ulp less one, plus the kept last bit: a tie rounds up exactly when that bit is odd
    mag = (b + (_BF16_DROP // 2 - 1 + (b // _BF16_DROP) % 2)) // _BF16_DROP * _BF16_DROP
    sign = ops.bits(x) - ops.bits(ops.abs(x))  # -2**31 where the sign bit is set (-0.0 too), else 0
    return ops.where(ops.isnan(x), x, ops.from_bits(mag + sign))


def random_hadamard_transform(x: Any, signs: Any = RHT_SIGNS, axis: int = -1, ops: Any = NumpyOps) -> Any:
    """The random Hadamard transform (RHT) Transformer Engine's ``NVFP4BlockScaling`` applies
    before quantizing the weight-gradient GEMM's operands: every chunk ``v`` of 16 consecutive
    elements along ``axis`` (the last by default) becomes ``bf16(v @ T)``, ``T`` being
    :func:`hadamard_matrix` of ``signs`` (orthogonal, so a GEMM of two operands transformed
    along its reduction axis has the same exact value).

    Transcribed from Transformer Engine: ``NVFP4BlockScaling``
    (``transformer_engine/common/recipe/__init__.py``) sets ``random_hadamard_transform`` for
    the inputs (``fp4_quant_fwd_inp``) and the gradients (``fp4_quant_bwd_grad``), not the
    weights, and applies it to their columnwise copies only (the weight-gradient GEMM's);
    ``disable_rht`` (``NVTE_NVFP4_DISABLE_RHT=1``) turns it off. Its reference quantizer
    (``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``,
    ``NVFP4QuantizerRef._apply_rht``) multiplies each row chunk of the transposed tensor by
    ``T`` in the tensor's dtype, and takes the columnwise copy's global amax after the
    transform (``global_amax_col``, the kernels' ``with_post_rht_amax``). Its kernels
    (``common/hadamard_transform/hadamard_transform_utils.cuh`` and the
    ``*_hadamard_transform_cast_fusion.cu`` files) take a bfloat16 input and a bfloat16 ``T``,
    accumulate in float32 and round the result to bfloat16 ("for bit-wise compatibility with
    unfused") before the amax and the quantization: so does this function.

    unimp's sums, in a fixed order that every framework follows: ``v`` times ``signs / 4``
    (exact), then the fast Walsh-Hadamard butterflies ``(a, b) -> (a + b, a - b)`` over index
    bits 0, 1, 2 and 3, each a float32 addition, then :func:`round_bf16`. Where the sums are
    exact (a bfloat16 input, as the block-scaled recipes' compute dtype gives, whose chunk
    spans a few binades) this is Transformer Engine's value bit for bit; elsewhere its tensor
    cores' summation order decides the last bits of the float32 sum, which may move a
    bfloat16 rounding. Infinite inputs give inf or NaN in their chunk; results below 2**-126
    are flushed on XLA and TensorFlow and not promised alike.

    Args:
        x: float32 array whose ``axis`` dimension is a multiple of 16.
        signs: the 16 signs (default :data:`RHT_SIGNS`, Transformer Engine's).
        axis: the axis along which the chunks lie (Transformer Engine: the last axis of the
            transposed tensor; ``axis=0`` of the tensor itself gives the same values, with
            the sums' operands contiguous, which eager frameworks add faster).
        ops: the array namespace (default NumPy, the reference); besides ``reshape``,
            ``concat``, ``bits``, ``from_bits``, ``where``, ``abs`` and ``isnan`` it needs
            ``f32`` to take a NumPy array (the signs) and the arrays to take
            ``a[:, :, 0:1, :]`` slices.

    Returns:
        float32 array of bfloat16 values, ``x``'s shape.

    Raises:
        ValueError: an ``axis`` dimension that is not a multiple of 16, no such axis, or bad
            ``signs``.

    Example:
        A one-hot chunk becomes a row of ``T``; a chunk of ones becomes the column sums of
        ``T``, the first being the signs' sum over 4: (6 - 10) / 4 = -1.

        >>> x = np.zeros((2, 16), np.float32)
        >>> x[0, 3], x[1, :] = 1.0, 1.0
        >>> y = random_hadamard_transform(x)
        >>> y[0, :4].tolist(), y[1, 0]
        ([-0.25, 0.25, 0.25, -0.25], np.float32(-1.0))
    """
    s = _rht_signs(signs)
    shape = tuple(x.shape)
    if not -len(shape) <= axis < len(shape):
        raise ValueError(f"random_hadamard_transform: axis {axis} is not an axis of shape {shape}.")
    axis %= len(shape)
    if shape[axis] % RHT_SIZE:
        raise ValueError(
            f"random_hadamard_transform: dimension {axis} ({shape[axis]}) must be a multiple of "
            f"{RHT_SIZE}, the transform's length; pad the tensor or turn the transform off (the "
            "'nvfp4_no_rht' rule)."
        )
    inner = math.prod(shape[axis + 1:])  # (chunks, 16, inner): the 16 along the middle axis
    y = ops.reshape(ops.f32(x), (-1, RHT_SIZE, inner)) * ops.f32((s * 0.25).astype(np.float32)[:, None])
    with np.errstate(invalid="ignore", over="ignore"):
        h = 1
        while h < RHT_SIZE:  # the butterflies over index bit log2(h): (chunk, pairs, bit, below it)
            y = ops.reshape(y, (-1, RHT_SIZE // (2 * h), 2, h * inner))
            a, b = y[:, :, 0:1, :], y[:, :, 1:2, :]
            y = ops.concat([a + b, a - b], 2)
            h *= 2
    return ops.reshape(round_bf16(y, ops), shape)
