"""The kit of a backend, imported only inside that backend's worker process."""

from __future__ import annotations

import importlib
from types import ModuleType


def kit(backend: str) -> ModuleType:
    """``benchmarks._kit_<backend>``: its ``Trainer``, ``framework_version``, memory readers."""
    return importlib.import_module(f"benchmarks._kit_{backend}")
