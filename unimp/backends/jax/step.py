"""JAX train step: :class:`TrainStep`, one jitted function (scaled ``value_and_grad``, unscale,
clipping, gradient accumulation, the guarded update), optionally over a data-parallel mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from unimp.backends._base import MixedPrecisionBase
from unimp.backends.jax.devices import _commit_like, _device_leaf
from unimp.backends.jax.fp8 import (
    fp8_update,
    fp8_window_carry,
    fp8_window_result,
    fp8_window_states,
)
from unimp.backends.jax.optimizer import (
    _contains_loss_scaling,
    _count_skipped,
    _float32_update,
    _half_second_moments,
    _half_update_states,
    _injected_eps,
    _is_half,
    _learning_rate,
    half_update,
)
from unimp.backends.jax.overflow import (
    _clip,
    _global_norm,
    _keep_unless,
    _own_gradients,
    _reduce_in,
    _tracks_variance,
    all_finite,
    sync_loss_scale,
)
from unimp.backends.jax.overrides import apply_overrides, check_half_leaves
from unimp.backends.jax.precision import matmul_precision
from unimp.backends.jax.scaling import LossScale, _changed_fields, _rejoin
from unimp.backends.jax.stats import (
    _collecting,
    _grad_flags,
    _gradient_stats,
    _merge_stacked,
    _pending,
)
from unimp.loss_scale import FloorWatch
from unimp.step import StepResult, floor_hits, warn_half_optimizer_state
from unimp.steprecorder import LoggedStep
from unimp.trainstep import StepOptions, run_step


class TrainStep(LoggedStep):
    """One jitted step ``step(batch) -> StepResult`` with params, optimizer state and loss scale.

    Each call runs one compiled function (the second call with the same shapes does not
    recompile; :attr:`traces` counts tracings) that runs :func:`unimp.trainstep.run_step` over
    this module's :class:`StepOps` while it traces: the algorithm of every backend (the loss
    scaled, gradients taken, unscaled once, checked, optionally clipped, and applied). Rules,
    as in every unimp backend:

    * clipping acts on the unscaled gradients (``grad_norm`` is the global L2 norm before
      clipping; clipping follows optax.clip_by_global_norm: ``g * max_norm / norm`` when the
      norm exceeds ``max_norm``);
    * a non-finite gradient skips the step and backs the scale off; a non-finite loss
      (forward overflow) skips the step without changing the scale; every loss-scale kind
      skips and counts non-finite steps;
    * a skipped step leaves params, the whole optimizer state and the model state the forward
      pass changes (``model_state=``: flax ``batch_stats``, nnx ``BatchStat``) bitwise
      unchanged;
    * with ``grad_accum_steps=k`` each call takes a list of ``k`` micro-batches of one
      structure and shapes, run with ``lax.scan`` over them stacked inside the jitted step
      (the window's rule: :class:`unimp.trainstep.StepOptions`).

    Args:
        mp: the :class:`MixedPrecision`.
        loss_fn: ``loss_fn(params, batch)`` returning a scalar loss.
        optimizer: an optax optimizer (not wrapped with :func:`loss_scaling`: the step scales
            the loss itself).
        params: the initial params; floating leaves are cast to the param dtype.
        options: the step's options (:class:`unimp.trainstep.StepOptions`, validated there),
            as JAX reads them: ``schedule_counts="applied"`` leaves the optax state, its
            ``count`` leaves included, unchanged on a skipped step, ``"attempted"`` grows
            every integer ``count`` leaf by one; with ``stats_every`` the statistics hold each
            floating gradient leaf (named by its params path joined with ``/``: ``"w1"``,
            ``"Dense_0/kernel"``), unscaled and before clipping, at the step's loss scale;
            and, at scale 1, the values ``loss_fn`` names with :func:`observe` and the
            outputs of every flax linen module without submodules (named by its path), every
            value of a name (every call, every micro-batch) taken together. Those steps run a
            second jitted function (compiled on its first call; :attr:`traces` counts it too)
            that returns the statistics with the results; the other steps run the plain one,
            whose program is the same as without the option. Reading ``result.stats`` is the
            only sync. ``stats_every`` is not supported with ``axis_name`` (a ``ValueError``).
        axis_name: data parallelism under ``jax.shard_map``: the mesh axis the batch is split
            over. The step then runs per replica: the loss is ``lax.pmean`` of the local
            losses (so JAX's transpose all-reduces the gradients of replicated params, and
            leaves sharded params' gradients local), the finite flags are reduced over the
            axis (a non-finite gradient on any replica skips the step on all), the global
            norm sums the squares of sharded gradients over the axis, and the loss-scale
            state comes from replica 0 (:func:`sync_loss_scale`: replicas that differ are
            re-synchronized with a :class:`ReplicaDesyncWarning`). Under shard_map's default
            ``check_vma=True`` JAX tracks which values vary over the axis; where it does not
            (``pmap``, ``vmap(axis_name=...)``, ``shard_map(check_vma=False)``) every param is
            taken as replicated and the step averages the gradients with ``lax.pmean``.
        mesh: with ``axis_name``, a ``jax.sharding.Mesh``: calling the step runs
            ``jit(shard_map(...))`` with params, optimizer and loss-scale state replicated and
            the batch split along its first dimension over ``axis_name``. Without ``mesh``,
            call :attr:`replica_step` inside your own ``shard_map`` (sharded params, other
            specs) and do not call the step object itself.
        model_state: state the forward pass reads and updates, carried through the step (flax
            linen's ``variables["batch_stats"]``, or the ``nnx.BatchStat`` part of
            ``nnx.split(model, nnx.Param, nnx.BatchStat)``). ``loss_fn`` is then
            ``loss_fn(params, model_state, batch) -> (loss, new_model_state)`` (e.g. with
            ``model.apply({"params": p, "batch_stats": s}, x, mutable=["batch_stats"])``); the
            new state is kept only when the step is applied, and is read from
            :attr:`model_state`. It is replicated under ``mesh`` (so ``loss_fn`` must return
            it reduced over ``axis_name``: ``BatchNorm(axis_name=...)`` in flax; a per-replica
            state is a ``ValueError`` naming this) and donated with ``donate``.
            With nnx, rebuild the module inside ``loss_fn`` with ``nnx.merge(graphdef, p, s,
            copy=True)`` (BatchNorm mutates its statistics inside the gradient trace) and
            return ``nnx.split(model, nnx.Param, nnx.BatchStat)[2]``.
            ``None`` (default): ``loss_fn(params, batch)`` returns the loss alone.
        donate: donate the params, optimizer-state and loss-scale buffers to each call
            (``jax.jit(..., donate_argnums=(0, 1, 2))``), so XLA updates them in place instead
            of holding a second copy in device memory: what flax/optax training loops do on
            GPU and TPU (there it saves one copy of params and optimizer state). Arrays read
            from :attr:`params` / :attr:`opt_state` / :attr:`loss_scale` before a call are
            deleted by that call: copy what you keep (``jax.tree.map(jnp.copy,
            step.params)``); and do not feed them to :attr:`jitted` yourself while still
            stepping through this object (it would hold deleted buffers). The ``params``
            given here are copied once, so the caller's arrays are never donated. Off by
            default; on a CPU it made the benchmark MLP about 9 % slower.

    Raises:
        TypeError: ``loss_fn`` not callable or ``optimizer`` not an optax transformation.
        ValueError: an optimizer already wrapped with :func:`loss_scaling`, ``mesh`` without
            ``axis_name``, an ``axis_name`` not in ``mesh``, or ``stats_every`` with
            ``axis_name``.

    Multi-host: call ``jax.distributed.initialize()`` in every process first, build the mesh
    over ``jax.devices()`` (all hosts), and feed each process's part of the global batch
    (``jax.make_array_from_process_local_data``); the step is the same program on every
    host.
    """

    def __init__(
        self,
        mp: MixedPrecisionBase,
        loss_fn: Callable[[Any, Any], Any],
        optimizer: optax.GradientTransformation,
        params: Any,
        *,
        options: StepOptions | None = None,
        axis_name: Any = None,
        mesh: Any = None,
        donate: bool = False,
        model_state: Any = None,
    ) -> None:
        options = StepOptions() if options is None else options
        stats_every = options.stats_every
        if stats_every is not None and axis_name is not None:
            raise ValueError(
                "stats_every is not supported with axis_name= (each replica sees its own "
                "activations and gradient shards): drop stats_every=, or take the statistics "
                "you need with unimp.backends.jax.tensor_stats(x, scale) inside your own "
                "replica step (step.replica_step under jax.shard_map)."
            )
        if not isinstance(donate, bool):
            raise TypeError(f"donate must be True or False, got {donate!r}.")
        if mesh is not None:
            if axis_name is None:
                raise ValueError(
                    "mesh= needs axis_name=: the mesh axis the batch is split over, e.g. "
                    f"axis_name={mesh.axis_names[0]!r}."
                )
            if axis_name not in mesh.axis_names:
                raise ValueError(
                    f"axis_name={axis_name!r} is not an axis of the mesh {tuple(mesh.axis_names)}."
                )
        if not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be callable as loss_fn(params, batch), got {type(loss_fn).__name__}."
            )
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise TypeError(
                f"optimizer must be an optax GradientTransformation (e.g. optax.adam(1e-3)), got {type(optimizer).__name__}."
            )
        if mp.policy.update != "nearest":  # Kahan / stochastic updates of half parameters
            optimizer = half_update(optimizer, mp.policy.update, seed=options.rounding_seed)
        else:
            optimizer = _float32_update(optimizer)  # its scalars in float32 for half parameters
        # Host leaves (NumPy arrays, Python floats) become device arrays of a fixed dtype now, so
        # the first call's signature equals every later one's and nothing recompiles.
        if mp.device is not None and mesh is not None:
            raise ValueError(
                "device= and mesh= both place the step: bind the recipe without a device "
                "(the mesh says where the replicas run)."
            )
        # cast per path; an unmatched override pattern warns, a conflict fails, here
        params = jax.tree_util.tree_map(_device_leaf, apply_overrides(mp, params))
        check_half_leaves(params, mp.loss_scale)
        if mp.device is not None:  # committed there: the rest of the state follows it
            params = jax.device_put(params, mp.device)
        if donate:  # the first call must not delete the caller's own arrays
            params = jax.tree_util.tree_map(jnp.copy, params)
        opt_state = jax.tree_util.tree_map(_device_leaf, optimizer.init(params))
        if donate:  # a state leaf that aliases a param (or another leaf) cannot be donated twice
            opt_state = jax.tree_util.tree_map(jnp.copy, opt_state)
        if len(_half_update_states(opt_state)) > (mp.policy.update != "nearest"):
            raise ValueError(
                "train_step applies the policy's update rule itself: pass the plain optax "
                "optimizer, not one wrapped with half_update() (the rule would run twice)."
            )
        if _contains_loss_scaling(opt_state):
            raise ValueError(
                "train_step scales the loss itself: pass the plain optax optimizer, not one wrapped "
                "with loss_scaling() or mp.prepare()."
            )
        if _half_second_moments(opt_state):
            # optax keeps its state in the params' dtype; its eps is not readable from outside
            warn_half_optimizer_state("the optax optimizer", _injected_eps(opt_state))
        self._mp = mp
        self._loss_fn = loss_fn
        self._optimizer = optimizer
        self._options = options
        self._k = options.grad_accum_steps
        self._stateful = model_state is not None
        if self._stateful:
            model_state = jax.tree_util.tree_map(_device_leaf, model_state)
            if mp.device is not None:
                model_state = jax.device_put(model_state, mp.device)
            if donate:
                model_state = jax.tree_util.tree_map(jnp.copy, model_state)
        # one compilation: committed params (jax.device_put) commit the rest of the state too
        params, opt_state, loss_scale, model_state = _commit_like(
            (params, opt_state, mp.init_loss_scale(), model_state), params
        )
        self._model_state = model_state
        self._params = params
        self._opt_state = opt_state
        self._loss_scale = loss_scale
        self._traces = 0
        self._axis = axis_name
        self._mesh = mesh
        self._donate = donate
        self._calls = 0
        self._floor_watch = FloorWatch()  # each floor hit acted on at one result read
        self._stats_order: tuple[list[str], list[str]] = ([], [])
        self._flag_names: list[str] = []  # the gradients' names, set while a logged step traces
        donated = ((0, 1, 2, 4) if self._stateful else (0, 1, 2)) if donate else ()
        self._stats_jitted = None if stats_every is None else jax.jit(self._stats_step, donate_argnums=donated)
        if mesh is None:
            self._jitted = jax.jit(self._step, donate_argnums=donated)
            # what __call__ runs: the same program less the outputs it holds already (_traced)
            self._call_jitted = jax.jit(partial(self._traced, lean=True), donate_argnums=donated)
        else:
            P = jax.sharding.PartitionSpec
            replicated = jax.sharding.NamedSharding(mesh, P())
            self._batch_sharding = jax.sharding.NamedSharding(mesh, P(axis_name))
            self._params, self._opt_state, self._loss_scale, self._model_state = jax.device_put(
                (self._params, self._opt_state, self._loss_scale, self._model_state), replicated
            )
            extra = (P(),) if self._stateful else ()
            self._jitted = jax.jit(
                jax.shard_map(
                    self._step,
                    mesh=mesh,
                    in_specs=(P(), P(), P(), P(axis_name), *extra),
                    out_specs=P(),
                ),
                donate_argnums=donated,
            )
            self._call_jitted = self._jitted

    # -- the pure, jitted step ----------------------------------------------------------------

    def _step(
        self, params: Any, opt_state: Any, ls: LossScale, batch: Any, model_state: Any = None
    ) -> Any:
        return self._traced(params, opt_state, ls, batch, model_state, False)

    def _stats_step(
        self, params: Any, opt_state: Any, ls: LossScale, batch: Any, model_state: Any = None
    ) -> Any:
        """:meth:`_step` that also returns the statistics, as ``raw["stats"]``."""
        return self._traced(params, opt_state, ls, batch, model_state, True, lean=True)

    def _traced(
        self,
        params: Any,
        opt_state: Any,
        ls: LossScale,
        batch: Any,
        model_state: Any = None,
        with_stats: bool = False,
        lean: bool = False,
    ) -> Any:
        self._traces += 1  # runs only while tracing: counts compilations
        ops = StepOps(self, params, opt_state, ls, model_state, with_stats)
        raw = run_step(ops, [batch] if self._k == 1 else list(batch), self._options)
        new_ls = ops.ls
        if lean:  # no output that duplicates another, nor an input __call__ still holds:
            # each would be a copy (a kernel) per step; __call__ puts them back (_rejoin)
            forward = not self._donate  # a donated input is gone after the call
            if forward:  # donated, the new state's buffers are gone after the next call: the
                # result keeps its own (a StepResult is read after later steps)
                raw.update({k: None for k in ("consecutive_skips", "total_skips", "floor_hits") if k in raw})
                raw["scale"] = None
            new_ls = _changed_fields(new_ls, forward)
        if self._stateful:
            return ops.params, ops.opt_state, new_ls, raw, ops.model_state
        return ops.params, ops.opt_state, new_ls, raw

    # -- the stateful face ----------------------------------------------------------------------

    def _check_batch(self, batch: Any) -> None:
        if self._k == 1:
            return
        batch = self._options.micro_batches(batch)
        first = jax.tree_util.tree_structure(batch[0])
        shapes = [np.shape(x) for x in jax.tree_util.tree_leaves(batch[0])]
        for i, mb in enumerate(batch[1:], 1):
            if jax.tree_util.tree_structure(mb) != first or [np.shape(x) for x in jax.tree_util.tree_leaves(mb)] != shapes:
                raise ValueError(
                    f"micro-batch {i} differs in structure or shapes from micro-batch 0; every "
                    "micro-batch of a window must have the same structure and shapes."
                )

    def __call__(self, batch: Any) -> StepResult:
        """Runs one step on ``batch``; returns its :class:`unimp.StepResult` without syncing.

        With ``mesh``, ``batch`` is the global batch; it is split over the mesh axis along
        its first dimension.

        Raises:
            ValueError: with ``grad_accum_steps=k > 1``, ``batch`` is not a list of ``k``
                micro-batches of one structure and shapes (nothing is changed).
            RuntimeError: built with ``axis_name`` but no ``mesh`` (use :attr:`replica_step`).
        """
        if self._axis is not None and self._mesh is None:
            raise RuntimeError(
                f"this step was built with axis_name={self._axis!r} and no mesh: call "
                "step.replica_step inside your own jax.shard_map, or pass mesh= to train_step."
            )
        self._check_batch(batch)
        if self._mesh is not None:
            batch = jax.device_put(batch, self._batch_sharding)
        elif self._mp.device is not None:
            batch = jax.device_put(batch, self._mp.device)  # a no-op for arrays already there
        elif self._traces == 0:  # first call: a committed batch commits the state (one compilation)
            self._params, self._opt_state, self._loss_scale, self._model_state = _commit_like(
                (self._params, self._opt_state, self._loss_scale, self._model_state), batch
            )
        args = (self._params, self._opt_state, self._loss_scale, batch)
        with_stats = self._options.stats_step(self._calls)
        jitted = self._stats_jitted if with_stats else self._call_jitted
        lean = jitted is not self._jitted  # every program but the full step returns the lean outputs
        before = self._loss_scale
        # traced under the policy's matmul precision: the config is part of jit's cache key
        with matmul_precision(self._mp.policy.matmul_precision):
            if self._stateful:
                try:
                    params, opt_state, ls, raw, self._model_state = jitted(*args, self._model_state)
                except ValueError as e:
                    if self._mesh is None or "out_specs" not in str(e):
                        raise
                    raise ValueError(
                        f"with mesh=, the new model_state must be the same on every replica; "
                        f"reduce it over axis_name={self._axis!r} in loss_fn (flax: BatchNorm("
                        f"axis_name={self._axis!r}), or lax.pmean(new_state, {self._axis!r}))."
                    ) from e
            else:
                params, opt_state, ls, raw = jitted(*args)
        if lean:  # the lean program's outputs: back to the full ones
            ls = _rejoin(before, ls)
            raw.update({k: getattr(ls.state, k) for k in ("consecutive_skips", "total_skips", "floor_hits") if k in raw and raw[k] is None})
            raw["scale"] = before.loss_scale if raw["scale"] is None else raw["scale"]
        self._params, self._opt_state, self._loss_scale = params, opt_state, ls
        stats = None
        if with_stats:
            stats = _pending(self._calls, raw.pop("stats"), self._stats_order, self._options.stats_formats)
        flags = raw.pop("grad_flags", None)
        if "floor_hits" in raw:  # the step's index, named by a floor_action message
            raw["floor_step"] = self._calls
        self._calls += 1
        result = StepResult(raw, to_host=jax.device_get, config=ls.config, stats=stats, watch=self._floor_watch)
        if self._recorder is not None:
            self._recorder.add(
                self._calls - 1, result, lr=_learning_rate(opt_state), batch_finite=all_finite(batch),
                grad_flags=None if flags is None else (self._flag_names, flags),
            )  # fmt: skip
        return result

    @property
    def params(self) -> Any:
        """The current params."""
        return self._params

    @property
    def model_state(self) -> Any:
        """The current model state given as ``model_state=`` (flax ``batch_stats``, an nnx
        ``nnx.BatchStat`` state), or ``None``."""
        return self._model_state

    @property
    def opt_state(self) -> Any:
        """The current optimizer state."""
        return self._opt_state

    @property
    def loss_scale(self) -> LossScale:
        """The current :class:`~unimp.backends.jax.LossScale`."""
        return self._loss_scale

    @property
    def calls(self) -> int:
        """The calls that returned a result (a Python int; decides the statistics steps)."""
        return self._calls

    @property
    def stats_every(self) -> int | None:
        """``None`` or ``k``: statistics on calls 0, k, 2k, ..."""
        return self._options.stats_every

    @property
    def traces(self) -> int:
        """How many times the step function has been traced (each trace is a compilation; with
        ``stats_every``, the statistics step's tracing counts too: 2 after both ran)."""
        return self._traces

    @property
    def replica_step(self) -> Callable[..., Any]:
        """The pure, un-jitted step ``(params, opt_state, loss_scale, batch) -> (params,
        opt_state, loss_scale, raw_results)`` (with ``model_state=``, it takes and returns the
        model state last); with ``axis_name``, the per-replica function to
        run under your own ``jax.shard_map`` (any param sharding). Build the
        :class:`unimp.StepResult` from ``raw_results`` with
        ``StepResult(raw, jax.device_get, loss_scale.config)``."""
        return self._step

    @property
    def jitted(self) -> Callable[..., Any]:
        """The pure jitted function ``(params, opt_state, loss_scale, batch) -> (params,
        opt_state, loss_scale, raw_results)`` (with ``model_state=``, it takes and returns the
        model state last), for your own loop (``donate=True``: it deletes its first three
        arguments). Compiled on its first call: ``step(batch)`` runs a lean twin of it."""
        return self._jitted

    def state_dict(self) -> dict[str, Any]:
        """The portable loss-scale state (:func:`unimp.loss_scale.state_dict`). Params and
        optimizer state are pytrees: save them with your checkpointer (e.g. orbax)."""
        return self._loss_scale.state_dict()

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Resumes the loss scale from a portable state dict saved by any backend; the saved
        config replaces the recipe's.

        Raises:
            ValueError: a bad or foreign state dict; nothing is changed.
        """
        self._loss_scale = _commit_like(
            LossScale.from_state_dict(d, self._loss_scale.config), self._params
        )


class StepOps:
    """The phases of one step (:class:`unimp.trainstep.StepPrimitives`) for a JAX
    :class:`TrainStep`, run while the step traces: functional, so each phase leaves the new
    value on this object (``params``, ``opt_state``, ``ls``, ``model_state``), which the jitted
    step returns."""

    def __init__(
        self, step: TrainStep, params: Any, opt_state: Any, ls: LossScale, model_state: Any,
        with_stats: bool,
    ) -> None:  # fmt: skip
        self.step = step
        self.params, self.opt_state, self.ls, self.model_state = params, opt_state, ls, model_state
        self.with_stats = with_stats
        self.axis = step._axis
        self.activations: Any = {}
        self.call_order: list[str] = []  # the activations in the order the forward pass saw them

    def begin(self) -> Any:
        if self.axis is not None:
            self.ls = sync_loss_scale(self.ls, self.axis)
        return self.ls.loss_scale

    def save_forward_state(self) -> Any:
        return self.model_state

    def abort(self, saved: Any) -> None:
        pass  # functional: a trace that raised returns nothing

    def _forward(self, p: Any, mb: Any, st: Any) -> Any:
        step = self.step
        if step._stateful:
            out = step._loss_fn(p, st, mb)
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    "with model_state=, loss_fn(params, model_state, batch) must return "
                    f"(loss, new_model_state), got {type(out).__name__}."
                )
            loss, st = out
            loss = jnp.asarray(loss)
        else:
            loss = jnp.asarray(step._loss_fn(p, mb))
        if not jnp.issubdtype(loss.dtype, jnp.floating):
            raise TypeError(f"loss_fn must return a floating loss, got {loss.dtype}.")
        if loss.shape != ():
            raise ValueError(f"loss_fn must return a scalar loss, got shape {loss.shape}.")
        loss = loss.astype(jnp.promote_types(loss.dtype, jnp.float32))
        if self.axis is not None:
            loss = lax.pmean(loss, self.axis)  # the global mean loss; its grad is all-reduced
        return self.ls.scale(loss), (loss, st)

    def _scaled_loss(self, p: Any, mb: Any, st: Any) -> Any:
        if self.with_stats:  # the observed activations' statistics come out through the aux
            with _collecting(self.step._options.stats_formats) as collector:
                scaled, (loss, st) = self._forward(p, mb, st)
            self.call_order[:] = list(collector.entries)
            return scaled, (loss, st, collector.entries)
        return self._forward(p, mb, st)

    def gradients(self, micro: list[Any], scale: Any) -> tuple[Any, Any, Any]:
        axis, params, k = self.axis, self.params, len(micro)
        grad_fn = jax.grad(self._scaled_loss, has_aux=True)
        # reduce_dtype under variance tracking: the replicated params are made varying, so each
        # replica's gradient stays its own, and the step all-reduces it in reduce_dtype below
        # (instead of the transpose's implicit all-reduce in the gradient's dtype)
        reduce = self.step._mp.policy.reduce_dtype if axis is not None else None
        tracked = axis is not None and _tracks_variance(axis)
        explicit, gparams = _own_gradients(params, axis) if reduce and tracked else (None, params)
        if k == 1:
            scaled_grads, (loss, new_model_state, *observed) = grad_fn(gparams, micro[0], self.model_state)
            new_model_state = fp8_update(self.model_state, new_model_state)
            loss_finite = jnp.isfinite(loss)
            if self.with_stats:
                self.activations = observed[0]
        else:
            # k micro-batches of one structure: stacked inside the jit, run with lax.scan
            stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *micro)
            # float32 (or wider params' dtype), or the policy's accum_dtype: rounded to it at
            # every addition; the mean is taken back in the default accumulator's dtype
            accum = self.step._mp.policy.accum_dtype
            zeros = jax.tree_util.tree_map(
                lambda p: jnp.zeros(
                    jnp.shape(p), accum or jnp.promote_types(jnp.result_type(p), jnp.float32)
                ),
                params,
            )

            start = self.model_state

            def body(carry: Any, mb: Any) -> Any:
                acc, st = carry  # the model state threads through the micro-batches in order,
                g, (micro_loss, new, *observed) = grad_fn(gparams, mb, st)
                # but float8 states do not: each micro-batch quantizes with the window's start
                # and the window takes one step (unimp.fp8.window_merge)
                return (
                    jax.tree_util.tree_map(lambda a, x: a + x.astype(a.dtype), acc, g),
                    fp8_window_carry(start, new),
                ), (micro_loss, fp8_window_states(new), *observed)

            (summed, carried), (losses, fp8_new, *observed) = lax.scan(
                body, (zeros, start), stacked
            )
            new_model_state = fp8_window_result(start, carried, fp8_new)
            if self.with_stats:  # one entry per micro-batch: taken together
                self.activations = {n: _merge_stacked(e) for n, e in observed[0].items()}
            scaled_grads = jax.tree_util.tree_map(
                lambda a, p: a.astype(jnp.promote_types(jnp.result_type(p), jnp.float32)) / k,
                summed, params,
            )  # fmt: skip
            loss = jnp.mean(losses)
            loss_finite = jnp.all(jnp.isfinite(losses))
        self.new_model_state = new_model_state
        if explicit is not None or (axis is not None and not tracked):
            # pmap, vmap, shard_map(check_vma=False): JAX does not all-reduce the gradients of
            # replicated params in the transpose, so average them here (every param is taken
            # as replicated: the pmap convention); with reduce_dtype, in it
            scaled_grads = _reduce_in(scaled_grads, axis, reduce, explicit)
        return scaled_grads, loss, loss_finite

    def unscale(self, grads: Any, scale: Any) -> Any:
        return self.ls.unscale(grads)

    def observe(self, grads: Any, scale: Any) -> dict[str, Any]:
        step = self.step
        if self.with_stats:  # unscaled, before clipping, at the step's scale
            gradients = _gradient_stats(grads, scale, step._options.stats_formats)
            step._stats_order = (list(gradients), self.call_order)
            return {"stats": {"gradients": gradients, "activations": self.activations, "scale": scale}}
        if step._recorder is not None and self.axis is None:
            # logged (read while tracing): which gradient went non-finite first
            step._flag_names, flags = _grad_flags(grads)
            return {"grad_flags": flags}
        return {}

    def finite(self, grads: Any, scale: Any) -> tuple[Any, Any]:
        return grads, all_finite(grads, self.axis)

    def global_norm(self, grads: Any, grads_finite: Any) -> tuple[Any, Any]:
        norm, self.rescale = _global_norm(grads, self.axis)
        return norm, grads_finite & jnp.isfinite(norm)

    def clip(self, grads: Any, norm: Any, max_norm: float) -> Any:
        # (g * s) * (max_norm / (norm * s)): the factor stays normal (NORM_RESCALE_ABOVE)
        limit, s = jnp.float32(max_norm), self.rescale
        clip, factor = norm > limit, limit / (norm * s)
        return jax.tree_util.tree_map(lambda g: _clip(g, clip, s, factor), grads)

    def apply(self, grads: Any, grads_finite: Any, loss_finite: Any) -> Any:
        params, opt_state = self.params, self.opt_state
        updates, new_opt_state = self.step._optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        applied = grads_finite & loss_finite
        self.params = _keep_unless(applied, new_params, params)
        self.opt_state = _keep_unless(applied, new_opt_state, opt_state)
        if self.step._options.schedule_counts == "attempted":  # a skipped step still counts
            self.opt_state = _count_skipped(self.opt_state, applied)
        return applied

    def restore_forward_state(self, saved: Any, applied: Any) -> None:
        if self.step._stateful:  # what the forward pass changed is kept only if applied
            self.model_state = _keep_unless(applied, self.new_model_state, saved)

    def params_finite(self) -> Any:
        # decided while tracing: float32 parameters add no op (the params are the same on
        # every replica, so no reduction over the mesh axis)
        half = [x for x in jax.tree_util.tree_leaves(self.params) if _is_half(x)]
        return all_finite(half) if half else None

    def update_scale(self, grads_finite: Any, loss_finite: Any) -> dict[str, Any]:
        self.ls = new = self.ls.adjust(grads_finite, loss_finite)
        return {
            "consecutive_skips": new.state.consecutive_skips,
            "total_skips": new.state.total_skips,
            **floor_hits(new.config, (new.state.floor_hits,)),
        }
