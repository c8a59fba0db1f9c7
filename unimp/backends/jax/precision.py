"""JAX matmul precision: :data:`unimp.precision.MATMUL_PRECISION_TABLE` translated to
``jax.default_matmul_precision`` (the ``jax_default_matmul_precision`` config), set for a block.

unimp sets the config's ``lax.Precision`` names (``"float32"``, ``"tensorfloat32"``,
``"bfloat16"``), never a ``jax.lax.DotAlgorithmPreset`` name, although the config takes those
too: :mod:`unimp.precision` says why (a preset default reaches half-precision dots and misses
convolutions).

The config is read when a function is traced and is part of ``jax.jit``'s cache key, so unimp's
train step traces (and compiles) its program under the recipe's precision and a later call
under another setting compiles its own program; ``jax.default_matmul_precision`` is JAX's own
context manager and restores the previous value (thread-local) when the block ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from unimp.precision import MATMUL_PRECISION_TABLE, check_matmul_precision

__all__ = ["current_matmul_precision", "matmul_precision"]


def current_matmul_precision() -> dict[str, Any]:
    """JAX's current setting: ``{"api": "default_matmul_precision", "default_matmul_precision":
    None | str}`` (a ``lax.Precision`` name, or a ``DotAlgorithmPreset`` name a user set).

    ``None`` is the platform's fastest: "float32 dot products may be computed with
    reduced-precision arithmetic internally (bfloat16 on TPU, TF32 on recent GPUs)" (JAX's
    "Matmul precision" page); full float32 on a CPU.
    """
    return {"api": "default_matmul_precision", "default_matmul_precision": jax.config.jax_default_matmul_precision}


@contextlib.contextmanager
def matmul_precision(name: str | None) -> Iterator[None]:
    """Sets ``jax.default_matmul_precision`` for the block (``"highest"``: ``"float32"``,
    ``"high"``: ``"tensorfloat32"``, ``"medium"``: ``"bfloat16"``).

    Args:
        name: ``"highest"``, ``"high"``, ``"medium"`` or ``None`` (change nothing).

    Raises:
        ValueError: an unknown name (before anything is changed).
    """
    name = check_matmul_precision(name)
    if name is None:
        yield
        return
    with jax.default_matmul_precision(MATMUL_PRECISION_TABLE[name].jax):
        yield
