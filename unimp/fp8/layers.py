"""What the float8 layers of every backend share, beside the rule: their argument checks
(config, sizes, flags, floating inputs), the opt-in native GEMM switch and its shape rule, and
the emulation and fallback warnings, which point at the user's line."""

from __future__ import annotations

from typing import Any

import numpy as np

from unimp.fp8.config import CurrentScaling, DelayedScaling, FP8Config


class FP8EmulationWarning(UserWarning):
    """float8 matmuls run emulated (quantize-dequantize in float32), given once per framework and
    device type, never per step."""


_EMULATION_WARNED: set[tuple[str, str]] = set()

#: Packages whose frames stand between the user's call and a float8 warning: the warning is
#: attributed to the first frame outside them (the user's line calling the layer or model).
_LIBRARY_PACKAGES = ("unimp", "torch", "keras", "tf_keras", "tensorflow", "jax", "jaxlib", "flax", "optax")


def user_stacklevel() -> int:
    """The ``stacklevel`` that points the warning issued by this function's caller at the
    first frame outside unimp and the frameworks (their module, ``nn.Module.__call__``,
    Keras's ``Layer.__call__``, ``tf.function`` and ``jax.jit`` tracing, AutoGraph's converted
    copies of traced functions), i.e. the user's code;
    Python 3.12's ``warnings.warn(skip_file_prefixes=...)`` by a frame walk, for Python 3.10+.
    Only loaded packages are skipped (nothing is imported); with no such frame, 2 (the
    caller's caller)."""
    import os
    import sys

    prefixes = []
    for name in _LIBRARY_PACKAGES:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            prefixes.append(os.path.dirname(path) + os.sep)
    frame, level = sys._getframe(2), 2  # the warning caller's caller
    while frame is not None and (
        frame.f_code.co_filename.startswith(tuple(prefixes))
        # AutoGraph's converted copy of a function traced by tf.function (a temp file)
        or os.path.basename(frame.f_code.co_filename).startswith("__autograph_generated_file")
    ):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def warn_emulated(framework: str, device_type: str, *, stacklevel: int | None = None) -> None:
    """Warns once per ``(framework, device_type)`` that float8 matmuls are emulated: the default
    in every framework, and what the opt-in native paths (:data:`NATIVE_ENV`) still are on a
    device without float8 units (a CPU, a GPU before sm89), where they pay nothing back.
    Attributed to the user's line (:func:`user_stacklevel`) unless ``stacklevel`` is given."""
    key = (framework, device_type)
    if key in _EMULATION_WARNED:
        return
    _EMULATION_WARNED.add(key)
    import warnings

    warnings.warn(
        f"unimp FP8 ({framework}, {device_type}): float8 matmuls are emulated (quantize-dequantize "
        "in float32, the same numbers as a float8 GEMM), so this is slower than bfloat16, never "
        "faster; the opt-in native float8 GEMMs (native=True or UNIMP_FP8_NATIVE=1: torch "
        "_scaled_mm, JAX and TensorFlow through XLA's cuBLASLt rewrite) pay only on a device with "
        "float8 units.",
        FP8EmulationWarning,
        stacklevel=user_stacklevel() if stacklevel is None else stacklevel,
    )


#: The environment variable that turns the native float8 GEMM on where a layer or ``dot_general``
#: is built with ``native=None`` (the default; e.g. the layers ``mp.prepare`` swaps in): ``"1"``
#: on, anything else off. One switch for torch, Keras and JAX.
NATIVE_ENV = "UNIMP_FP8_NATIVE"

#: The native float8 GEMM's shape rule: a layer's ``in_features`` and ``out_features`` multiples
#: of 16. torch 2.13 ``_meta_registrations.py`` ``_check_scaled_mm_sizes`` refuses other sizes;
#: XLA's GPU ``gemm_rewriter.cc`` pads the operands of a cuBLASLt float8 GEMM to multiples of 16
#: instead ("as required by cuBLASLt FP8 gemms"), a copy per call. unimp applies the one rule in
#: every framework, on every device, so a CPU run and the three frameworks pick the same layers.
NATIVE_MULTIPLE = 16


class FP8NativeFallbackWarning(UserWarning):
    """A layer asked for the native float8 GEMM runs emulated: the kernel refuses its
    dimensions (or raised); given once per layer, never per step."""


def native_requested(native: Any, where: str) -> bool:
    """``native`` as given, or (``None``) whether :data:`NATIVE_ENV` is ``"1"`` now.

    Raises:
        TypeError: ``native`` is not True, False or None (the message names ``where``).
    """
    if native is None:
        import os

        return os.environ.get(NATIVE_ENV, "") == "1"
    if not isinstance(native, bool):
        raise TypeError(f"{where}: native must be True, False or None, got {native!r}.")
    return native


def layer_config(config: Any, where: str) -> FP8Config:
    """A float8 layer's scaling config: ``None`` gives :class:`DelayedScaling` ``()``.

    Raises:
        TypeError: anything but a :class:`DelayedScaling` / :class:`CurrentScaling` (a preset
            name is not read: the message names :func:`fp8_preset`), naming ``where``.
    """
    if config is None:
        return DelayedScaling()
    if not isinstance(config, (DelayedScaling, CurrentScaling)):
        hint = f" unimp.fp8.fp8_preset({config!r})," if isinstance(config, str) else ""
        raise TypeError(
            f"{where}: config must be a unimp.fp8.DelayedScaling or CurrentScaling (e.g.{hint} "
            f"unimp.fp8.fp8_preset('transformer_engine')), got {type(config).__name__} {config!r}."
        )
    return config


def layer_size(value: Any, field: str, where: str) -> int:
    """A float8 layer's size argument (``units``, ``in_features``, ...): a positive int.

    Raises:
        TypeError: not an int (a bool, ``2.7``, ``"4"``: never coerced), naming ``where.field``.
        ValueError: 0 or negative.
    """
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {field} must be an int, got {type(value).__name__} {value!r}.")
    if value < 1:
        raise ValueError(f"{where}: {field} must be a positive int, got {value!r}.")
    return int(value)


def layer_flag(value: Any, field: str, where: str) -> bool:
    """A float8 layer's switch (``bias``, ``use_bias``): True or False, never a truthy value.

    Raises:
        TypeError: anything else (``"no"`` is not False), naming ``where.field``.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: {field} must be True or False, got {type(value).__name__} {value!r}.")
    return bool(value)


def refuse_non_float(dtype: Any, where: str, fix: str) -> None:
    """The float8 matmul's rule for an operand that is not floating point (integers, bools) in
    the frameworks whose own matmul refuses it (torch ``nn.Linear``) or would compute an exact
    integer product (JAX ``lax.dot_general``), which float8 cannot: a TypeError. Keras's Dense
    instead casts the input to its compute dtype, and so does unimp's.

    Raises:
        TypeError: always, naming ``where``, the dtype and ``fix``.
    """
    raise TypeError(f"{where}: the float8 matmul takes floating-point operands, got {dtype}; {fix}.")


def native_refusal(in_features: int, out_features: int, kernel: str) -> str | None:
    """Why a layer of these dimensions runs emulated though native was asked
    (:data:`NATIVE_MULTIPLE`), or None when the native GEMM takes it; ``kernel`` names the GEMM
    in the message."""
    dims = {"in_features": int(in_features), "out_features": int(out_features)}
    bad = [f"{k}={v}" for k, v in dims.items() if v % NATIVE_MULTIPLE]
    if not bad:
        return None
    return (f"its {' and '.join(bad)} not a multiple of {NATIVE_MULTIPLE}, which the float8 GEMM "
            f"({kernel}) requires")


def warn_native_fallback(framework: str, layer: str, why: str, *, stacklevel: int | None = None) -> None:
    """The :class:`FP8NativeFallbackWarning` of one layer (the caller warns once per layer),
    attributed to the user's line (:func:`user_stacklevel`) unless ``stacklevel`` is given."""
    import warnings

    warnings.warn(f"unimp FP8 ({framework}): layer {layer!r} runs the emulated float8 matmul, "
                  f"not the native one: {why}.", FP8NativeFallbackWarning,
                  stacklevel=user_stacklevel() if stacklevel is None else stacklevel)
