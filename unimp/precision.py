"""Matmul precision: one table from unimp's names to each framework's switch. Framework-free.

A :class:`~unimp.Policy` may ask for the internal precision of float32 matrix multiplications
and convolutions (``matmul_precision``). The names are torch's
(``torch.set_float32_matmul_precision``): ``"highest"`` (true float32, 24 significand bits),
``"high"`` (TensorFloat32, 10 explicit bits, or three bfloat16 passes) and ``"medium"`` (one
bfloat16 pass, 7 explicit bits, where the hardware has a fast one; otherwise as ``"high"``).
Each backend's ``precision`` module translates the row of :data:`MATMUL_PRECISION_TABLE` for
its framework and sets it for unimp's train step and ``mp.autocast()`` only, restoring the
previous value afterwards. Each backend's ``current_matmul_precision()`` returns a dict whose
``"api"`` names the framework API in use (``unimp info`` prints it) beside that API's values.

The frameworks' defaults differ, which is why a float32 run on an Ampere or later NVIDIA GPU
does not agree across frameworks unless the recipe pins the precision (the ``"float32"``
recipe asks for ``"highest"``):

* torch: float32 matmuls ``"highest"`` (TF32 off), cuDNN convolutions TF32 on; docs of
  torch.set_float32_matmul_precision and "TensorFloat-32 (TF32) on Ampere (and later) devices"
  in torch's CUDA semantics notes. torch >= 2.9 sets them per backend and operation
  (``torch.backends.cuda.matmul.fp32_precision``, ``torch.backends.mkldnn.matmul...``,
  ``torch.backends.cudnn.conv...``, ``...cudnn.rnn...``: ``"ieee"``, ``"tf32"``, ``"bf16"`` on
  oneDNN only, or ``"none"``: inherit the backend's and then the global value) and advises
  against mixing that API with the legacy ``allow_tf32`` / ``set_float32_matmul_precision``;
  unimp uses the new switches there, and the legacy ones only on older torch.
* TensorFlow: TF32 on for matmuls and convolutions ("TensorFloat-32 is enabled by default",
  docs of tf.config.experimental.enable_tensor_float_32_execution). TensorFlow has no
  bfloat16-pass mode: ``"medium"`` means TF32 there, as ``"high"``.
* JAX: ``jax_default_matmul_precision`` unset means the platform's fastest ("float32 dot
  products may be computed with reduced-precision arithmetic internally (bfloat16 on TPU, TF32
  on recent GPUs)", JAX's "Matmul precision" page); unimp maps its names to the config's
  ``"float32"``, ``"tensorfloat32"`` and ``"bfloat16"`` (``lax.Precision`` HIGHEST, HIGH,
  DEFAULT). The config also takes ``jax.lax.DotAlgorithmPreset`` names, but unimp does not
  set one: a preset set as the default applies to every dot, not only float32 ones, and casts
  the operands to its types (under ``"F32_F32_F32"`` a bfloat16 dot runs in float32; under
  ``"BF16_BF16_F32"`` a float16 one rounds its operands to bfloat16), convolutions then lower
  with ``precision DEFAULT`` (a ``"highest"`` request would not reach them), and the TF32
  presets fail on CPU ("not supported by dot_general on CPU"; a TPU has no TF32). JAX 0.10's
  ``_handle_dot_precision`` and ``get_algorithm_compute_types`` in ``jax/_src/lax/lax.py``;
  tests/conformance/test_matmul_precision_conformance.py checks each of these.

On a CPU every setting computes in full float32.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

__all__ = ["MATMUL_PRECISIONS", "MATMUL_PRECISION_TABLE", "FrameworkPrecision", "check_matmul_precision"]

#: The names a Policy's ``matmul_precision`` takes (``None``: leave each framework's setting).
MATMUL_PRECISIONS = ("highest", "high", "medium")


class FrameworkPrecision(NamedTuple):
    """One row of :data:`MATMUL_PRECISION_TABLE`: what each framework is set to.

    Attributes:
        torch_fp32_precision: torch >= 2.9's switches, ``{"cuda.matmul": ..., ...}``: the
            ``fp32_precision`` to give ``torch.backends.<key>``.
        torch_matmul: the argument of ``torch.set_float32_matmul_precision`` (torch < 2.9).
        torch_cudnn_tf32: the value of ``torch.backends.cudnn.allow_tf32`` (torch < 2.9).
        tensorflow_tf32: the argument of ``tf.config.experimental.enable_tensor_float_32_execution``.
        jax: the value of ``jax.default_matmul_precision`` (``jax_default_matmul_precision``).
    """

    torch_fp32_precision: Mapping[str, str]
    torch_matmul: str
    torch_cudnn_tf32: bool
    tensorflow_tf32: bool
    jax: str


def _torch_switches(cuda_matmul: str, mkldnn_matmul: str, cudnn: str) -> Mapping[str, str]:
    switches = {"cuda.matmul": cuda_matmul, "mkldnn.matmul": mkldnn_matmul, "cudnn.conv": cudnn, "cudnn.rnn": cudnn}
    return MappingProxyType(switches)


#: unimp's name -> each framework's setting. The one mapping; backends translate it.
#:
#: torch >= 2.9: the matmul switches are what torch's own ``set_float32_matmul_precision``
#: writes (``Context::setFloat32MatmulPrecision`` in aten/src/ATen/Context.cpp: highest ->
#: cuda ieee, mkldnn ieee; high -> tf32, tf32; medium -> tf32, bf16: cuBLAS has no bfloat16
#: mode, so "medium" is TF32 on CUDA, as torch's docs of the function say), and the cuDNN ones
#: what ``cudnn.allow_tf32`` writes (conv and rnn together), except that "highest" writes
#: ``"ieee"`` where ``allow_tf32 = False`` writes ``"none"``, which would inherit a global
#: ``torch.backends.fp32_precision = "tf32"``. The JAX values are the config's own names for
#: ``lax.Precision`` HIGHEST / HIGH / DEFAULT, not DotAlgorithmPresets (the module docstring
#: says why).
MATMUL_PRECISION_TABLE: dict[str, FrameworkPrecision] = {
    "highest": FrameworkPrecision(
        torch_fp32_precision=_torch_switches("ieee", "ieee", "ieee"),
        torch_matmul="highest",
        torch_cudnn_tf32=False,
        tensorflow_tf32=False,
        jax="float32",
    ),
    "high": FrameworkPrecision(
        torch_fp32_precision=_torch_switches("tf32", "tf32", "tf32"),
        torch_matmul="high",
        torch_cudnn_tf32=True,
        tensorflow_tf32=True,
        jax="tensorfloat32",
    ),
    "medium": FrameworkPrecision(
        torch_fp32_precision=_torch_switches("tf32", "bf16", "tf32"),
        torch_matmul="medium",
        torch_cudnn_tf32=True,
        tensorflow_tf32=True,
        jax="bfloat16",
    ),
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


#: What torch's ``fp32_precision`` values let a float32 op compute in (``"none"``: nothing set
#: anywhere up the chain, i.e. IEEE float32).
_TORCH_KINDS = {"ieee": "float32", "none": "float32", "tf32": "TF32", "bf16": "bf16"}

#: JAX's names of ``lax.Precision`` for ``jax_default_matmul_precision`` (the other values it
#: takes are ``DotAlgorithmPreset`` names).
_JAX_PRECISION_NAMES = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")


def describe_matmul_precision(backend: str, current: dict, device: str) -> str:
    """One line for ``unimp info``: the API in use and what a float32 matmul / convolution
    computes in, on ``device``.

    Args:
        backend: ``"torch"``, ``"tensorflow"`` or ``"jax"``.
        current: the backend's ``current_matmul_precision()``.
        device: the device's name (``"cpu"``, ``"cuda:0"``, ``"/GPU:0"``, ``"TFRT_CPU_0"``, ...).

    Returns:
        e.g. ``"fp32_precision (torch>=2.9): cuda.matmul ieee, mkldnn.matmul ieee, cudnn.conv
        tf32, cudnn.rnn tf32 (matmul float32, conv TF32)"``; on a CPU it adds that every
        setting computes in full float32 there.

    Example:
        >>> describe_matmul_precision("tensorflow", {"api": "enable_tensor_float_32_execution", "tf32": True}, "/GPU:0")
        'enable_tensor_float_32_execution: TF32 on (matmuls and convolutions)'
    """
    api = current.get("api", "")
    if backend == "torch" and "cuda.matmul" in current:
        switches = ", ".join(f"{k} {v}" for k, v in current.items() if k != "api")
        matmul = _TORCH_KINDS.get(current["cuda.matmul"], current["cuda.matmul"])
        if current.get("mkldnn.matmul") == "bf16":
            matmul += " (oneDNN: bf16)"
        conv = _TORCH_KINDS.get(current.get("cudnn.conv", "none"), current.get("cudnn.conv"))
        text = f"{switches} (matmul {matmul}, conv {conv})"
    elif backend == "torch":
        matmul = current.get("matmul", "highest")
        kind = "float32" if matmul == "highest" else ("TF32/bf16x3" if matmul == "high" else "bf16")
        text = f"matmul {matmul} ({kind}), conv {'TF32' if current.get('conv_tf32') else 'float32'}"
    elif backend == "tensorflow":
        text = f"TF32 {'on' if current.get('tf32') else 'off'} (matmuls and convolutions)"
    else:
        value = current.get("default_matmul_precision")
        if value is None:
            text = "unset (TF32 on Ampere+ GPUs, bfloat16 on TPU)"
        elif value in _JAX_PRECISION_NAMES:
            text = value
        else:
            text = f"{value} (a DotAlgorithmPreset: every dot's operands cast to it, convolutions at DEFAULT)"
    if api:
        text = f"{api}: {text}"
    if "cpu" in device.lower():
        text += "; a CPU computes full float32"
    return text
