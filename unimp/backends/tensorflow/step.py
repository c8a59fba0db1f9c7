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
from unimp.backends.tensorflow.fp8 import fp8_window
from unimp.backends.tensorflow.optimizer import _HALF, LossScaleOptimizer
from unimp.backends.tensorflow.overflow import _clip, _global_norm, all_finite
from unimp.backends.tensorflow.precision import matmul_precision
from unimp.backends.tensorflow.scaling import _extra, _to_host, _unscale
from unimp.backends.tensorflow.stats import _collector, _grad_flags, _pending
from unimp.keras.stats import Collector, relative_path
from unimp.keras.step import forward_state_variables
from unimp.loss_scale import FloorWatch
from unimp.policy import Policy
from unimp.step import StepResult, floor_hits
from unimp.steprecorder import LoggedStep
from unimp.trainstep import StepOptions, run_step


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
        options: StepOptions,
        jit_compile: bool,
        device: str | None = None,
        policy: Policy | None = None,
    ) -> None:
        self.policy = Policy() if policy is None else policy
        self.options = options
        stats_every = options.stats_every
        optimizer.schedule_counts = options.schedule_counts  # read when traced
        self.model = model
        self.device = device
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        variables = list(model.trainable_variables)
        if stats_every is not None and _strategy_of(variables) is not None:
            raise ValueError(
                "stats_every is not supported under a tf.distribute strategy (each replica "
                "sees its own gradients and activations): drop stats_every=, or take the "
                "statistics you need with unimp.backends.tensorflow.tensor_stats(x, scale) "
                "inside your own replica function."
            )
        optimizer.ensure_built(variables)
        self._variables = variables
        self.strategy = _strategy_of(variables)
        if self.strategy is not None and device is not None:
            raise ValueError(
                f"device={device!r} and a tf.distribute strategy both place the step: bind the "
                "recipe without a device (the strategy says where the replicas run)."
            )
        if self.strategy is not None and jit_compile:
            # measured (TensorFlow 2.21, MirroredStrategy over two CPUs): the replica step
            # compiled with XLA inside strategy.run reads a mirrored variable's component on
            # another device ("Trying to access resource .../replica_1 located in device CPU:1
            # from device CPU:0", XLA's known issue with variables on other devices); Keras's
            # own LossScaleOptimizer fails there too, in merge_call (keras-team/keras#21366)
            raise ValueError(
                "jit_compile=True is not supported under a tf.distribute strategy: XLA compiles "
                "the replica's step for one device, and it reads the mirrored variables' copies "
                "on the other replicas' devices; use jit_compile=False (the step is still one "
                "graph per replica)."
            )
        self._jit_compile = jit_compile
        self.calls = 0
        self._floor_watch = FloorWatch()  # each floor hit acted on at one result read
        self._collector: Collector | None = None  # set only while the statistics step traces
        self._stats_order: tuple[list[str], list[str]] = ([], [])
        self._flag_names: list[str] = []  # the gradients' names, set while a logged step traces
        self.function = self._make_function()
        self.stats_function = None if stats_every is None else self._make_stats_function()

    # the step's options, read from the one checked record (StepOptions)
    grad_accum_steps = property(lambda self: self.options.grad_accum_steps)
    max_grad_norm = property(lambda self: self.options.max_grad_norm)
    stats_every = property(lambda self: self.options.stats_every)
    schedule_counts = property(lambda self: self.options.schedule_counts)

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
            batch = self.options.micro_batches(batch)
        batch = _batch_to_tensors(batch)
        if self.strategy is not None and not isinstance(batch, tf.distribute.DistributedValues):
            batch = self._split(batch)
        stats_step = self.options.stats_step(self.calls)
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
            stats = _pending(
                self.calls, raw["scale"], raw.pop("stats"), self._stats_order, self.options.stats_formats
            )
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
        if self.optimizer.load_state_dict(state_dict, owner=id(self)):  # this step retraces
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
        with opt.tracing(id(self)):  # the update runs in merge_call, out of _step
            with _keras_sum_off(opt.inner_optimizer, self.policy.reduce_dtype is not None):
                per_replica = self.strategy.run(self._step, args=(batch,))
        first = self.strategy.experimental_local_results
        out = {k: None if v is None else first(v)[0] for k, v in per_replica.items()}
        # every field but the loss is the same on every replica; the loss is the mean
        out["loss"] = self.strategy.reduce("mean", per_replica["loss"], axis=None)
        return out

    def _stats_step(self, batch: Any) -> dict:
        """The step with statistics: while it traces, every leaf layer's ``call`` records its
        outputs and :meth:`_finish` the unscaled gradients; their statistics are returned
        under ``"stats"``."""
        collector = _collector(self.options.stats_formats)
        self._collector = collector
        try:
            with collector.recording(self.model):
                out = dict(self._step(batch))
        finally:
            self._collector = None
        self._stats_order = (list(collector.gradients), list(collector.activations))
        out["stats"] = collector.outputs()
        return out

    def _step(self, batch: Any) -> dict:
        with self.optimizer.tracing(id(self)):  # runs while tracing: marks whose graph it is
            micro = [batch] if self.grad_accum_steps == 1 else list(batch)
            return run_step(StepOps(self), micro, self.options)


class StepOps:
    """The phases of one step (:class:`unimp.trainstep.StepPrimitives`) for a TensorFlow
    :class:`TrainStep`, run while its ``tf.function`` traces (in each replica under a
    strategy): the gradients are a list of tensors (``None`` for a variable without one), in
    the order of ``model.trainable_variables``."""

    def __init__(self, step: TrainStep) -> None:
        self.step = step
        self.optimizer = step.optimizer
        self.variables = step._variables
        self.unity = step.optimizer.loss_scale_config.unity  # a scale always 1: no multiply
        self.k = step.grad_accum_steps
        self.replica = tf.distribute.get_replica_context() if step.strategy is not None else None
        self.reduced = False  # the step all-reduced the gradients itself (reduce_dtype)

    def begin(self) -> Any:
        return tf.identity(tf.convert_to_tensor(self.optimizer.dynamic_scale))

    def save_forward_state(self) -> Any:
        # state the forward pass changes (BatchNormalization's moving statistics, any
        # non-trainable variable but the dropout seeds): read before the forward, selected
        # back after the decision when the step is skipped (in the graph, no host sync)
        return [(v, tf.identity(v.value)) for v in forward_state_variables(self.step.model)]

    def abort(self, saved: Any) -> None:
        pass  # a trace that raised leaves no graph to run

    def _scaled_grads(self, batch: Any, scale: tf.Tensor) -> tuple[list[Any], tf.Tensor]:
        with tf.GradientTape() as tape:
            with tf.name_scope("forward"):  # a name only: unimp.trace reads the phase from it
                loss = tf.convert_to_tensor(self.step.loss_fn(self.step.model, batch))
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
            scaled = loss32 if self.unity else loss32 * scale
        return tape.gradient(scaled, self.variables), loss32

    def gradients(self, micro: list[Any], scale: Any) -> tuple[Any, Any, Any]:
        if self.k == 1:
            grads, loss32 = self._scaled_grads(micro[0], scale)
            return list(grads), loss32, tf.math.is_finite(loss32)
        # a window of k micro-batches: sum the scaled gradients in float32 (or the policy's
        # accum_dtype, rounded at every addition) from exact zeros, take the mean in float32
        accum = to_dtype(self.step.policy.accum_dtype or "float32")
        total: list[Any] = [None] * len(self.variables)
        losses = []
        with fp8_window():  # a float8 layer's scaling takes one step per window
            for mb in micro:
                grads, loss32 = self._scaled_grads(mb, scale)
                losses.append(loss32)
                for i, g in enumerate(grads):
                    if g is not None:
                        g = tf.cast(tf.convert_to_tensor(g), accum)
                        total[i] = g if total[i] is None else _add_rounded(total[i], g)
        kf = tf.constant(float(self.k), tf.float32)
        mean = [None if t is None else tf.cast(t, tf.float32) / kf for t in total]
        stacked = tf.stack(losses)
        return mean, tf.reduce_mean(stacked), tf.reduce_all(tf.math.is_finite(stacked))

    def unscale(self, grads: Any, scale: Any) -> Any:
        if self.k == 1:
            if self.unity:  # x / 1.0 is x: no divide (nor its casts)
                return grads
            return [None if g is None else _unscale(g, scale) for g in grads]
        # the window's float32 mean, unscaled once, back in each variable's dtype
        return [
            None if m is None else tf.cast(m if self.unity else m / scale, v.dtype)
            for m, v in zip(grads, self.variables, strict=True)
        ]

    def _named(self, grads: Any) -> list[tuple[str, Any]]:
        model = self.step.model
        return [
            (relative_path(model, v.path), g)
            for v, g in zip(self.variables, grads, strict=True)
            if g is not None
        ]

    def observe(self, grads: Any, scale: Any) -> dict[str, Any]:
        step = self.step
        if step._collector is not None:  # tracing the statistics step: unscaled, unclipped
            step._collector.add_gradients(self._named(grads), scale)
            return {}
        if step._recorder is not None and step.strategy is None:
            # logged (read while tracing): which gradient went non-finite first
            step._flag_names, flags = _grad_flags(self._named(grads))
            return {"grad_flags": flags}
        return {}

    def finite(self, grads: Any, scale: Any) -> tuple[Any, Any]:
        grads_finite = all_finite([g for g in grads if g is not None])
        replica = self.replica
        if replica is not None and replica.num_replicas_in_sync > 1:
            # Keras's optimizer sums the gradients over replicas: give it local / n, so the
            # update is the mean gradient, as one device on the whole global batch.
            inv = tf.constant(1.0 / replica.num_replicas_in_sync, tf.float32)
            grads = [_times(g, inv) for g in grads]
            reduce = self.step.policy.reduce_dtype
            if reduce is not None:
                # the policy's reduce_dtype: this step sums local / n in it (cast around the
                # all-reduce) and Keras's own sum is turned off (_keras_sum_off); the flag is
                # taken on the reduced gradients too, so an overflow of the sum skips everywhere
                grads = _all_reduce_in(replica, grads, to_dtype(reduce), scale)
                grads_finite = grads_finite & all_finite([g for g in grads if g is not None])
                self.reduced = True
        return grads, grads_finite

    def global_norm(self, grads: Any, grads_finite: Any) -> tuple[Any, Any]:
        # Under a strategy it is the norm of the all-reduced gradient, the same on every
        # replica (clipping each replica by its own norm would not be clip(mean)).
        replica = self.replica
        if replica is None or replica.num_replicas_in_sync == 1 or self.reduced:
            norm, self.rescale = _global_norm(grads)
        else:
            norm, self.rescale = _global_norm(replica.all_reduce("sum", [g for g in grads if g is not None]))
        return norm, tf.logical_and(grads_finite, tf.math.is_finite(norm))

    def clip(self, grads: Any, norm: Any, max_norm: float) -> Any:
        # (g * s) * (max_norm / (norm * s)) where clipping, in float32 and rounded once to g's
        # dtype (unimp.trainstep.NORM_RESCALE_ABOVE); g itself elsewhere
        limit = tf.constant(max_norm, tf.float32)
        s = self.rescale
        return [_clip(g, norm > limit, s, limit / (norm * s)) for g in grads]

    def apply(self, grads: Any, grads_finite: Any, loss_finite: Any) -> Any:
        # the guarded apply and the loss-scale update, in one merge_call under a strategy
        # (where the flags are reduced over the replicas first): update_scale reports them
        applied, consecutive, total, grads_finite, loss_finite = self.optimizer.apply_unscaled(
            grads, self.variables, grads_finite, loss_finite
        )
        self.reported = {
            "loss_finite": loss_finite,
            "grads_finite": grads_finite,
            "consecutive_skips": consecutive,
            "total_skips": total,
            **floor_hits(self.optimizer.loss_scale_config, _extra(self.optimizer)),
        }
        return applied

    def restore_forward_state(self, saved: Any, applied: Any) -> None:
        for v, old in saved:
            v.assign(tf.where(applied, v.value, old))

    def params_finite(self) -> Any:
        # decided while tracing: float32 variables add no op
        half = [v for v in self.variables if tf.as_dtype(v.dtype) in _HALF]
        return all_finite([tf.convert_to_tensor(v) for v in half]) if half else None

    def update_scale(self, grads_finite: Any, loss_finite: Any) -> dict[str, Any]:
        return self.reported  # updated by apply, with the agreed flags
