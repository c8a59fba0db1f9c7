"""JAX per-layer overrides: :mod:`unimp.overrides` matched on pytree key paths, each leaf cast by
its own policy.

JAX has no layers to hook, so an override is a dtype per parameter path (jmp and haiku cast at
function boundaries; flax modules take ``dtype`` / ``param_dtype``):

* The paths are a pytree's key paths joined by ``.``: ``{"l2": {"w": ...}}`` -> ``"l2.w"``, a
  flax variables dict -> ``"params.Dense_0.kernel"`` (pass ``variables["params"]`` to match
  ``"Dense_0"``), list items by index. A bare array has the empty path and no override.
* ``mp.cast_to_compute`` / ``mp.cast_to_param`` (so :meth:`MixedPrecision.apply` and
  ``train_step``) cast each floating leaf to the compute / param dtype of
  ``policy.policy_for(path)``: a float32 override keeps ``l2``'s weights float32.
  ``mp.cast_to_compute(h, path="l2")`` casts an activation entering ``l2`` to ``l2``'s compute
  dtype, as torch's overridden modules and Keras layers cast their inputs (without it, ``h @ w``
  with ``h`` float16 and ``w`` float32 still runs in float32 by JAX's type promotion, but a
  bfloat16 override would promote float16 x bfloat16 to float32). ``cast_to_output`` stays one
  dtype.
* flax linen and nnx: ``mp.module_kwargs("l2")`` gives that module the override's ``dtype``
  and ``param_dtype`` (flax's per-module mechanism: flax.linen.Dense ``dtype`` is the
  computation dtype, ``param_dtype`` the parameters').
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from unimp.backends.jax.casting import cast_tree
from unimp.overrides import match_overrides, resolve_overrides
from unimp.policy import Policy
from unimp.step import check_scaled_half_params


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def key_path(path: tuple[Any, ...]) -> str:
    """A ``jax.tree_util`` key path as a dotted path (``(DictKey('l2'), DictKey('w'))`` -> ``"l2.w"``)."""
    return ".".join(_key_name(k) for k in path)


def layer_paths(tree: Any) -> list[str]:
    """The dotted paths overrides match in JAX: the pytree's leaf key paths.

    Example:
        >>> import jax.numpy as jnp
        >>> layer_paths({"l1": {"w": jnp.ones(2)}, "l2": [jnp.ones(2)]})
        ['l1.w', 'l2.0']
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [key_path(p) for p, _ in leaves]


def cast_by_path(tree: Any, policy: Policy, field: str, prefix: str = "") -> Any:
    """Casts each floating leaf to ``policy.policy_for(path).<field>`` (``"compute_dtype"``,
    ``"param_dtype"``); other leaves pass through. Traces under ``jit`` (paths are static).

    ``prefix`` places the tree at a layer's path: ``prefix="l2"`` casts a bare array (an
    activation entering layer ``l2``) by ``l2``'s policy, and a leaf at ``"w"`` by ``"l2.w"``'s.

    Raises:
        ValueError: an override conflict at some path.
    """
    if not policy.overrides:
        return cast_tree(tree, getattr(policy, field))
    base = getattr(policy, field)

    def cast(path: tuple[Any, ...], leaf: Any) -> Any:
        name = ".".join(p for p in (prefix, key_path(path)) if p)
        hit = match_overrides(policy.overrides, name) if name else None
        return cast_tree(leaf, getattr(hit[1], field) if hit else base)

    return jax.tree_util.tree_map_with_path(cast, tree)


def apply_overrides(mp: Any, tree: Any, field: str = "param_dtype") -> Any:
    """Checks the policy's overrides against a parameter tree and returns it cast by path.

    ``mp.prepare`` and ``train_step`` call it (``field="param_dtype"``): the place where an
    unmatched pattern warns and a conflict fails, before any step.

    Args:
        mp: the JAX ``MixedPrecision``.
        tree: the parameter pytree.
        field: ``"param_dtype"`` or ``"compute_dtype"``.

    Returns:
        The tree with floating leaves cast per path.

    Raises:
        ValueError: an override conflict, or an unknown ``field``.

    Warns:
        OverrideWarning: a pattern matches no leaf path.
    """
    if field not in ("param_dtype", "compute_dtype"):
        raise ValueError(f"field must be 'param_dtype' or 'compute_dtype', got {field!r}.")
    if mp.policy.overrides:
        resolve_overrides(mp.policy.overrides, layer_paths(tree), what="parameter")
    return cast_by_path(tree, mp.policy, field)


def check_half_leaves(params: Any, loss_scale: Any) -> None:
    """float16 parameter leaves under a loss scale: refused, named by their key paths (the
    rule of every backend, :func:`unimp.step.check_scaled_half_params`)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    check_scaled_half_params(
        [key_path(p) for p, x in leaves if getattr(x, "dtype", None) == jnp.float16],
        loss_scale,
        "a recipe or override with param dtype float32",
    )
