"""JAX overflow detection: ``all_finite`` (optionally reduced over a mesh axis), ``select_tree``,
keeping a pytree unchanged on a skipped step, and ``sync_loss_scale`` across replicas.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from unimp.backends.jax.casting import _is_floating_array
from unimp.loss_scale import warn_replica_desync
from unimp.trainstep import NORM_RESCALE_ABOVE


def all_finite(tree: Any, axis_name: Any = None) -> jax.Array:
    """True when every floating element of a pytree is finite (no host sync).

    Non-floating leaves (integers, booleans, non-arrays) are ignored; an empty tree is finite.

    Args:
        tree: a pytree of arrays.
        axis_name: a mapped axis name (``pmap``, ``shard_map``, ``vmap(axis_name=...)``). When
            given, the result is reduced across that axis with ``lax.pmin`` so every replica
            takes the same skip decision: a non-finite element on any replica (a local
            gradient shard, for example) makes it False on all of them.

    Returns:
        A bool scalar array.

    Example:
        >>> import jax.numpy as jnp
        >>> bool(all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
        False
    """
    leaves = [
        x
        for x in jax.tree_util.tree_leaves(tree)
        if _is_floating_array(x) or (isinstance(x, float) and not isinstance(x, bool))
    ]
    if leaves:
        finite = jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()
    else:
        finite = jnp.array(True)
    if axis_name is not None:
        finite = lax.pmin(finite.astype(jnp.int32), axis_name) > 0
    return finite


def check_pred(pred: Any, where: str) -> jax.Array:
    if isinstance(pred, jax.Array) or isinstance(pred, (np.ndarray, np.generic, bool)):
        p = jnp.asarray(pred)
    else:
        raise TypeError(
            f"{where}: pred must be a bool scalar (Python or array), got {type(pred).__name__}."
        )
    if p.shape != () or p.dtype != jnp.bool_:
        raise ValueError(
            f"{where}: pred must be a bool scalar, got dtype {p.dtype} shape {p.shape}; "
            "reduce it first, e.g. with all_finite(tree) or jnp.all(x)."
        )
    return p


def select_tree(pred: Any, a: Any, b: Any) -> Any:
    """Picks pytree ``a`` where ``pred`` is true, else ``b``, leaf by leaf, without a branch.

    The chosen values are returned bitwise (``lax.select``), so a skipped step leaves its
    state exactly unchanged.

    Args:
        pred: a bool scalar (array or Python bool).
        a: a pytree.
        b: a pytree of ``a``'s structure, whose leaves have ``a``'s shapes and dtypes.

    Returns:
        A pytree like ``a``.

    Raises:
        ValueError: ``pred`` is not a bool scalar, or the trees differ in structure, shape or
            dtype (the message names the first differing leaf).
    """
    p = check_pred(pred, "select_tree")
    sa, sb = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
    if sa != sb:
        raise ValueError(f"select_tree: a and b must have the same structure, got {sa} and {sb}.")
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(a)]
    for path, x, y in zip(paths, leaves_a, leaves_b, strict=True):
        x, y = jnp.asarray(x), jnp.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ValueError(
                f"select_tree: leaf {path or '<root>'} differs: {x.dtype}{list(x.shape)} vs "
                f"{y.dtype}{list(y.shape)}; cast both to one dtype and shape first."
            )
    return jax.tree_util.tree_map(lambda x, y: lax.select(p, jnp.asarray(x), jnp.asarray(y)), a, b)


def _keep_unless(pred: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``pred`` else ``old``, in ``old``'s dtypes (optimizer states may change
    weak types between steps); ``old`` comes back bitwise when ``pred`` is false."""
    return jax.tree_util.tree_map(
        lambda n, o: jnp.where(pred, n, o).astype(jnp.result_type(o)), new, old
    )


def _warn_resync() -> None:
    warn_replica_desync("Restore the loss-scale state on every process")


def _varying_axes(x: Any) -> frozenset:
    """The mesh axes ``x`` varies over under shard_map (JAX's variance typing, check_vma=True);
    empty where JAX does not track it."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # JAX >= 0.9
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # JAX 0.6 - 0.8


def _tracks_variance(axis_name: Any) -> bool:
    """True under shard_map with check_vma=True: JAX types values as varying over the axis,
    and the gradient of an invariant (replicated) param is all-reduced by the transpose."""
    return axis_name in _varying_axes(lax.axis_index(axis_name))


def sync_loss_scale(ls: Any, axis_name: Any) -> Any:
    """The loss-scale state of replica 0 on every replica, warning when the replicas differed.

    unimp's rule for replicas that start with different loss-scale states (a checkpoint
    restored on one host only): they are re-synchronized from replica 0 with a
    :class:`ReplicaDesyncWarning`, never silently and never by averaging. The check is one
    ``all_gather`` of four scalars per step; the warning is a ``jax.debug.callback`` that runs
    only when the states differ (no host sync otherwise). :class:`TrainStep` and
    :func:`loss_scaling` call it when given an ``axis_name``.

    Args:
        ls: a loss-scale pytree (:class:`~unimp.backends.jax.LossScale`).
        axis_name: the mapped axis (``shard_map`` / ``pmap``) whose replicas must agree.

    Returns:
        A loss-scale pytree like ``ls`` holding replica 0's values (replicated over the axis).
    """
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    index = lax.axis_index(axis_name)
    firsts, differs = [], []
    for x in leaves:
        x = jnp.asarray(x)
        # replica 0's value on every replica: a sum of it and zeros is exact
        firsts.append(lax.psum(jnp.where(index == 0, x, jnp.zeros_like(x)), axis_name))
        everyone = lax.all_gather(x, axis_name)
        differs.append(jnp.any(everyone != everyone[:1]))
    differ = lax.pmax(jnp.stack(differs).any().astype(jnp.int32), axis_name) > 0
    lax.cond(differ, lambda: jax.debug.callback(_warn_resync), lambda: None)
    return jax.tree_util.tree_unflatten(treedef, firsts)


def _own_gradients(params: Any, axis_name: Any) -> tuple[Any, Any]:
    """For an all-reduce in the policy's ``reduce_dtype`` under variance tracking: which leaves
    are replicated (invariant over the axis: JAX's transpose would all-reduce their gradient
    in its own dtype), and ``params`` with those made varying (``lax.pcast``), so that each
    replica's gradient stays its own until :func:`_reduce_in`. Sharded leaves keep theirs."""
    replicated = jax.tree_util.tree_map(lambda p: axis_name not in _varying_axes(p), params)
    own = jax.tree_util.tree_map(
        lambda p, r: jax.lax.pcast(p, axis_name, to="varying") if r else p, params, replicated
    )
    return replicated, own


def _reduce_in(grads: Any, axis_name: Any, dtype: Any, replicated: Any = None) -> Any:
    """The gradients all-reduced over ``axis_name`` in ``dtype`` (``None``: their own), cast
    back. ``replicated`` (from :func:`_own_gradients`): each replica's share of the mean loss's
    gradient, SUMMED (``psum``) where True; ``None``: every leaf is a replica's own gradient of
    its local loss, AVERAGED (``pmean``, the pmap convention). A float16 overflow of the sum is
    the same inf on every replica, so every replica skips."""
    if replicated is None:
        return jax.tree_util.tree_map(
            lambda g: jax.lax.pmean(g.astype(dtype or g.dtype), axis_name).astype(g.dtype), grads
        )
    return jax.tree_util.tree_map(
        lambda g, r: jax.lax.psum(g.astype(dtype), axis_name).astype(g.dtype) if r else g,
        grads, replicated,
    )


def _norm_rescale(amax: jax.Array) -> jax.Array:
    """The global norm's factor ``s`` for ``amax`` (float32 0-d), as
    :data:`unimp.trainstep.NORM_RESCALE_ABOVE` defines it: a power of two from ``amax``'s
    exponent bits where ``amax`` is finite and above the threshold, else 1."""
    bits = lax.bitcast_convert_type(amax, jnp.int32) & jnp.int32(0x7F800000)
    power = lax.bitcast_convert_type(bits, jnp.float32)  # 2**floor(log2 amax)
    big = jnp.isfinite(amax) & (amax > NORM_RESCALE_ABOVE)
    return jnp.where(big, jnp.float32(NORM_RESCALE_ABOVE) / jnp.where(big, power, 1.0), jnp.float32(1.0))


def _global_norm(grads: Any, axis_name: Any = None) -> tuple[jax.Array, jax.Array]:
    """``(norm, s)``: the global L2 norm of the gradients, accumulated in float32 whatever their dtype (a float16
    norm overflows at 256; ``optax.tree.norm`` sums in the leaves' dtype) and rescaled by
    :data:`unimp.trainstep.NORM_RESCALE_ABOVE`'s rule, so that finite gradients never
    overflow it. The rule of every backend (torch and TensorFlow cast each gradient to
    float32 too).

    Under shard_map (``axis_name``): squares of gradients that vary over the axis (local shards)
    are summed over it, and their largest magnitude is taken over it (one ``s`` everywhere);
    replicated (already all-reduced) ones are not."""
    leaves = jax.tree_util.tree_leaves(grads)
    varying = [axis_name is not None and axis_name in _varying_axes(g) for g in leaves]
    wide = [g.astype(jnp.promote_types(g.dtype, jnp.float32)) for g in leaves]
    local_max, shared_max = jnp.float32(0.0), jnp.float32(0.0)
    for g, v in zip(wide, varying, strict=True):
        m = jnp.max(jnp.abs(g), initial=0.0).astype(jnp.float32)
        if v:
            local_max = jnp.maximum(local_max, m)
        else:
            shared_max = jnp.maximum(shared_max, m)
    if any(varying):
        shared_max = jnp.maximum(shared_max, lax.pmax(local_max, axis_name))
    s = _norm_rescale(shared_max)
    local, shared = jnp.float32(0.0), jnp.float32(0.0)
    for g, v in zip(wide, varying, strict=True):
        sq = jnp.sum(jnp.square(g * s.astype(g.dtype)))
        if v:
            local = local + sq
        else:
            shared = shared + sq
    total = shared if axis_name is None else shared + lax.psum(local, axis_name)
    return jnp.sqrt(total) / s, s


def _clip(g: jax.Array, clip: jax.Array, s: jax.Array, factor: jax.Array) -> jax.Array:
    """``(g * s) * factor`` where ``clip``, multiplied in float32 (at least) and rounded once
    to ``g``'s dtype, as torch's in-place multiply of a half tensor by a float32 scalar
    (``s`` and ``factor``: :data:`unimp.trainstep.NORM_RESCALE_ABOVE`'s rescaled clip)."""
    wide = jnp.promote_types(g.dtype, jnp.float32)
    return jnp.where(clip, (g.astype(wide) * s * factor).astype(g.dtype), g)
