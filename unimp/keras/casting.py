"""Keras dtypes and casts on any Keras backend: :func:`to_dtype`, :func:`cast_tree`, and the
Keras policy names (:func:`unimp.dtypes.keras_policy_name`)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

from unimp.dtypes import canonical_dtype, keras_policy_name  # noqa: F401  (the package's public name)

__all__ = ["cast_tree", "keras_policy_name", "to_dtype"]


def to_dtype(name: Any) -> str:
    """Keras's dtype for a canonical dtype name: Keras names dtypes by strings on every backend.

    Args:
        name: anything :func:`unimp.dtypes.canonical_dtype` accepts (``"float16"``, ``"bf16"``,
            a NumPy or framework dtype, ...).

    Returns:
        ``"float64"``, ``"float32"``, ``"float16"`` or ``"bfloat16"``.

    Raises:
        ValueError: not a supported floating dtype; the message lists the accepted names.

    Example:
        >>> to_dtype("bf16")
        'bfloat16'
    """
    return canonical_dtype(name)


def _is_floating(x: Any) -> bool:
    if isinstance(x, (np.ndarray, np.generic)):
        return bool(np.issubdtype(x.dtype, np.floating)) or x.dtype.name == "bfloat16"
    if isinstance(x, (keras.Variable, keras.KerasTensor)) or ops.is_tensor(x):
        return "float" in keras.backend.standardize_dtype(x.dtype)
    return False


def cast_tree(tree: Any, dtype: Any) -> Any:
    """Casts the floating array leaves of a nested structure to ``dtype`` with ``keras.ops.cast``.

    Floating tensors of the Keras backend, ``keras.Variable``\\ s (their value) and NumPy
    floating arrays are cast (the result is a tensor of the backend); integers, booleans,
    Python scalars, strings and other objects pass through unchanged (as Keras's
    ``_should_cast`` and jmp's ``_cast_floating_to``).

    Args:
        tree: a nest of lists, tuples, dicts and leaves (``keras.tree`` structure rules).
        dtype: the target floating dtype (any form :func:`to_dtype` accepts).

    Returns:
        A structure of the same shape.

    Raises:
        ValueError: ``dtype`` is not a supported floating dtype.

    Example:
        >>> import numpy as np
        >>> out = cast_tree({"x": np.ones(2, np.float32), "ids": np.array([1, 2])}, "float16")
        >>> keras.backend.standardize_dtype(out["x"].dtype), out["ids"].dtype.name
        ('float16', 'int64')
    """
    target = to_dtype(dtype)

    def leaf(x: Any) -> Any:
        if not _is_floating(x):
            return x
        return ops.cast(x.value if isinstance(x, keras.Variable) else x, target)

    return keras.tree.map_structure(leaf, tree)
