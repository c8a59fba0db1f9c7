"""Scaling out: helpers for data-parallel engines. Framework-free at import.

The engine integrations live in submodules, imported on first use:
``unimp.distributed.torch`` (torch.distributed: DDP, FSDP) and ``unimp.distributed.horovod``
(``.torch`` and ``.tensorflow``).

This module holds the framework-free rule for averaging gradients that travel as float16
(:func:`fp16_mean`), written once over NumPy and matched bit for bit by the torch DDP comm hook
(:func:`unimp.distributed.torch.fp16_mean_hook`) and the Horovod compression.

Why the order matters (2 workers, float16 wire):

* summing first overflows: 40000 + 40000 = 80000 > 65504 (float16 max) -> inf, although the
  mean 40000 is representable. Horovod's ``Compression.fp16`` with ``op=Average`` and torch's
  ``fp16_compress_hook`` applied to values that do not fit float16 do exactly this.
* ``"predivide"`` (divide by the world size in float32, round to float16, sum in float16): the
  partial sums of same-sign values never exceed the mean, so 40000 stays 40000. Small values
  lose: 2**-24 / 2 = 2**-25 is exactly half the smallest float16 subnormal and rounds (ties to
  even) to 0, so two workers holding 2**-24 average to 0, not 2**-24 (a flush to zero).
* ``"float32"`` (each worker's float16 value is gathered, accumulated in float32, then divided):
  40000 -> 40000 and 2**-24 -> 2**-24 exactly; costs an all-gather instead of an all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["FP16_MEAN_MODES", "fp16_mean"]

#: How :func:`fp16_mean` averages: see the module docstring.
FP16_MEAN_MODES = ("predivide", "float32")


def fp16_mean(values: Sequence[Any], mode: str = "predivide") -> np.ndarray:
    """The mean of per-worker gradients sent as float16, as the wire computes it (reference).

    Args:
        values: one array (any float dtype, any shape, the same shape on every worker) per
            worker.
        mode: ``"predivide"``: each value is divided by the worker count in float32, rounded to
            float16 and summed in float16 (an all-reduce on a float16 buffer); ``"float32"``:
            each value is rounded to float16 (the wire), summed in float32 and divided by the
            worker count. Neither overflows when the mean is representable in float16
            (``"predivide"`` for same-sign values); ``"predivide"`` flushes means below
            2**-24 * n / 2 toward 0.

    Returns:
        float16 array, the mean (``inf``/``nan`` where the wire overflowed).

    Raises:
        ValueError: no values, shapes that differ, or an unknown ``mode`` (lists the modes).

    Example:
        >>> float(fp16_mean([np.float16(40000), np.float16(40000)]))
        40000.0
        >>> float(fp16_mean([np.float16(2**-24)] * 2)), float(fp16_mean([np.float16(2**-24)] * 2, "float32"))
        (0.0, 5.960464477539063e-08)
    """
    if mode not in FP16_MEAN_MODES:
        raise ValueError(f"fp16_mean mode must be one of {FP16_MEAN_MODES}, got {mode!r}.")
    arrays = [np.asarray(v) for v in values]
    if not arrays:
        raise ValueError("fp16_mean needs at least one worker's value.")
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise ValueError(f"every worker's value must have the same shape, got {sorted(shapes)}.")
    n = len(arrays)
    with np.errstate(over="ignore", invalid="ignore"):
        if mode == "predivide":
            total = np.zeros(arrays[0].shape, np.float16)
            for a in arrays:
                total = (total + (a.astype(np.float32) / np.float32(n)).astype(np.float16)).astype(np.float16)
            return total
        acc = np.zeros(arrays[0].shape, np.float32)
        for a in arrays:
            acc = acc + a.astype(np.float16).astype(np.float32)
        return (acc / np.float32(n)).astype(np.float16)
