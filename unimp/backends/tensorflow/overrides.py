"""Keras per-layer overrides on TensorFlow: Keras's mechanism (per-layer dtype policies), the same
on every Keras backend, so the code is :mod:`unimp.keras.overrides`'s, the Keras layer this
backend builds on (see ``unimp/keras/__init__.py``)."""

from unimp.keras.overrides import apply_overrides, dtype_policy_map, layer_paths, resolve

__all__ = ["apply_overrides", "dtype_policy_map", "layer_paths", "resolve"]
