"""Each framework's matmul-precision setting, read with the framework's own current API (not
through unimp), and the value each unimp name must set, written out.

torch >= 2.9: the ``fp32_precision`` switches (``torch.backends.cuda.matmul`` ...); torch < 2.9
(no such switches): ``torch.get_float32_matmul_precision()`` and ``cudnn.allow_tf32``.
TensorFlow: ``tf.config.experimental.tensor_float_32_execution_enabled()``. JAX: the
``jax_default_matmul_precision`` config.
"""

from __future__ import annotations

from typing import Any

#: torch >= 2.9's switches unimp sets, ``torch.backends.<name>.fp32_precision``.
TORCH_SWITCHES = ("cuda.matmul", "mkldnn.matmul", "cudnn.conv", "cudnn.rnn")

#: unimp's name -> what each framework reads inside the block. The sources:
#: * torch >= 2.9, matmuls: torch's own translation of its legacy names,
#:   ``Context::setFloat32MatmulPrecision`` (aten/src/ATen/Context.cpp): "highest" -> cuda
#:   "ieee", mkldnn "ieee"; "high" -> "tf32", "tf32"; "medium" -> "tf32", "bf16" ("cuda" takes no
#:   "bf16": the same function). cuDNN conv / rnn: ``cudnn.allow_tf32`` True -> "tf32" (torch's
#:   ``setAllowTF32CuDNN``), "highest" -> "ieee" (the comment atop the same file: 'The "ieee"
#:   precision means IEEE standard floating point format, "tf32" and "bf16" means we are allowed
#:   to use "tf32" or "bf16" as internal computation data types for fp32 computations. And
#:   "none" means it is override-able by parent's node').
#: * torch < 2.9: ``torch.set_float32_matmul_precision``'s own names; cuDNN TF32 off for
#:   "highest" only.
#: * TensorFlow: TF32 off for "highest" (docs of
#:   tf.config.experimental.enable_tensor_float_32_execution: "If you want to use the full
#:   float32 precision on all GPUs, you can disable TensorFloat-32 execution with this
#:   function"); it has no bfloat16 mode, so TF32 on for "high" and "medium".
#: * JAX: the config's names for lax.Precision HIGHEST / HIGH / DEFAULT (jax/_src/config.py
#:   ``default_matmul_precision``: "'bfloat16' option is the fastest and least precise;
#:   'float32' is similar to full float32 precision; 'tensorfloat32' is intermediate").
EXPECTED: dict[tuple[str, str], Any] = {
    ("torch", "highest"): {"cuda.matmul": "ieee", "mkldnn.matmul": "ieee", "cudnn.conv": "ieee", "cudnn.rnn": "ieee"},
    ("torch", "high"): {"cuda.matmul": "tf32", "mkldnn.matmul": "tf32", "cudnn.conv": "tf32", "cudnn.rnn": "tf32"},
    ("torch", "medium"): {"cuda.matmul": "tf32", "mkldnn.matmul": "bf16", "cudnn.conv": "tf32", "cudnn.rnn": "tf32"},
    ("torch-legacy", "highest"): {"matmul": "highest", "conv_tf32": False},
    ("torch-legacy", "high"): {"matmul": "high", "conv_tf32": True},
    ("torch-legacy", "medium"): {"matmul": "medium", "conv_tf32": True},
    ("tensorflow", "highest"): {"tf32": False},
    ("tensorflow", "high"): {"tf32": True},
    ("tensorflow", "medium"): {"tf32": True},
    ("jax", "highest"): {"default_matmul_precision": "float32"},
    ("jax", "high"): {"default_matmul_precision": "tensorfloat32"},
    ("jax", "medium"): {"default_matmul_precision": "bfloat16"},
}

#: ``current_matmul_precision()["api"]`` per framework.
API = {
    "torch": "fp32_precision (torch>=2.9)",
    "torch-legacy": "set_float32_matmul_precision + cudnn.allow_tf32 (torch<2.9)",
    "tensorflow": "enable_tensor_float_32_execution",
    "jax": "default_matmul_precision",
}


def torch_switch(name: str) -> Any:
    import torch

    obj: Any = torch.backends
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def torch_has_fp32_precision() -> bool:
    """Whether this torch has the per-backend ``fp32_precision`` switches (torch >= 2.9)."""
    import torch

    return getattr(torch.backends.cuda.matmul, "fp32_precision", None) in ("none", "ieee", "tf32")


def flavour(backend: str) -> str:
    """``backend``, or ``"torch-legacy"`` for a torch without ``fp32_precision``."""
    return "torch-legacy" if backend == "torch" and not torch_has_fp32_precision() else backend


def setting(backend: str) -> dict[str, Any]:
    """What the framework reads now, with its own current API."""
    which = flavour(backend)
    if which == "torch":
        return {name: torch_switch(name).fp32_precision for name in TORCH_SWITCHES}
    if which == "torch-legacy":
        import torch

        return {"matmul": torch.get_float32_matmul_precision(), "conv_tf32": torch.backends.cudnn.allow_tf32}
    if which == "tensorflow":
        import tensorflow as tf

        return {"tf32": tf.config.experimental.tensor_float_32_execution_enabled()}
    import jax

    return {"default_matmul_precision": jax.config.jax_default_matmul_precision}


def expected(backend: str, name: str) -> dict[str, Any]:
    """What ``name`` must set in ``backend`` (as :func:`setting` reads it)."""
    return EXPECTED[flavour(backend), name]
