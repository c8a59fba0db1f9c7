"""Canonical floating dtype names, recognised from strings and from any framework's dtype objects.

This module is framework-free: torch, TensorFlow and JAX dtypes are recognised by their type's
module and their printed name, never by importing the framework.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "CANONICAL_DTYPES",
    "DTYPE_ALIASES",
    "HALF_DTYPES",
    "canonical_dtype",
    "device_support",
    "finfo",
    "parse_device",
    "is_half",
    "keras_policy_name",
]

#: The floating dtypes unimp knows, widest first.
CANONICAL_DTYPES: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")

#: The half-precision dtypes: the ones a mixed-precision recipe computes in.
HALF_DTYPES: frozenset[str] = frozenset({"float16", "bfloat16"})

#: Accepted spellings, case-insensitive. "float" and "full" mean float32, as in jmp.
DTYPE_ALIASES: dict[str, str] = {
    "float64": "float64",
    "f64": "float64",
    "fp64": "float64",
    "double": "float64",
    "float32": "float32",
    "f32": "float32",
    "fp32": "float32",
    "float": "float32",
    "full": "float32",
    "single": "float32",
    "float16": "float16",
    "f16": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}

# The name a framework's dtype object prints or carries, e.g. "torch.float16" -> "float16".
_FRAMEWORK_PREFIXES = ("torch.", "tf.", "jnp.", "np.", "numpy.")


def _accepted() -> str:
    return ", ".join(sorted(DTYPE_ALIASES))


def _from_name(name: str) -> str | None:
    key = name.strip().lower()
    for prefix in _FRAMEWORK_PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix) :]
            break
    if key == "half":
        # "half" is platform dependent (float16 on GPU, bfloat16 on TPU); Policy parsing handles it.
        return None
    return DTYPE_ALIASES.get(key)


def canonical_dtype(x: Any) -> str:
    """Returns the canonical name of a floating dtype.

    Args:
        x: a name (``"float16"``, ``"fp16"``, ``"bf16"``, ``"float"``, ...), a NumPy dtype or scalar
            type (ml_dtypes' ``bfloat16`` included), a ``torch.dtype``, a ``tf.DType``, a JAX dtype
            (``jnp.float16``), or an array or tensor, whose ``dtype`` is read. No framework is
            imported to recognise its dtypes.

    Returns:
        One of ``"float64"``, ``"float32"``, ``"float16"``, ``"bfloat16"``.

    Raises:
        ValueError: ``x`` is not a floating dtype unimp supports (the message lists the
            accepted names), or is the Python type ``float``, which NumPy reads as float64
            and torch, JAX and Keras as float32.

    Example:
        >>> canonical_dtype("bf16")
        'bfloat16'
        >>> import numpy as np
        >>> canonical_dtype(np.float16)
        'float16'
    """
    if isinstance(x, str):
        name = _from_name(x)
        if name is not None:
            return name
        if x.strip().lower() == "half":
            raise ValueError(
                "'half' is float16 on GPU and bfloat16 on TPU; name the dtype ('float16' or "
                "'bfloat16'), or use unimp.get_policy('half', platform=...)."
            )
        raise ValueError(f"unknown dtype {x!r}; expected one of: {_accepted()}.")
    if isinstance(x, bool) or x is None or isinstance(x, (int, float)):
        raise ValueError(f"{x!r} is not a dtype; expected a dtype or one of: {_accepted()}.")
    if x is float:
        # NumPy reads the Python type as float64, torch.float / jnp's default float / Keras's
        # "float" are float32: refuse to guess, as the string "float" (float32, jmp) suggests
        raise ValueError(
            "the Python type float is float64 to NumPy but float32 to torch (torch.float), JAX "
            "and Keras; name the dtype: 'float32' or 'float64'."
        )
    module = type(x).__module__ or ""
    # torch.dtype prints as "torch.float16"; tf.DType has .name; both recognised without import.
    if module.startswith("torch"):
        name = _from_name(str(x))
        if name is not None:
            return name
        raise ValueError(
            f"{x} is not a floating dtype unimp supports; expected one of: {_accepted()}."
        )
    if module.startswith("tensorflow") and hasattr(x, "name") and isinstance(x.name, str):
        name = _from_name(x.name)
        if name is not None:
            return name
        raise ValueError(
            f"tf.{x.name} is not a floating dtype unimp supports; expected one of: {_accepted()}."
        )
    # JAX's jnp.float16 and friends are classes carrying a NumPy dtype; arrays and tensors too.
    inner = getattr(x, "dtype", None)
    if inner is not None and inner is not x and not isinstance(x, np.dtype):
        if isinstance(inner, (np.dtype, str)) or type(inner).__module__.split(".")[0] in (
            "torch",
            "tensorflow",
        ):
            return canonical_dtype(inner)
    try:
        dt = np.dtype(x)
    except (TypeError, ValueError):
        raise ValueError(
            f"{x!r} is not a dtype unimp recognises; expected one of: {_accepted()}."
        ) from None
    name = _from_name(dt.name)
    if name is None:
        raise ValueError(
            f"{dt.name} is not a floating dtype unimp supports; expected one of: {_accepted()}."
        )
    return name


def is_half(x: Any) -> bool:
    """True when ``x`` names float16 or bfloat16 (any form :func:`canonical_dtype` accepts)."""
    return canonical_dtype(x) in HALF_DTYPES


class _FInfo:
    __slots__ = ("bits", "eps", "max", "tiny", "min_subnormal")

    def __init__(self, bits: int, eps: float, max_: float, tiny: float, min_subnormal: float):
        self.bits, self.eps, self.max, self.tiny, self.min_subnormal = (
            bits,
            eps,
            max_,
            tiny,
            min_subnormal,
        )

    def __repr__(self) -> str:
        return (
            f"finfo(bits={self.bits}, eps={self.eps!r}, max={self.max!r}, tiny={self.tiny!r}, "
            f"min_subnormal={self.min_subnormal!r})"
        )


_FINFO = {
    "float64": _FInfo(64, 2.0**-52, float(np.finfo(np.float64).max), 2.0**-1022, 2.0**-1074),
    "float32": _FInfo(32, 2.0**-23, float(np.finfo(np.float32).max), 2.0**-126, 2.0**-149),
    "float16": _FInfo(16, 2.0**-10, 65504.0, 2.0**-14, 2.0**-24),
    # bfloat16 has float32's exponent range with 8 bits of significand.
    "bfloat16": _FInfo(16, 2.0**-7, 3.3895313892515355e38, 2.0**-126, 2.0**-133),
}


def finfo(dtype: Any) -> _FInfo:
    """Machine limits of a floating dtype, as Python floats (no framework or ml_dtypes needed).

    Args:
        dtype: anything :func:`canonical_dtype` accepts.

    Returns:
        An object with ``bits``, ``eps``, ``max``, ``tiny`` (smallest normal) and
        ``min_subnormal``.

    Raises:
        ValueError: ``dtype`` is not a supported floating dtype.
    """
    return _FINFO[canonical_dtype(dtype)]


def device_support(kind: str, compute_capability: tuple[int, int] | None = None) -> dict[str, Any]:
    """Which half dtypes a device runs and the recipe unimp recommends there, one rule for
    every backend (each backend only reports the device's kind and compute capability).

    * ``cpu``: float16 and bfloat16 both run (mostly emulated, rarely faster): ``float32``.
    * ``tpu``: bfloat16 is native, float16 is not: ``mixed_bfloat16``.
    * ``gpu``: float16 from compute capability 5.3 (tensor cores from 7.0), bfloat16 from 8.0
      (Ampere): ``mixed_bfloat16`` from 8.0 (no loss scaling needed), ``mixed_float16`` from
      7.0, else ``float32``. An unknown capability (e.g. ROCm) assumes float16 only.

    Args:
        kind: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
        compute_capability: ``(major, minor)`` of an NVIDIA GPU, or ``None``.

    Returns:
        ``{"kind", "float16": bool, "bfloat16": bool, "recommended": recipe name, "float8":
        bool}`` (``float8``: float8 tensor-core units, NVIDIA compute capability 8.9 and later).

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind == "cpu":
        f16, bf16, rec = True, True, "float32"
    elif kind == "tpu":
        f16, bf16, rec = False, True, "mixed_bfloat16"
    elif kind == "gpu":
        if compute_capability is None:
            f16, bf16, rec = True, False, "mixed_float16"
        else:
            cc = tuple(int(v) for v in compute_capability)
            f16, bf16 = cc >= (5, 3), cc >= (8, 0)
            rec = "mixed_bfloat16" if bf16 else "mixed_float16" if cc >= (7, 0) else "float32"
    else:
        raise ValueError(f"device kind must be 'cpu', 'gpu' or 'tpu', got {kind!r}.")
    f8 = kind == "gpu" and compute_capability is not None and tuple(int(v) for v in compute_capability) >= (8, 9)
    return {"kind": kind, "float16": f16, "bfloat16": bf16, "recommended": rec, "float8": f8}


#: ``unimp info``'s word on float8 (issue 21): what unimp runs, and when float8 pays.
FLOAT8_NOTE = (
    "small layers gain nothing even with float8 units (Transformer Engine reports about 1.5x "
    "for its FP8 step on large, GEMM-bound layers)"
)


#: Each framework's opt-in native float8 GEMM (``native=True`` or ``UNIMP_FP8_NATIVE=1``).
FLOAT8_NATIVE_PATHS = {
    "torch": "torch FP8Dense(native=True) is opt-in (torch._scaled_mm)",
    "tensorflow": "Keras FP8Dense(native=True) is opt-in (XLA-compiled float8 GEMMs, cuBLASLt)",
    "jax": "JAX fp8_dot_general(native=True) is opt-in (float8 dot_general operands, XLA's cuBLASLt rewrite)",
}


def float8_line(devices: list[dict[str, Any]], backend: str | None = None) -> str:
    """One line for ``unimp info``: float8 matmuls are emulated by unimp by default on every
    device (quantize-dequantize); each framework has an opt-in native path
    (:data:`FLOAT8_NATIVE_PATHS`), which pays only on a device with float8 units (NVIDIA compute
    capability 8.9 and later: Ada, Hopper, Blackwell) and runs emulated elsewhere; and when
    float8 pays at all."""
    native = [d["device"] for d in devices if d.get("float8")]
    opt_in = FLOAT8_NATIVE_PATHS.get(backend, "the native float8 GEMMs are opt-in (UNIMP_FP8_NATIVE=1)")
    where = (f"{', '.join(native)} has float8 units; {opt_in}" if native
             else f"no float8 units here, where the native path runs emulated too; {opt_in}")
    return f"float8 matmuls: emulated by default ({where}); {FLOAT8_NOTE}"


#: Device spellings every backend takes for ``device=``, by the kind they name.
DEVICE_KINDS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def parse_device(spec: Any) -> tuple[str, int | None]:
    """The one reading of a ``device=`` spelling, for every backend: ``(kind, index)``.

    Accepts ``"cpu"``, ``"gpu"`` / ``"cuda"`` / ``"rocm"``, ``"tpu"``, each with an optional
    ``":N"``, in any case and with surrounding spaces; TensorFlow names (``"/GPU:0"``,
    ``"/job:localhost/replica:0/task:0/device:CPU:0"``); and any object that prints as one of
    these (a ``torch.device``). Whether the device exists is each backend's question.

    Returns:
        ``(kind, index)``: kind ``"cpu"``, ``"gpu"`` or ``"tpu"``; index ``None`` when not given.

    Raises:
        ValueError: not one of those spellings (the message lists them).

    Example:
        >>> parse_device(" CUDA:1 "), parse_device("/device:CPU:0"), parse_device("tpu")
        (('gpu', 1), ('cpu', 0), ('tpu', None))
    """
    text = str(spec).strip()
    low = text.lower()
    if "device:" in low:  # a TensorFlow device name: the part after the last "device:"
        low = low[low.rindex("device:") + len("device:"):]
    kind, colon, index = low.lstrip("/").partition(":")
    if kind not in DEVICE_KINDS or (colon and not (index.isascii() and index.isdigit())):
        raise ValueError(
            f"device={spec!r} is not a device unimp reads; use 'cpu', 'gpu' (or 'cuda'), 'tpu', "
            "with an optional ':N', or the framework's own device object."
        )
    return DEVICE_KINDS[kind], (int(index) if colon else None)


def keras_policy_name(param_dtype: Any, compute_dtype: Any) -> str | None:
    """The Keras ``DTypePolicy`` name (Keras's own names, framework-free) for variables in ``param_dtype`` computing in ``compute_dtype``.

    Returns:
        ``"mixed_float16"`` / ``"mixed_bfloat16"`` (float32 variables, half compute), a dtype
        name when both are equal, or ``None`` when Keras has no such policy.
    """
    p, c = canonical_dtype(param_dtype), canonical_dtype(compute_dtype)
    if p == c:
        return p
    if p == "float32" and c in ("float16", "bfloat16"):
        return f"mixed_{c}"
    return None
