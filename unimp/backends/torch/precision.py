"""torch matmul precision: :data:`unimp.precision.MATMUL_PRECISION_TABLE` translated to
``torch.set_float32_matmul_precision`` (float32 matmuls) and ``torch.backends.cudnn.allow_tf32``
(float32 convolutions), set for a block and restored after it.

Both switches are process-global in torch and read when an op runs, so the setting is in force
for exactly the ops run inside the block (eager and ``torch.compile``d alike); another thread
running ops at the same time sees it too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from unimp.precision import MATMUL_PRECISION_TABLE, check_matmul_precision

__all__ = ["current_matmul_precision", "matmul_precision"]


def current_matmul_precision() -> dict[str, Any]:
    """torch's current settings: ``{"matmul": "highest"|"high"|"medium", "conv_tf32": bool}``.

    torch's defaults are ``"highest"`` (TF32 off) for matmuls and TF32 on for cuDNN
    convolutions (torch's CUDA semantics notes, "TensorFloat-32 (TF32) on Ampere (and later)
    devices"); neither changes anything on a CPU.
    """
    return {
        "matmul": torch.get_float32_matmul_precision(),
        "conv_tf32": bool(torch.backends.cudnn.allow_tf32),
    }


@contextlib.contextmanager
def matmul_precision(name: str | None) -> Iterator[None]:
    """Sets torch's float32 matmul and convolution precision for the block.

    Args:
        name: ``"highest"``, ``"high"``, ``"medium"`` or ``None`` (change nothing).

    Raises:
        ValueError: an unknown name (before anything is changed).

    Example:
        >>> with matmul_precision("high"):
        ...     torch.get_float32_matmul_precision()
        'high'
    """
    name = check_matmul_precision(name)
    if name is None:
        yield
        return
    row = MATMUL_PRECISION_TABLE[name]
    old_matmul, old_conv = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision(row.torch_matmul)
    torch.backends.cudnn.allow_tf32 = row.torch_cudnn_tf32
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old_matmul)
        torch.backends.cudnn.allow_tf32 = old_conv
