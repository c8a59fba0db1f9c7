"""TensorFlow train step: :class:`TrainStep`, a traced ``tf.function`` (scaled loss under a
GradientTape, unscale, clipping, gradient accumulation, the guarded apply) that also runs under
a ``tf.distribute`` strategy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from unimp.backends.tensorflow.casting import to_dtype
from unimp.backends.tensorflow.devices import _check_placed
from unimp.backends.tensorflow.optimizer import LossScaleOptimizer
from unimp.backends.tensorflow.overflow import all_finite
from unimp.backends.tensorflow.precision import matmul_precision
from unimp.backends.tensorflow.scaling import _extra, _to_host, _traced_fields, _unscale
from unimp.backends.tensorflow.stats import _Collector, _grad_flags, _pending
from unimp.loss_scale import FloorWatch, from_state_dict
from unimp.policy import Policy
from unimp.step import StepResult, check_schedule_counts, floor_hits, micro_batches
from unimp.steprecorder import LoggedStep


def _batch_to_tensors(batch: Any) -> Any:
    """NumPy leaves as tensors (one trace per shape/dtype, not per value)."""
    if tf.is_tensor(batch) or (
        type(batch) in (tuple, list) and all(tf.is_tensor(x) for x in batch)
    ):
        return batch  # the usual batch: nothing to convert (tf.nest costs ~20 us per step)

    def conv(x: Any) -> Any:
        if isinstance(x, (np.ndarray, np.generic)):
            return tf.convert_to_tensor(x)
        return x

    return tf.nest.map_structure(conv, batch)


def _times(g: Any, factor: tf.Tensor) -> Any:
    """g * factor in g's dtype (``None`` and ``tf.IndexedSlices`` handled)."""
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(
            g.values * tf.cast(factor, g.values.dtype), g.indices, g.dense_shape
        )
    return g * tf.cast(factor, g.dtype)


def _all_reduce_in(replica: Any, grads: list[Any], dtype: tf.DType, scale: tf.Tensor) -> list[Any]:
    """The sum over the replicas of each (unscaled) gradient, computed in ``dtype``: cast to
    it, one all-reduce (SUM), cast back to the gradient's dtype. A half ``dtype`` carries the
    SCALED gradient (``g * scale`` on the wire, divided by ``scale`` after), as torch's DDP hook
    and JAX's replica step do, so the loss scale guards the half wire against underflow and an
    overflow of the sum is an inf; float32 or wider sums the unscaled gradients, as Keras's own
    sum. ``None`` stays ``None``; a ``tf.IndexedSlices`` is made dense first."""
    present = [tf.convert_to_tensor(g) for g in grads if g is not None]
    if not present:
        return grads
    half = dtype in (tf.float16, tf.bfloat16)
    wire = [tf.cast(g * tf.cast(scale, g.dtype) if half else g, dtype) for g in present]
    summed = iter(replica.all_reduce("sum", wire))
    out = []
    for g in grads:
        if g is None:
            out.append(None)
            continue
        total = tf.cast(next(summed), g.dtype)
        out.append(total / tf.cast(scale, g.dtype) if half else total)
    return out


@contextlib.contextmanager
def _keras_sum_off(optimizer: Any, active: bool) -> Iterator[None]:
    """While the step traces, Keras's optimizer applies the gradients it is given instead of
    summing them over the replicas first (its ``_all_reduce_sum_gradients``): the step has
    all-reduced them itself, in the policy's ``reduce_dtype``. Restored after the trace, so
    other users of the optimizer (``model.fit``) keep Keras's sum."""
    if not active:
        yield
        return
    optimizer._all_reduce_sum_gradients = list  # an instance attribute hides the method
    try:
        yield
    finally:
        del optimizer._all_reduce_sum_gradients


def _strategy_of(variables: list[Any]) -> Any:
    """The tf.distribute strategy holding ``variables``, or None (plain variables)."""
    value = getattr(variables[0], "value", variables[0])
    if isinstance(value, tf.distribute.DistributedValues):
        return value.distribute_strategy
    return None


def _global_norm(grads: list[Any]) -> tf.Tensor:
    squares = [
        tf.reduce_sum(tf.square(tf.cast(tf.convert_to_tensor(g), tf.float32)))
        for g in grads
        if g is not None
    ]
    if not squares:
        return tf.constant(0.0, tf.float32)
    return tf.sqrt(tf.add_n(squares))


def _forward_state(model: Any) -> list[Any]:
    """The variables a forward pass may change: those the layers created non-trainable
    (BatchNormalization's moving mean and variance, a layer's own counters), without the
    random-seed states of ``SeedGenerator``s (a skipped step still draws new dropout masks, as
    in torch and JAX) and without frozen weights (``layer.trainable = False`` makes a kernel
    non-trainable, but no forward pass changes it: copying it every step would cost a frozen
    backbone's memory and time)."""
    seeds, found = set(), {}
    layers = list(model._flatten_layers(include_self=True, recursive=True))
    for layer in layers:
        for gen in getattr(layer, "_seed_generators", ()) or ():
            seeds.add(id(gen.state))
    for layer in layers:
        for v in getattr(layer, "_non_trainable_variables", ()) or ():
            if id(v) not in seeds:
                found.setdefault(id(v), v)
    return list(found.values())


def _add_rounded(total: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """``total + g`` rounded to their (accumulation) dtype, one addition at a time.

    A half dtype adds in float32 and rounds back, spelled out: Grappler's arithmetic optimizer
    would otherwise fold the unrolled chain of half additions into one ``AddN``, which rounds
    once at the end instead of after every micro-batch (the rule the other backends follow).
    """
    if total.dtype in (tf.float16, tf.bfloat16):
        return tf.cast(tf.cast(total, tf.float32) + tf.cast(g, tf.float32), total.dtype)
    return total + g


class TrainStep(LoggedStep):
    """A compiled training step: ``step(batch) -> StepResult``. Built by
    :meth:`MixedPrecision.train_step`; see there.

    Attributes:
        optimizer: the :class:`LossScaleOptimizer` holding the loss-scale state.
        function: the ``tf.function`` (traced once per batch signature).
        stats_function: with ``stats_every``, the ``tf.function`` of the statistics steps (the
            same step with the statistics added, traced once per batch signature on its
            first call); else None.
        stats_every: ``None`` or ``k``: statistics on calls 0, k, 2k, ...
        calls: the calls that returned a result (a Python int).
    """

    def __init__(
        self,
        model: Any,
        optimizer: LossScaleOptimizer,
        loss_fn: Callable[[Any, Any], Any],
        grad_accum_steps: int,
        max_grad_norm: float | None,
        jit_compile: bool,
        device: str | None = None,
        stats_every: int | None = None,
        policy: Policy | None = None,
        schedule_counts: str = "applied",
    ) -> None:
        self.policy = Policy() if policy is None else policy
        optimizer.schedule_counts = check_schedule_counts(schedule_counts)  # read when traced
        self.model = model
        self.device = device
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.grad_accum_steps = grad_accum_steps
        self.max_grad_norm = max_grad_norm
        variables = list(model.trainable_variables)
        if stats_every is not None and _strategy_of(variables) is not None:
            raise ValueError(
                "stats_every is not supported under a tf.distribute strategy (each replica "
                "sees its own gradients and activations): drop stats_every=, or take the "
                "statistics you need with unimp.backends.tensorflow.tensor_stats(x, scale) "
                "inside your own replica function."
            )
        optimizer._ensure_built(variables)
        self._variables = variables
        self.strategy = _strategy_of(variables)
        if self.strategy is not None and device is not None:
            raise ValueError(
                f"device={device!r} and a tf.distribute strategy both place the step: bind the "
                "recipe without a device (the strategy says where the replicas run)."
            )
        if self.strategy is not None and jit_compile:
            raise ValueError(
                "jit_compile=True is not supported under a tf.distribute strategy (its "
                "merge_call cannot be compiled by XLA); use jit_compile=False."
            )
        self._jit_compile = jit_compile
        self.stats_every = stats_every
        self.calls = 0
        self._floor_watch = FloorWatch()  # each floor hit acted on at one result read
        self._collector: _Collector | None = None  # set only while the statistics step traces
        self._stats_order: tuple[list[str], list[str]] = ([], [])
        self._flag_names: list[str] = []  # the gradients' names, set while a logged step traces
        self.function = self._make_function()
        self.stats_function = None if stats_every is None else self._make_stats_function()

    def _make_function(self) -> Any:
        if self.strategy is None:
            return tf.function(self._step, jit_compile=self._jit_compile)
        return tf.function(self._distributed_step)

    def _make_stats_function(self) -> Any:
        return tf.function(self._stats_step, jit_compile=self._jit_compile)

    def tracing_count(self) -> int:
        """How many times the step has been traced (1 after any number of same-signature calls)."""
        return int(self.function.experimental_get_tracing_count())

    def __call__(self, batch: Any) -> StepResult:
        if self.grad_accum_steps > 1:
            batch = micro_batches(batch, self.grad_accum_steps)
        batch = _batch_to_tensors(batch)
        if self.strategy is not None and not isinstance(batch, tf.distribute.DistributedValues):
            batch = self._split(batch)
        stats_step = self.stats_every is not None and self.calls % self.stats_every == 0
        function = self.stats_function if stats_step else self.function
        # the policy's matmul precision (TensorFlow's global TF32 switch) for this call only
        with matmul_precision(self.policy.matmul_precision):
            if self.device is None:
                raw = function(batch)
            else:
                _check_placed(self.device)
                with tf.device(self.device):
                    raw = function(batch)
        stats = None
        if "floor_hits" in raw:  # the step's index, named by a floor_action message
            raw["floor_step"] = self.calls
        if stats_step:
            stats = _pending(self.calls, raw["scale"], raw.pop("stats"), self._stats_order)
        flags = raw.pop("grad_flags", None)
        self.calls += 1
        result = StepResult(
            raw, to_host=_to_host, config=self.optimizer.loss_scale_config, stats=stats,
            watch=self._floor_watch,
        )
        if self._recorder is not None:
            lr = getattr(self.optimizer, "learning_rate", None)
            lr = tf.identity(lr) if isinstance(lr, (tf.Variable, tf.Tensor)) or hasattr(lr, "value") else lr
            finite = None if self.strategy is not None else all_finite(batch)
            self._recorder.add(
                self.calls - 1, result, lr=lr, batch_finite=finite,
                grad_flags=None if flags is None else (self._flag_names, flags),
            )  # fmt: skip
        return result

    def state_dict(self) -> dict[str, Any]:
        """The loss-scale state in unimp's portable format."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        """Loads a portable loss-scale state; the saved config replaces the recipe's (as in
        every unimp backend). A different config retraces the step, which has the config
        built in; other tf.functions that traced the same optimizer keep the old one.

        Raises:
            ValueError: a bad or foreign state dict; nothing is changed.
        """
        opt = self.optimizer
        config, state = from_state_dict(state_dict)
        # this step retraces; a tf.function of anyone else (model.fit) would keep the old rule
        others = opt._traced_by - {id(self)}
        opt._check_retrace(config, others, "a new optimizer (that function keeps the old config)")
        retrace = _traced_fields(config) != _traced_fields(opt.loss_scale_config)
        opt._adopt(config, state)
        if retrace:
            opt._traced_by.discard(id(self))
            self.function = self._make_function()
            if self.stats_function is not None:
                self.stats_function = self._make_stats_function()

    def _split(self, batch: Any) -> Any:
        """A global batch as per-replica slices along axis 0 (equal sizes)."""
        n = self.strategy.num_replicas_in_sync
        for x in tf.nest.flatten(batch):
            if tf.is_tensor(x) and (x.shape.rank == 0 or x.shape[0] % n):
                raise ValueError(
                    f"under {type(self.strategy).__name__} with {n} replicas, every tensor of "
                    f"the global batch is split along axis 0 into {n} equal parts; got shape "
                    f"{x.shape}. Use a global batch size divisible by {n}, or pass a batch from "
                    "strategy.experimental_distribute_dataset(...)."
                )

        def piece(ctx: Any) -> Any:
            i = ctx.replica_id_in_sync_group
            return tf.nest.map_structure(
                lambda x: tf.split(x, n)[i] if tf.is_tensor(x) else x, batch
            )

        return self.strategy.experimental_distribute_values_from_function(piece)

    # -- traced code -----------------------------------------------------------------------

    def _distributed_step(self, batch: Any) -> dict:
        opt = self.optimizer
        outer, opt._tracer = opt._tracer, id(self)  # the update runs in merge_call, out of _step
        try:
            with _keras_sum_off(opt.inner_optimizer, self.policy.reduce_dtype is not None):
                per_replica = self.strategy.run(self._step, args=(batch,))
        finally:
            opt._tracer = outer
        first = self.strategy.experimental_local_results
        out = {k: None if v is None else first(v)[0] for k, v in per_replica.items()}
        # every field but the loss is the same on every replica; the loss is the mean
        out["loss"] = self.strategy.reduce("mean", per_replica["loss"], axis=None)
        return out

    def _stats_step(self, batch: Any) -> dict:
        """The step with statistics: while it traces, every leaf layer's ``call`` records its
        outputs and :meth:`_finish` the unscaled gradients; their statistics are returned
        under ``"stats"``."""
        collector = _Collector()
        self._collector = collector
        try:
            with collector.recording(self.model):
                out = dict(self._step(batch))
        finally:
            self._collector = None
        self._stats_order = (list(collector.gradients), list(collector.activations))
        out["stats"] = collector.outputs()
        return out

    def _finish(
        self, unscaled: list[Any], loss: tf.Tensor, loss_finite: tf.Tensor, scale: tf.Tensor
    ) -> dict:
        if self._collector is not None:  # tracing the statistics step: unscaled, unclipped
            self._collector.add_gradients(
                [(v.path, g) for v, g in zip(self._variables, unscaled, strict=True) if g is not None],
                scale,
            )
        flags = None
        if self._collector is None and self._recorder is not None and self.strategy is None:
            # logged (read while tracing): which gradient went non-finite first
            self._flag_names, flags = _grad_flags(
                [(v.path, g) for v, g in zip(self._variables, unscaled, strict=True) if g is not None]
            )
        grads_finite = all_finite([g for g in unscaled if g is not None])
        replica = tf.distribute.get_replica_context() if self.strategy is not None else None
        reduced = False
        if replica is not None and replica.num_replicas_in_sync > 1:
            # Keras's optimizer sums the gradients over replicas: give it local / n, so the
            # update is the mean gradient, as one device on the whole global batch.
            inv = tf.constant(1.0 / replica.num_replicas_in_sync, tf.float32)
            unscaled = [_times(g, inv) for g in unscaled]
            if self.policy.reduce_dtype is not None:
                # the policy's reduce_dtype: this step sums local / n in it (cast around the
                # all-reduce) and Keras's own sum is turned off (_keras_sum_off); the flag is
                # taken on the reduced gradients too, so an overflow of the sum skips everywhere
                unscaled = _all_reduce_in(
                    replica, unscaled, to_dtype(self.policy.reduce_dtype), scale
                )
                grads_finite = grads_finite & all_finite([g for g in unscaled if g is not None])
                reduced = True
        grad_norm = None
        if self.max_grad_norm is not None:
            # clipping acts on the unscaled gradients; the norm is reported before clipping.
            # Under a strategy it is the norm of the all-reduced gradient, the same on every
            # replica (clipping each replica by its own norm would not be clip(mean)).
            grad_norm = _global_norm(
                unscaled
                if replica is None or replica.num_replicas_in_sync == 1 or reduced
                else replica.all_reduce("sum", [g for g in unscaled if g is not None])
            )
            limit = tf.constant(self.max_grad_norm, tf.float32)
            factor = limit / tf.maximum(grad_norm, limit)
            unscaled = [_times(g, factor) for g in unscaled]
        applied, consecutive, total, grads_finite, loss_finite = self.optimizer._apply_step(
            unscaled, self._variables, grads_finite, loss_finite
        )
        return {
            "loss": loss,
            "scale": scale,
            "applied": applied,
            "loss_finite": loss_finite,
            "grads_finite": grads_finite,
            "grad_norm": grad_norm,
            "consecutive_skips": consecutive,
            "total_skips": total,
            **({} if flags is None else {"grad_flags": flags}),
            **floor_hits(self.optimizer.loss_scale_config, _extra(self.optimizer)),
        }

    def _scaled_grads(self, batch: Any, scale: tf.Tensor) -> tuple[list[Any], tf.Tensor]:
        with tf.GradientTape() as tape:
            with tf.name_scope("forward"):  # a name only: unimp.trace reads the phase from it
                loss = tf.convert_to_tensor(self.loss_fn(self.model, batch))
            if not loss.dtype.is_floating:
                raise TypeError(f"loss_fn must return a floating loss, got {loss.dtype.name}.")
            if loss.shape.rank not in (None, 0):
                raise ValueError(
                    f"loss_fn must return a scalar loss, got shape {loss.shape}; reduce it (e.g. "
                    "tf.reduce_mean)."
                )
            loss32 = tf.cast(loss, tf.float32)
            # a scale that is always 1 (none, or a static 1.0; built into the graph): no
            # multiply, the same bits (as torch's and the core's ``unity``)
            scaled = loss32 if self.optimizer.loss_scale_config.unity else loss32 * scale
        return tape.gradient(scaled, self._variables), loss32

    def _step(self, batch: Any) -> dict:
        opt = self.optimizer
        outer, opt._tracer = opt._tracer, id(self)  # runs while tracing: marks whose graph it is
        try:
            # state the forward pass changes (BatchNormalization's moving statistics, any
            # non-trainable variable but the dropout seeds): read before the forward, selected
            # back after the decision when the step is skipped (in the graph, no host sync)
            saved = [(v, tf.identity(v.value)) for v in _forward_state(self.model)]
            out = self._step_body(batch)
            for v, old in saved:
                v.assign(tf.where(out["applied"], v.value, old))
            return out
        finally:
            opt._tracer = outer

    def _step_body(self, batch: Any) -> dict:
        scale = tf.identity(tf.convert_to_tensor(self.optimizer.dynamic_scale))
        if self.grad_accum_steps == 1:
            grads, loss32 = self._scaled_grads(batch, scale)
            if self.optimizer.loss_scale_config.unity:  # x / 1.0 is x: no divide (nor its casts)
                unscaled = list(grads)
            else:
                unscaled = [None if g is None else _unscale(g, scale) for g in grads]
            return self._finish(unscaled, loss32, tf.math.is_finite(loss32), scale)
        # a window of k micro-batches: sum the scaled gradients in float32 (or the policy's
        # accum_dtype, rounded at every addition) from exact zeros, take the mean in float32,
        # unscale once; the window is skipped when any micro-batch is non-finite
        k = self.grad_accum_steps
        accum = to_dtype(self.policy.accum_dtype or "float32")
        total: list[Any] = [None] * len(self._variables)
        losses = []
        for micro in batch:
            grads, loss32 = self._scaled_grads(micro, scale)
            losses.append(loss32)
            for i, g in enumerate(grads):
                if g is not None:
                    g = tf.cast(tf.convert_to_tensor(g), accum)
                    total[i] = g if total[i] is None else _add_rounded(total[i], g)
        kf = tf.constant(float(k), tf.float32)
        enabled = not self.optimizer.loss_scale_config.unity  # x / 1.0 is x: no divide at scale 1
        unscaled = [
            None
            if t is None
            else tf.cast((tf.cast(t, tf.float32) / kf) / scale if enabled else tf.cast(t, tf.float32) / kf, v.dtype)
            for t, v in zip(total, self._variables, strict=True)
        ]
        stacked = tf.stack(losses)
        return self._finish(
            unscaled, tf.reduce_mean(stacked), tf.reduce_all(tf.math.is_finite(stacked)), scale
        )
