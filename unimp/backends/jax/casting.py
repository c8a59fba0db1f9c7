"""JAX casting: canonical dtype names to NumPy/JAX dtypes and ``cast_tree`` over pytrees (floating
array leaves only, as jmp's ``_cast_floating_to``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from unimp.dtypes import canonical_dtype


def to_dtype(name: Any) -> np.dtype:
    """The JAX dtype for a dtype name.

    Args:
        name: anything :func:`unimp.dtypes.canonical_dtype` accepts (``"bf16"``,
            ``jnp.float16``, ``"float32"``, ...).

    Returns:
        A NumPy dtype object as JAX uses it (``jnp.dtype("bfloat16")`` for bfloat16).

    Raises:
        ValueError: not a supported floating dtype; or ``float64`` while JAX runs in 32-bit
            mode (enable it with ``jax.config.update("jax_enable_x64", True)``).
    """
    canonical = canonical_dtype(name)
    if canonical == "float64" and not jax.config.jax_enable_x64:
        raise ValueError(
            "float64 needs JAX's 64-bit mode: call jax.config.update('jax_enable_x64', True) "
            "before creating arrays, or use a float32 policy."
        )
    return jnp.dtype(canonical)


def _is_floating_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(
        x.dtype, jnp.floating
    )


def cast_tree(tree: Any, dtype: Any) -> Any:
    """Casts the floating array leaves of a pytree; every other leaf passes through.

    Integer, boolean and complex arrays, Python scalars and non-array leaves are returned
    unchanged (as jmp's ``_cast_floating_to`` and Keras's ``_should_cast``). NumPy arrays stay
    NumPy arrays; JAX arrays (and tracers) stay JAX arrays.

    Args:
        tree: any pytree.
        dtype: the target floating dtype, anything :func:`to_dtype` accepts.

    Returns:
        A pytree of the same structure.

    Raises:
        ValueError: ``dtype`` is not a supported floating dtype.

    Example:
        >>> import jax.numpy as jnp
        >>> out = cast_tree({"w": jnp.ones(2), "step": jnp.int32(3)}, "float16")
        >>> out["w"].dtype, out["step"].dtype
        (dtype('float16'), dtype('int32'))
    """
    target = to_dtype(dtype)

    def cast(x: Any) -> Any:
        if _is_floating_array(x) and x.dtype != target:
            return x.astype(target)
        return x

    return jax.tree_util.tree_map(cast, tree)
