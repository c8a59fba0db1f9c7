"""TensorFlow casting: canonical dtype names to TF dtypes, ``cast_tree`` over nested structures
(tensors, variables, NumPy arrays), and the Keras dtype-policy name for a param / compute pair.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from unimp.dtypes import canonical_dtype, keras_policy_name  # noqa: F401  (the backend's public name)

_TF_DTYPES = {
    "float64": tf.float64,
    "float32": tf.float32,
    "float16": tf.float16,
    "bfloat16": tf.bfloat16,
}


def to_dtype(name: Any) -> tf.DType:
    """The ``tf.DType`` for a canonical dtype name.

    Args:
        name: anything :func:`unimp.dtypes.canonical_dtype` accepts (``"float16"``, ``"bf16"``,
            ``tf.float16``, ...).

    Returns:
        ``tf.float64``, ``tf.float32``, ``tf.float16`` or ``tf.bfloat16``.

    Raises:
        ValueError: not a supported floating dtype; the message lists the accepted names.

    Example:
        >>> to_dtype("bf16")
        tf.bfloat16
    """
    return _TF_DTYPES[canonical_dtype(name)]


def _is_floating_array(x: Any) -> bool:
    if isinstance(x, (tf.Tensor, tf.Variable, keras.Variable)):
        return bool(tf.as_dtype(x.dtype).is_floating)
    if isinstance(x, tf.IndexedSlices):
        return bool(x.values.dtype.is_floating)
    if isinstance(x, (np.ndarray, np.generic)):
        return bool(np.issubdtype(x.dtype, np.floating)) or x.dtype.name == "bfloat16"
    return False


def _cast_leaf(x: Any, dtype: tf.DType) -> Any:
    if not _is_floating_array(x):
        return x
    if isinstance(x, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(x.values, dtype), x.indices, x.dense_shape)
    if isinstance(x, keras.Variable):
        x = x.value
    return tf.cast(x, dtype)


def cast_tree(tree: Any, dtype: Any) -> Any:
    """Casts the floating array leaves of a nested structure to ``dtype``.

    Floating ``tf.Tensor``, ``tf.Variable``, ``keras.Variable``, ``tf.IndexedSlices`` and NumPy
    floating arrays are cast (the result is a ``tf.Tensor``); integers, booleans, Python
    scalars, strings and other objects pass through unchanged (as Keras's ``_should_cast`` and
    jmp's ``_cast_floating_to``).

    Args:
        tree: a nest of lists, tuples, dicts and leaves (``tf.nest`` structure rules).
        dtype: the target floating dtype (any form :func:`to_dtype` accepts).

    Returns:
        A structure of the same shape.

    Raises:
        ValueError: ``dtype`` is not a supported floating dtype.

    Example:
        >>> import tensorflow as tf
        >>> out = cast_tree({"x": tf.ones(2), "ids": tf.constant([1, 2])}, "float16")
        >>> out["x"].dtype, out["ids"].dtype
        (tf.float16, tf.int32)
    """
    target = to_dtype(dtype)
    return tf.nest.map_structure(lambda x: _cast_leaf(x, target), tree)


