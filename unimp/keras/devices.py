"""What a Keras run is on: :func:`framework_version` (Keras and its engine), for ``unimp info``,
the step log and the compare report."""

from __future__ import annotations

import importlib

import keras

__all__ = ["framework_version"]


def framework_version() -> str:
    """Keras's version and its engine's, e.g. ``"keras 3.15.0 on jax 0.10.2"``."""
    engine = keras.backend.backend()
    version = getattr(importlib.import_module(engine), "__version__", "unknown")
    return f"keras {keras.__version__} on {engine} {version}"
