"""The policy's float32 matmul precision on any Keras backend: Keras computes with its engine's
kernels, so the setting is the engine's own, set by that framework's unimp backend
(:mod:`unimp.backends.torch.precision`, :mod:`unimp.backends.jax.precision`,
:mod:`unimp.backends.tensorflow.precision`), from the one table
:data:`unimp.precision.MATMUL_PRECISION_TABLE`."""

from __future__ import annotations

import contextlib
from typing import Any

import keras

from unimp import registry
from unimp.precision import check_matmul_precision

__all__ = ["current_matmul_precision", "matmul_precision"]


def matmul_precision(name: str | None) -> contextlib.AbstractContextManager:
    """A context manager setting the engine's float32 matmul / convolution precision for the
    block (``"highest"``, ``"high"``, ``"medium"``; ``None`` changes nothing), restored after.

    Raises:
        ValueError: an unknown name (before anything is changed).
        ImportError: the engine's unimp backend cannot load (its extra is named).
    """
    name = check_matmul_precision(name)
    if name is None:
        return contextlib.nullcontext()
    return registry.get_backend(keras.backend.backend()).matmul_precision(name)


def current_matmul_precision() -> dict[str, Any]:
    """The engine's current setting, as its backend reports it (``"api"`` names the API)."""
    return registry.get_backend(keras.backend.backend()).current_matmul_precision()
