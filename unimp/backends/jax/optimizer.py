"""JAX optimizer: :func:`loss_scaling`, an optax transformation carrying the loss scale in its
state (a skipped step leaves params and the inner state unchanged), :func:`get_loss_scale`,
:class:`MultiSteps`, :func:`_float32_update` (an optimizer's scalars in float32 for half
parameters), the half-optimizer-state check for optax states, and :class:`UpdateOps`, the array
namespace of :mod:`unimp.rounding` (how a half parameter takes its update), and
:func:`half_update`, which applies that rule to an optax optimizer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from unimp.backends.jax.overflow import _keep_unless, all_finite, sync_loss_scale
from unimp.backends.jax.scaling import LossScale, LossScaleOps
from unimp.rounding import check_seed, check_update_mode, check_update_state, update_half


class LossScaleOptState(NamedTuple):
    """State of :func:`loss_scaling`: the :class:`LossScale` and the inner optimizer's state."""

    loss_scale: Any
    inner_state: Any


def loss_scaling(
    inner: optax.GradientTransformation, loss_scale: Any = "dynamic", *, axis_name: Any = None
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax optimizer with loss scaling; the scale lives in the optimizer state.

    ``update`` takes the *scaled* gradients, unscales them, and when they (and the loss, if
    given as ``value=``) are finite, runs the inner optimizer. A non-finite step is skipped:
    the updates are zeros (negative zeros, so ``optax.apply_updates`` leaves every parameter
    bitwise unchanged, ``-0.0`` included), the inner state is returned bitwise unchanged, and
    the skip is counted. The scale is adjusted by unimp's algorithm either way. Unlike
    ``optax.apply_if_finite`` it never gives up and applies a non-finite update.

    Read the scale for the next loss with :func:`get_loss_scale`. Works inside
    :class:`MultiSteps` (a window with a non-finite micro-batch is skipped whole).

    Args:
        inner: the optax optimizer to protect.
        loss_scale: a core config, a :class:`LossScale`, or a spec such as ``"dynamic"``.
        axis_name: under ``shard_map`` / ``pmap``, the data-parallel axis: the finite flags
            are reduced over it (a non-finite gradient on any replica skips the step on all)
            and the loss-scale state is taken from replica 0 (:func:`sync_loss_scale`), so
            the replicas' scales and parameters stay identical. ``None``: one replica.

    Returns:
        A ``GradientTransformationExtraArgs``; ``update(updates, state, params=None, *,
        value=None, **extra_args)`` where ``value`` is the unscaled loss (its non-finiteness is
        a forward overflow: skipped without reducing the scale). Extra args go to ``inner``.

    Raises:
        TypeError: ``inner`` is not an optax GradientTransformation.
        ValueError: a bad loss-scale spec.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> opt = loss_scaling(optax.sgd(1.0), 8.0)
        >>> state = opt.init(jnp.zeros(2))
        >>> updates, state = opt.update(jnp.array([jnp.nan, 0.0]), state)
        >>> updates.tolist(), int(get_loss_scale(state).state.total_skips)
        ([-0.0, -0.0], 1)
    """
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            f"loss_scaling needs an optax GradientTransformation (e.g. optax.adam(1e-3)), got {type(inner).__name__}."
        )
    initial = loss_scale if isinstance(loss_scale, LossScale) else LossScale.from_config(loss_scale)
    inner = _float32_update(inner)

    def init_fn(params: Any) -> LossScaleOptState:
        return LossScaleOptState(initial, inner.init(params))

    def update_fn(
        updates: Any, state: LossScaleOptState, params: Any = None, **extra_args: Any
    ) -> Any:
        ls = state.loss_scale
        if axis_name is not None:
            ls = sync_loss_scale(ls, axis_name)
        grads = ls.unscale(updates)
        grads_finite = all_finite(grads, axis_name)
        value = extra_args.get("value")
        loss_finite = jnp.array(True) if value is None else all_finite(value, axis_name)
        applied = grads_finite & loss_finite
        new_updates, new_inner = inner.update(grads, state.inner_state, params, **extra_args)
        new_updates = jax.tree_util.tree_map(
            lambda u: jnp.where(applied, u, jnp.full_like(u, -0.0)), new_updates
        )
        inner_state = _keep_unless(applied, new_inner, state.inner_state)
        return new_updates, LossScaleOptState(ls.adjust(grads_finite, loss_finite), inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def get_loss_scale(opt_state: Any) -> LossScale:
    """The :class:`LossScale` inside an optimizer state built with :func:`loss_scaling`.

    Searches nested states (``optax.chain``, :class:`MultiSteps`, ...). Inside ``MultiSteps``
    this is the committed scale, constant through an accumulation window. Scale the loss with
    ``get_loss_scale(opt_state).scale(loss)``.

    Raises:
        ValueError: none or more than one :class:`LossScaleOptState` in ``opt_state``.
    """
    found = [
        x.loss_scale
        for x in jax.tree_util.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, LossScaleOptState)
        )
        if isinstance(x, LossScaleOptState)
    ]
    if len(found) != 1:
        raise ValueError(
            f"expected one loss_scaling(...) state in the optimizer state, found {len(found)}; "
            "wrap the optimizer once with unimp.backends.jax.loss_scaling."
        )
    return found[0]


def _is_half(x: Any) -> bool:
    return getattr(x, "dtype", None) in (jnp.bfloat16, jnp.float16)


def _widen(tree: Any) -> Any:
    """``tree`` with its half-precision leaves as float32 (exact); other leaves as they are."""
    return jax.tree_util.tree_map(lambda x: x.astype(jnp.float32) if _is_half(x) else x, tree)


def _injected(path: Any) -> bool:
    """A leaf of an ``optax.inject_hyperparams`` state's ``hyperparams`` dict."""
    return any(getattr(k, "name", None) == "hyperparams" for k in path)


def _float32_update(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Runs an optax optimizer's arithmetic in float32 for half-precision parameters, keeping its
    state in the dtypes it holds them (pure ``bfloat16`` / ``float16`` training).

    optax computes in the dtypes it is given, and ``optax.inject_hyperparams`` casts its
    hyperparameters to the parameters' dtype: with bfloat16 parameters Adam's ``b2 = 0.999``
    becomes 1.0, the bias correction ``1 - b2**t`` is 0, and the first step writes NaN
    parameters. torch's optimizers compute their scalars (step counts, bias corrections,
    hyperparameters) in float32 or wider whatever the parameters' dtype, and so does this:
    ``update`` sees float32 copies of half parameters and gradients, the new state is cast back
    to the dtypes the state had (moments stay bfloat16, as optax and torch keep them), the
    injected hyperparameters are held in float32 from ``init`` on, and the updates come back in
    the parameters' dtype. Only an optimizer whose state holds injected hyperparameters is
    changed: without half parameters, or with optax's own Python-float hyperparameters (which
    stay weakly typed, so ``optax.adam`` computes its bias correction in float32 already),
    ``inner`` runs unchanged (no cost; transformations that ``lax.cond`` over their state, as
    ``optax.apply_if_finite``, keep their dtypes). Such a transformation around an injected
    optimizer fails in optax's own ``cond`` when widened, as it does with
    ``hyperparam_dtype=jnp.float32``: keep ``inject_hyperparams`` outermost.

    :class:`TrainStep` and :func:`loss_scaling` apply it to the optimizer they are given.

    Args:
        inner: an optax ``GradientTransformation``.

    Returns:
        A ``GradientTransformationExtraArgs`` with ``inner``'s state structure.
    """
    inner = optax.with_extra_args_support(inner)

    def has_half(params: Any) -> bool:
        return params is not None and any(_is_half(x) for x in jax.tree_util.tree_leaves(params))

    def injected(state: Any) -> list[Any]:
        return [x for path, x in jax.tree_util.tree_flatten_with_path(state)[0] if _injected(path)]

    def injected_half(state: Any) -> bool:
        return any(_is_half(x) for x in injected(state))

    def injected_float32(state: Any) -> bool:  # init_fn held them in float32: widen the update
        return any(getattr(x, "dtype", None) == jnp.float32 for x in injected(state))

    def init_fn(params: Any) -> Any:
        held = inner.init(params)
        if not has_half(params) or not injected_half(held):
            return held
        wide = inner.init(_widen(params))  # the hyperparameters' true values, in float32
        return jax.tree_util.tree_map_with_path(
            lambda path, h, w: w if _injected(path) and _is_half(h) else h, held, wide
        )

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        if not has_half(params) or not injected_float32(state):
            return inner.update(updates, state, params, **extra_args)
        new_updates, new_state = inner.update(_widen(updates), state, _widen(params), **extra_args)
        new_state = jax.tree_util.tree_map(
            lambda new, old: new.astype(old.dtype) if hasattr(old, "dtype") and hasattr(new, "astype") else new,
            new_state,
            state,
        )
        new_updates = jax.tree_util.tree_map(
            lambda u, p: u.astype(p.dtype) if hasattr(p, "dtype") and hasattr(u, "astype") else u,
            new_updates,
            params,
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class MultiSteps(optax.MultiSteps):
    """``optax.MultiSteps`` whose gradient accumulator is reset to exact zeros after a window.

    optax resets the accumulator by multiplying it by zero, which leaves NaN (``0 * nan``)
    after a window with a non-finite micro-batch, so every later window is non-finite and
    skipped too. This subclass replaces the accumulator with ``zeros`` whenever a window
    ends, so with :func:`loss_scaling` as the inner optimizer a bad window is skipped whole and
    the next one starts clean. Arguments are optax.MultiSteps's.
    """

    def update(self, updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        new_updates, new_state = super().update(updates, state, params, **extra_args)
        window_done = new_state.mini_step == 0
        acc = jax.tree_util.tree_map(
            lambda a: jnp.where(window_done, jnp.zeros_like(a), a), new_state.acc_grads
        )
        return new_updates, new_state._replace(acc_grads=acc)


#: optax state fields holding running squares of gradients (Adam/AdamW/Adamax/NAdam's ``nu``,
#: RMSprop's ``nu``, Adagrad's ``sum_of_squares``, AdaBelief's ``nu``)
_SECOND_MOMENTS = frozenset({"nu", "sum_of_squares"})


def _count_skipped(opt_state: Any, applied: Any) -> Any:
    """``schedule_counts="attempted"``: every integer ``count`` leaf of the optax state (schedules,
    Adam's bias correction, EMA debiasing) grows by one on a skipped step, so it counts
    attempted steps; nothing else changes. Branch-free (``jnp.where``)."""

    def advance(path: Any, x: Any) -> Any:
        named = path and getattr(path[-1], "name", None) == "count"
        if named and hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.integer):
            return jnp.where(applied, x, x + 1)
        return x

    return jax.tree_util.tree_map_with_path(advance, opt_state)


def _half_second_moments(opt_state: Any) -> bool:
    """True when an optax state keeps second moments (``nu``, ``sum_of_squares``) in float16."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        names = {getattr(k, "name", None) for k in path}
        if names & _SECOND_MOMENTS and getattr(leaf, "dtype", None) == jnp.float16:
            return True
    return False


def _injected_eps(opt_state: Any) -> float | None:
    """The smallest ``eps`` of the ``optax.inject_hyperparams`` states in ``opt_state``, or
    None when there is none (optax closes over it otherwise) or it is not numeric."""
    found = []
    for state in jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(getattr(x, "hyperparams", None), dict)
    ):
        hyper = getattr(state, "hyperparams", None)
        if isinstance(hyper, dict) and "eps" in hyper:
            try:
                found.append(float(np.min(np.asarray(hyper["eps"], dtype=np.float64))))
            except (TypeError, ValueError):
                return None
    return min(found) if found else None


def _contains_loss_scaling(state: Any) -> bool:
    return any(
        isinstance(x, LossScaleOptState)
        for x in jax.tree_util.tree_leaves(
            state, is_leaf=lambda x: isinstance(x, LossScaleOptState)
        )
    )


def _learning_rate(opt_state: Any) -> Any:
    """The learning rate an optax state exposes (``optax.inject_hyperparams``), else None."""
    found = jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams"))
    for leaf in found:
        hp = getattr(leaf, "hyperparams", None)
        if isinstance(hp, dict) and "learning_rate" in hp:
            return hp["learning_rate"]
    return None


class UpdateOps(LossScaleOps):
    """:mod:`unimp.rounding`'s array namespace over ``jnp`` arrays (traces under ``jit``): the
    loss-scale rule's namespace (``where``, ``isfinite``, ``f32``, ``i32``) plus bit patterns
    by ``lax.bitcast_convert_type`` and int32 arithmetic wrapping as NumPy's."""

    @staticmethod
    def to_dtype(x: Any, dtype: str) -> jax.Array:
        return jnp.asarray(x).astype(jnp.dtype(dtype))

    @staticmethod
    def bits(x: Any) -> jax.Array:
        return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)

    @staticmethod
    def from_bits(b: Any) -> jax.Array:
        return jax.lax.bitcast_convert_type(b, jnp.float32)

    @staticmethod
    def iota(shape: tuple[int, ...]) -> jax.Array:
        return jnp.arange(int(np.prod(shape, dtype=np.int64)), dtype=jnp.int32).reshape(shape)

    xor = staticmethod(jnp.bitwise_xor)
    and_ = staticmethod(jnp.bitwise_and)

    @staticmethod
    def shr(x: Any, k: int) -> jax.Array:
        return jax.lax.shift_right_logical(x, jnp.int32(k))

    @staticmethod
    def add(a: Any, b: Any) -> jax.Array:
        return a + b

    @staticmethod
    def mul(a: Any, b: Any) -> jax.Array:
        return a * b  # int32 wraps modulo 2**32


class HalfUpdateState(NamedTuple):
    """State of :func:`half_update`: the inner optimizer's state, the Kahan compensation
    buffers (a pytree like the params: the half leaves' buffers in their dtype, an empty array
    for every other leaf and for a mode without them) and ``count``, the applied updates so far
    (int32; the ``step`` of stochastic rounding)."""

    inner_state: Any
    compensation: Any
    count: Any


def half_update(
    inner: optax.GradientTransformation, update: str = "kahan", *, seed: int = 0
) -> optax.GradientTransformationExtraArgs:
    """An optax optimizer whose updates to half-precision parameters are Kahan-compensated or
    stochastically rounded (:mod:`unimp.rounding`; pure bfloat16 training that learns).

    The inner optimizer runs in float32 (parameters, gradients and its half state leaves seen
    as float32; its state stored back in the dtypes it keeps it, so moments of bfloat16
    parameters stay bfloat16), and its float32 result is applied to each half parameter by the
    rule :func:`unimp.rounding.update_half`, the same in torch and TensorFlow: with
    ``"stochastic"``, the random bits of parameter ``i`` (its position in
    ``jax.tree_util.tree_leaves(params)``) at applied update ``count`` are
    ``random_bits(seed, count, i)``, so one seed gives the same parameters in every framework
    whose parameter order is the same. Float32 leaves take the inner optimizer's updates
    unchanged.

    The updates returned are ``new - param`` in float32, so ``optax.apply_updates(params,
    updates)`` (float32 sum, cast to the parameter's dtype) writes the rule's value; it is
    exact unless an update takes a weight below about 2**-16 of its magnitude, where the
    float32 sum can differ from the rule by one unit in the last place of the new, tiny, value.
    Under :func:`loss_scaling` or unimp's train step a skipped step keeps this state (the
    compensation and the count) bitwise as it was. No host sync; traces once.

    Args:
        inner: an optax ``GradientTransformation``.
        update: ``"kahan"``, ``"stochastic"`` (bfloat16 parameters) or ``"nearest"`` (rounded
            to nearest from the float32 result: the inner optimizer computed in float32).
        seed: the stochastic-rounding seed, an integer (its low 32 bits are used).

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`HalfUpdateState`;
        ``update`` needs ``params``.

    Raises:
        TypeError: ``inner`` is not an optax optimizer, or ``seed`` is not an integer.
        ValueError: an unknown ``update``; ``update(...)`` without ``params``; stochastic
            rounding of float16 parameters.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> opt = half_update(optax.sgd(1.0), "kahan")
        >>> p = jnp.ones(1, jnp.bfloat16)
        >>> state = opt.init(p)
        >>> for _ in range(1000):
        ...     u, state = opt.update(jnp.full(1, 1e-3, jnp.bfloat16), state, p)
        ...     p = optax.apply_updates(p, u)
        >>> abs(float(p[0])) < 1e-2
        True
    """
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            f"half_update needs an optax GradientTransformation (e.g. optax.adam(1e-3)), got {type(inner).__name__}."
        )
    mode = check_update_mode(update)
    seed = check_seed(seed, "half_update: seed")
    inner = _float32_update(inner)  # injected hyperparameters held in float32
    ops = UpdateOps()

    def buffers(params: Any) -> Any:
        def one(p: Any) -> Any:
            if mode == "stochastic":
                check_update_mode(mode, str(jnp.dtype(p.dtype)) if _is_half(p) else None)
            if mode == "kahan" and _is_half(p):
                return jnp.zeros_like(p)
            return jnp.zeros((0,), getattr(p, "dtype", jnp.float32))

        return jax.tree_util.tree_map(one, params)

    def init_fn(params: Any) -> HalfUpdateState:
        return HalfUpdateState(inner.init(params), buffers(params), jnp.zeros((), jnp.int32))

    def update_fn(updates: Any, state: HalfUpdateState, params: Any = None, **extra_args: Any) -> Any:
        if params is None:
            raise ValueError(
                "half_update applies its rule to the parameters: call update(grads, state, params)."
            )
        wide = _widen(params)
        new_updates, new_inner = inner.update(_widen(updates), _widen(state.inner_state), wide, **extra_args)
        new_inner = jax.tree_util.tree_map(
            lambda new, old: new.astype(old.dtype) if hasattr(old, "dtype") and hasattr(new, "astype") else new,
            new_inner,
            state.inner_state,
        )
        leaves, treedef = jax.tree_util.tree_flatten(params)
        u_leaves = treedef.flatten_up_to(new_updates)
        c_leaves = treedef.flatten_up_to(state.compensation)
        out_u, out_c = [], []
        for i, (p, u, c) in enumerate(zip(leaves, u_leaves, c_leaves, strict=True)):
            if not _is_half(p) or u is None:
                out_u.append(u)
                out_c.append(c)
                continue
            p32 = p.astype(jnp.float32)
            target = p32 + u.astype(jnp.float32)  # what optax.apply_updates would write in float32
            new, comp = update_half(
                ops, mode, p, target, c if mode == "kahan" else None,
                seed=int(seed), step=state.count, index=i,
            )
            out_u.append(new.astype(jnp.float32) - p32)
            out_c.append(comp if comp is not None else c)
        return (
            jax.tree_util.tree_unflatten(treedef, out_u),
            HalfUpdateState(new_inner, jax.tree_util.tree_unflatten(treedef, out_c), state.count + 1),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _half_update_states(opt_state: Any) -> list[HalfUpdateState]:
    """Every :class:`HalfUpdateState` in ``opt_state``, nested ones (a wrapper of a wrapper)
    included."""
    found = [
        x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, HalfUpdateState))
        if isinstance(x, HalfUpdateState)
    ]
    return [y for x in found for y in (x, *_half_update_states(x.inner_state))]


def _half_update_state(opt_state: Any) -> HalfUpdateState:
    found = _half_update_states(opt_state)
    if len(found) != 1:
        raise ValueError(
            f"expected one half_update(...) state in the optimizer state, found {len(found)}; wrap "
            "the optimizer once with unimp.backends.jax.half_update (mp.train_step does for a "
            "policy with update=)."
        )
    return found[0]


def _mode_of_state(update: Any, leaves: list[Any], comps: list[Any]) -> str:
    """``update`` checked against what the state holds: Kahan keeps a buffer of each half
    parameter's shape, the other modes an empty one."""
    mode = check_update_mode(update)
    half = [(p, c) for p, c in zip(leaves, comps, strict=True) if _is_half(p)]
    kahan = bool(half) and all(tuple(c.shape) == tuple(p.shape) for p, c in half)
    if half and kahan != (mode == "kahan"):
        held = "kahan" if kahan else "stochastic or nearest"
        raise ValueError(
            f"update={mode!r}, but the optimizer state is of half_update(..., {held!r}): give the "
            "mode the transformation was built with."
        )
    return mode


def export_update_state(opt_state: Any, params: Any, update: str, seed: int = 0) -> dict[str, Any]:
    """The update-rule state inside ``opt_state`` (:func:`half_update`'s, also nested in
    :func:`loss_scaling` or a chain) in the portable format of
    :func:`unimp.rounding.check_update_state` (parameter order of
    ``jax.tree_util.tree_leaves(params)``), for :func:`import_update_state` in any backend.
    optax keeps the mode and the seed in the transformation, not the state: give them.

    Raises:
        ValueError: no or several :class:`HalfUpdateState`, an unknown ``update``.
    """
    st = _half_update_state(opt_state)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    comps = treedef.flatten_up_to(st.compensation)
    mode = _mode_of_state(update, leaves, comps)
    out = []
    for p, c in zip(leaves, comps, strict=True):
        if not _is_half(p):
            out.append(None)
            continue
        out.append({
            "step": int(st.count) if mode == "stochastic" else 0,
            "compensation": np.asarray(c, np.float32) if mode == "kahan" else None,
        })
    return {"update": mode, "seed": int(seed), "params": out}


def import_update_state(opt_state: Any, params: Any, state: dict[str, Any], update: str) -> Any:
    """``opt_state`` with its :func:`half_update` state (compensation buffers, the count) taken
    from :func:`export_update_state`'s dict of any backend; returns the new optimizer state
    (build the transformation with the state's ``"seed"``). optax counts the applied updates once
    for the whole tree: every half parameter's ``step`` must be the same.

    Raises:
        ValueError: another mode or number of parameters, a buffer whose shape is not its
            parameter's, or steps that differ (a torch parameter left without a gradient).
    """
    st = _half_update_state(opt_state)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    comps = treedef.flatten_up_to(st.compensation)
    mode = _mode_of_state(update, leaves, comps)
    checked = check_update_state(state, mode, len(leaves))
    for i, (p, e) in enumerate(zip(leaves, checked["params"], strict=True)):
        if e is not None and e["compensation"] is not None and not _is_half(p):
            raise ValueError(
                f"params[{i}]: a compensation buffer for a {jnp.dtype(p.dtype)} parameter: the rule "
                "keeps buffers for half parameters only; export and import the same model."
            )
    steps = {e["step"] for p, e in zip(leaves, checked["params"], strict=True) if e is not None and _is_half(p)}
    if mode == "stochastic" and len(steps) > 1:
        raise ValueError(
            f"the state's parameters have taken different numbers of updates {sorted(steps)}; "
            "optax's half_update counts them once for the whole tree."
        )
    new = []
    for i, (p, c, e) in enumerate(zip(leaves, comps, checked["params"], strict=True)):
        comp = None if e is None else e["compensation"]
        if mode != "kahan" or not _is_half(p):
            new.append(c)
            continue
        if comp is not None and tuple(comp.shape) != tuple(p.shape):
            raise ValueError(
                f"params[{i}]: a compensation buffer of shape {tuple(comp.shape)} for a parameter "
                f"of shape {tuple(p.shape)}: export and import the same model (a transposed "
                "layout needs the buffer transposed too)."
            )
        new.append(jnp.zeros_like(c) if comp is None else jnp.asarray(comp).astype(c.dtype))
    count = jnp.asarray(steps.pop() if mode == "stochastic" and steps else st.count, jnp.int32)
    replaced = st._replace(compensation=jax.tree_util.tree_unflatten(treedef, new), count=count)
    return jax.tree_util.tree_map(
        lambda x: replaced if x is st else x, opt_state, is_leaf=lambda x: x is st
    )
