"""Matmul precision: one table from unimp's names to each framework's switch. Framework-free.

A :class:`~unimp.Policy` may ask for the internal precision of float32 matrix multiplications
and convolutions (``matmul_precision``). The names are torch's
(``torch.set_float32_matmul_precision``): ``"highest"`` (true float32, 24 significand bits),
``"high"`` (TensorFloat32, 10 explicit bits, or three bfloat16 passes) and ``"medium"`` (one
bfloat16 pass, 7 explicit bits). Each backend's ``precision`` module translates the row of
:data:`MATMUL_PRECISION_TABLE` for its framework and sets it for unimp's train step and
``mp.autocast()`` only, restoring the previous global value afterwards.

The frameworks' defaults differ, which is why a float32 run on an Ampere or later NVIDIA GPU
does not agree across frameworks unless the recipe pins the precision (the ``"float32"``
recipe asks for ``"highest"``):

* torch: float32 matmuls ``"highest"`` (TF32 off), cuDNN convolutions TF32 on
  (``torch.backends.cudnn.allow_tf32 = True``); docs of torch.set_float32_matmul_precision and
  "TensorFloat-32 (TF32) on Ampere (and later) devices" in torch's CUDA semantics notes.
* TensorFlow: TF32 on for matmuls and convolutions ("TensorFloat-32 is enabled by default",
  docs of tf.config.experimental.enable_tensor_float_32_execution). TensorFlow has no
  bfloat16-pass mode: ``"medium"`` means TF32 there, as ``"high"``.
* JAX: ``jax_default_matmul_precision`` unset means the platform's fastest ("float32 dot
  products may be computed with reduced-precision arithmetic internally (bfloat16 on TPU, TF32
  on recent GPUs)", JAX's "Matmul precision" page); unimp maps its names to the config's
  ``"float32"``, ``"tensorfloat32"`` and ``"bfloat16"``.

On a CPU every setting computes in full float32.
"""

from __future__ import annotations

import difflib
from typing import NamedTuple

__all__ = ["MATMUL_PRECISIONS", "MATMUL_PRECISION_TABLE", "FrameworkPrecision", "check_matmul_precision"]

#: The names a Policy's ``matmul_precision`` takes (``None``: leave each framework's setting).
MATMUL_PRECISIONS = ("highest", "high", "medium")


class FrameworkPrecision(NamedTuple):
    """One row of :data:`MATMUL_PRECISION_TABLE`: what each framework is set to.

    Attributes:
        torch_matmul: the argument of ``torch.set_float32_matmul_precision``.
        torch_cudnn_tf32: the value of ``torch.backends.cudnn.allow_tf32`` (convolutions).
        tensorflow_tf32: the argument of ``tf.config.experimental.enable_tensor_float_32_execution``.
        jax: the value of ``jax.default_matmul_precision`` (``jax_default_matmul_precision``).
    """

    torch_matmul: str
    torch_cudnn_tf32: bool
    tensorflow_tf32: bool
    jax: str


#: unimp's name -> each framework's setting. The one mapping; backends translate it.
MATMUL_PRECISION_TABLE: dict[str, FrameworkPrecision] = {
    "highest": FrameworkPrecision("highest", False, False, "float32"),
    "high": FrameworkPrecision("high", True, True, "tensorfloat32"),
    "medium": FrameworkPrecision("medium", True, True, "bfloat16"),
}


def check_matmul_precision(value: object, field: str = "matmul_precision") -> str | None:
    """Validates a matmul precision name.

    Args:
        value: ``None`` or one of :data:`MATMUL_PRECISIONS` (any case, surrounding spaces).
        field: the name the error message gives the value.

    Returns:
        ``None`` or the canonical lower-case name.

    Raises:
        ValueError: an unknown name; the message lists the valid names and the closest one.

    Example:
        >>> check_matmul_precision(" High ")
        'high'
    """
    if value is None:
        return None
    key = value.strip().lower() if isinstance(value, str) else None
    if key in MATMUL_PRECISIONS:
        return key
    close = difflib.get_close_matches(str(key if key is not None else value), MATMUL_PRECISIONS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"{field} must be one of {', '.join(repr(n) for n in MATMUL_PRECISIONS)} or None "
        f"(the framework's own setting), got {value!r}.{hint}"
    )


def describe_matmul_precision(backend: str, current: dict, device: str) -> str:
    """One line for ``unimp info``: what a float32 matmul / convolution computes in, on ``device``.

    Args:
        backend: ``"torch"``, ``"tensorflow"`` or ``"jax"``.
        current: the backend's ``current_matmul_precision()``.
        device: the device's name (``"cpu"``, ``"cuda:0"``, ``"/GPU:0"``, ``"TFRT_CPU_0"``, ...).

    Returns:
        e.g. ``"matmul highest (float32), conv TF32"``; on a CPU it adds that every setting
        computes in full float32 there.
    """
    if backend == "torch":
        matmul = current.get("matmul", "highest")
        kind = "float32" if matmul == "highest" else ("TF32/bf16x3" if matmul == "high" else "bf16")
        text = f"matmul {matmul} ({kind}), conv {'TF32' if current.get('conv_tf32') else 'float32'}"
    elif backend == "tensorflow":
        text = f"TF32 {'on' if current.get('tf32') else 'off'} (matmuls and convolutions)"
    else:
        value = current.get("default_matmul_precision")
        text = f"default_matmul_precision {value or 'unset (TF32 on Ampere+ GPUs, bfloat16 on TPU)'}"
    if "cpu" in device.lower():
        text += "; a CPU computes full float32"
    return text
