"""TensorFlow matmul precision: :data:`unimp.precision.MATMUL_PRECISION_TABLE` translated to
``tf.config.experimental.enable_tensor_float_32_execution``, set for a block and restored after it.

What is and is not per step: TensorFlow's TF32 switch is one process-global flag (matmuls and
convolutions together; there is no bfloat16-pass mode, so ``"medium"`` means TF32 as ``"high"``).
unimp sets it around each call of its train step and inside ``mp.autocast()``, and puts the
previous value back afterwards, also when the call raises. Graph kernels read it when they run,
so a ``tf.function`` step follows the value of the call; an XLA-compiled step
(``jit_compile=True``) may keep the value it was compiled under. Another thread running
TensorFlow ops during the step sees the step's value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from unimp.precision import MATMUL_PRECISION_TABLE, check_matmul_precision

__all__ = ["current_matmul_precision", "matmul_precision"]


def current_matmul_precision() -> dict[str, Any]:
    """TensorFlow's current setting: ``{"api": "enable_tensor_float_32_execution", "tf32":
    bool}`` (matmuls and convolutions).

    "TensorFloat-32 is enabled by default" (docs of
    ``tf.config.experimental.enable_tensor_float_32_execution``); it changes nothing on a CPU
    or a GPU older than Ampere.
    """
    enabled = tf.config.experimental.tensor_float_32_execution_enabled()
    return {"api": "enable_tensor_float_32_execution", "tf32": bool(enabled)}  # still TF's only switch (2.21)


@contextlib.contextmanager
def matmul_precision(name: str | None) -> Iterator[None]:
    """Sets TensorFlow's TF32 switch for the block (``"highest"``: off; ``"high"``/``"medium"``: on).

    Args:
        name: ``"highest"``, ``"high"``, ``"medium"`` or ``None`` (change nothing).

    Raises:
        ValueError: an unknown name (before anything is changed).
    """
    name = check_matmul_precision(name)
    if name is None:
        yield
        return
    old = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(MATMUL_PRECISION_TABLE[name].tensorflow_tf32)
    try:
        yield
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(old)
