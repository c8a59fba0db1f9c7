"""torch matmul precision: :data:`unimp.precision.MATMUL_PRECISION_TABLE` translated to
``torch.set_float32_matmul_precision`` (float32 matmuls) and ``torch.backends.cudnn.allow_tf32``
(float32 convolutions), set for a block and restored after it.

Both switches are process-global in torch and read when an op runs, so the setting is in force
for exactly the ops run inside the block (eager and ``torch.compile``d alike); another thread
running ops at the same time sees it too.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

from unimp.precision import MATMUL_PRECISION_TABLE, check_matmul_precision

__all__ = ["current_matmul_precision", "matmul_precision"]


#: torch's per-backend precision switches (``fp32_precision``, torch >= 2.9), saved and restored
#: as they are: the legacy getter ``torch.get_float32_matmul_precision`` raises when they
#: disagree (e.g. after ``torch.backends.cuda.matmul.allow_tf32 = False`` alone).
_KNOBS = ("cuda.matmul", "mkldnn.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.conv", "mkldnn.rnn")


@functools.cache
def _knobs() -> tuple[Any, ...]:
    """The per-backend switch objects this torch has (module singletons: found once)."""
    out = []
    for path in _KNOBS:
        obj: Any = torch.backends
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, "fp32_precision"):
            out.append(obj)
    return tuple(out)


def _matmul_now() -> str:
    """``torch.get_float32_matmul_precision()``, or ``"mixed (cuda: ..., mkldnn: ...)"`` where
    the per-backend switches disagree and torch's getter refuses to answer."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        parts = [
            f"{name.split('.')[0]}: {getattr(obj, 'fp32_precision', '?')}"
            for name, obj in zip(_KNOBS[:2], _knobs()[:2], strict=False)
        ]
        return f"mixed ({', '.join(parts)})"


def current_matmul_precision() -> dict[str, Any]:
    """torch's current settings: ``{"matmul": "highest"|"high"|"medium", "conv_tf32": bool}``
    (``"mixed (...)"`` where torch's per-backend switches disagree).

    torch's defaults are ``"highest"`` (TF32 off) for matmuls and TF32 on for cuDNN
    convolutions (torch's CUDA semantics notes, "TensorFloat-32 (TF32) on Ampere (and later)
    devices"); neither changes anything on a CPU.
    """
    return {"matmul": _matmul_now(), "conv_tf32": bool(torch.backends.cudnn.allow_tf32)}


#: The settings of the :func:`matmul_precision` blocks this thread has open, innermost last.
#: Per thread: a block of another thread is no reason to skip one here (the switches are
#: process-global, so threads running blocks at the same time still see each other's setting).
_OPEN = threading.local()


def _in_force() -> list[tuple[str, bool]]:
    stack = getattr(_OPEN, "stack", None)
    if stack is None:
        stack = _OPEN.stack = []
    return stack


def _torch_now() -> tuple[str, bool] | None:
    """``(float32 matmul precision, cuDNN TF32)`` now; None where torch's getter refuses."""
    try:
        return torch.get_float32_matmul_precision(), bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        return None


@contextlib.contextmanager
def matmul_precision(name: str | None) -> Iterator[None]:
    """Sets torch's float32 matmul and convolution precision for the block.

    Every switch is restored after the block as it was, also one a user set through torch's
    per-backend ``fp32_precision`` API or to values torch's legacy getter refuses to read.

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
    in_force = _in_force()
    if in_force and in_force[-1] == (row.torch_matmul, row.torch_cudnn_tf32) == _torch_now():
        # nested in a block that set the same (a train step's autocast inside the step): the
        # outer block restores; setting and saving again would cost a step ~20 us of host time
        yield
        return
    knobs = _knobs()
    saved = [(k, k.fp32_precision) for k in knobs]
    try:  # torch's own setting; unreadable only when explicit per-backend switches disagree
        old_matmul = torch.get_float32_matmul_precision()
    except RuntimeError:
        old_matmul = None
    old_conv = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision(row.torch_matmul)
    torch.backends.cudnn.allow_tf32 = row.torch_cudnn_tf32
    in_force.append((row.torch_matmul, row.torch_cudnn_tf32))
    try:
        yield
    finally:
        in_force.pop()
        torch.backends.cudnn.allow_tf32 = old_conv
        if old_matmul is not None:
            torch.set_float32_matmul_precision(old_matmul)
        for knob, value in saved:  # then each switch exactly as it was ("none": inherit)
            knob.fp32_precision = value
