"""The custom-loop train step of :class:`unimp.keras.MixedPrecision` on Keras's JAX, torch and
TensorFlow backends: :class:`TrainStep`, ``step(batch) -> StepResult``.

The step's algorithm is the core's (:func:`unimp.trainstep.run_step`, the one every backend
runs); :class:`StepOps` supplies its phases on ``keras.ops``, and only the backward pass is
the engine's own, as in Keras's custom-loop guides: ``jax.value_and_grad`` of a stateless
call, ``loss.backward()`` on torch, ``tf.GradientTape`` on TensorFlow. On JAX the whole step
(forward, backward, unscale, checks, the guarded update and the loss-scale rule) runs inside
one ``jax.jit`` under a Keras ``StatelessScope``: one compilation per batch structure, values
in and out, no host read. On torch it runs eagerly and reads nothing to the host. On
TensorFlow it runs eagerly (the TensorFlow backend's own step, ``backend="tensorflow"``,
traces it and adds ``tf.distribute``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import ops

from unimp.keras.fp8 import is_state, keep_unrun, window_states
from unimp.keras.optimizer import unscale
from unimp.keras.overflow import all_finite
from unimp.keras.precision import matmul_precision
from unimp.keras.stats import Collector, grad_flags, pending, relative_path
from unimp.loss_scale import EXTRA_FIELDS, FloorWatch
from unimp.policy import Policy
from unimp.step import StepResult, floor_hits
from unimp.steprecorder import LoggedStep
from unimp.trainstep import NORM_RESCALE_ABOVE, StepOptions, run_step

__all__ = ["StepOps", "TrainStep", "forward_state_variables", "host_value"]


def forward_state_variables(model: Any) -> list[Any]:
    """The variables a forward pass may change, which a skipped step puts back: those the
    layers created non-trainable (BatchNormalization's moving mean and variance, a layer's own
    counters), without the random-seed states of ``SeedGenerator``\\ s (a skipped step still
    draws new dropout masks, as in torch and JAX) and without frozen weights
    (``layer.trainable = False`` makes a kernel non-trainable, but no forward pass changes
    it: copying it every step would cost a frozen backbone's memory and time).

    Args:
        model: a Keras layer or model.

    Returns:
        A list of ``keras.Variable``\\ s, each once.
    """
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


def _no_foreign_writes(scope: Any, known: list[Any]) -> None:
    """On JAX the step is one compiled function of the model's and the optimizer's variables:
    a write to another Keras variable (a metric or counter made outside the model, updated in
    ``loss_fn``) would be lost, and its reads frozen at the first trace; refused, naming the
    fix."""
    ids = {id(v) for v in known}
    foreign = [i for i in scope.state_mapping if i not in ids]
    if foreign:
        raise ValueError(
            f"loss_fn writes {len(foreign)} Keras variable(s) that are neither the model's nor the "
            "optimizer's (a metric or counter made outside the model): on Keras-JAX the step is "
            "one compiled function of the model's and the optimizer's variables, so the write "
            "would be lost. Update it outside the step (from the StepResult), or make it a "
            "variable of the model (a layer's or a metric the model tracks)."
        )


def host_value(x: Any) -> Any:
    """One device value of a step's result as a Python scalar (a host read)."""
    return np.asarray(ops.convert_to_numpy(x)).item()


def _dtype(x: Any) -> str:
    return keras.backend.standardize_dtype(x.dtype)


def _rounded_add(total: Any, g: Any) -> Any:
    """``total + g`` rounded to the accumulation dtype at this addition (float32 maths)."""
    dtype = _dtype(total)
    if dtype in ("float16", "bfloat16"):
        return ops.cast(ops.add(ops.cast(total, "float32"), ops.cast(g, "float32")), dtype)
    return ops.add(total, g)


def _norm_rescale(amax: Any) -> Any:
    """The global norm's factor ``s`` (:data:`unimp.trainstep.NORM_RESCALE_ABOVE`): a power
    of two from ``amax``'s exponent bits where ``amax`` is finite and above the threshold,
    else 1."""
    bits = ops.bitwise_and(ops.view(amax, "int32"), ops.convert_to_tensor(0x7F800000, "int32"))
    power = ops.view(bits, "float32")  # 2**floor(log2 amax)
    big = ops.logical_and(ops.isfinite(amax), ops.greater(amax, NORM_RESCALE_ABOVE))
    safe = ops.where(big, power, ops.ones_like(power))
    return ops.where(big, ops.divide(NORM_RESCALE_ABOVE, safe), ops.ones_like(power))


class TrainStep(LoggedStep):
    """``step(batch) -> StepResult``: one optimizer step of a Keras model with loss scaling.

    Built by :meth:`unimp.keras.MixedPrecision.train_step` (the options and errors are there).

    Attributes:
        model: the Keras model.
        optimizer: the :class:`unimp.keras.LossScaleOptimizer` holding the loss-scale state.
        engine: Keras's backend, ``"jax"``, ``"torch"`` or ``"tensorflow"``.
        calls: the calls that returned a result.
    """

    def __init__(
        self, model: Any, optimizer: Any, loss_fn: Callable[[Any, Any], Any], options: StepOptions,
        policy: Policy,
    ) -> None:  # fmt: skip
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.options = options
        self.policy = policy
        self.engine = keras.backend.backend()
        self.calls = 0
        self._watch = FloorWatch()
        self._jitted: dict[bool, Any] = {}  # JAX: the plain step and the statistics step
        self._stats_order: tuple[list[str], list[str]] = ([], [])
        self._flag_names: list[str] = []  # the gradients' names, set where a logged step runs
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        self._trainable = [id(v) for v in model.trainable_variables]

    def _variables(self) -> list[Any]:
        """Every variable the step reads or writes (JAX's stateless step maps them all)."""
        seen: dict[int, Any] = {}
        for v in (*self.model.variables, *self.optimizer.variables):
            seen.setdefault(id(v), v)
        return list(seen.values())

    def _run(self, micro: list[Any], stats: bool) -> dict[str, Any]:
        """:func:`unimp.trainstep.run_step` with this step's primitives; on a statistics step
        every leaf layer's outputs are recorded too, and returned under ``"stats"``."""
        collector = Collector(formats=self.options.stats_formats) if stats else None
        with contextlib.nullcontext() if collector is None else collector.recording(self.model):
            raw = run_step(StepOps(self, collector), micro, self.options)
        if collector is not None:
            raw["stats"] = collector.outputs()
            self._stats_order = collector.order()
        return raw

    def _pure(self, held: list[Any], stats: bool) -> Callable[[list[Any], list[Any]], Any]:
        """JAX: the step as a function of values, ``(variable values, micro-batches) ->
        (new values, raw)``: :meth:`_run` under a ``StatelessScope`` over ``held``."""

        def pure(values: list[Any], micro: list[Any]) -> tuple[list[Any], dict[str, Any]]:
            mapping = list(zip(held, values, strict=True))
            with keras.StatelessScope(state_mapping=mapping) as scope:
                raw = self._run(micro, stats)
                after = [scope.get_current_value(v) for v in held]
            _no_foreign_writes(scope, held)
            return [x if a is None else a for a, x in zip(after, values, strict=True)], raw

        return pure

    def traceable(self, batch: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """JAX: ``(function, arguments)`` of one call of the plain step on ``batch``, for
        ``jax.make_jaxpr`` (:meth:`unimp.keras.MixedPrecision.trace`); nothing runs.

        Raises:
            ValueError: not on Keras's JAX backend.
        """
        if self.engine != "jax":
            raise ValueError(f"traceable() is the JAX step's; this step runs on {self.engine}.")
        held = self._variables()
        return self._pure(held, False), ([v.value for v in held], self.options.micro_batches(batch))

    def _jax(self, micro: list[Any], stats: bool) -> dict[str, Any]:
        import jax

        held = self._variables()
        if stats not in self._jitted:
            self._jitted[stats] = jax.jit(self._pure(held, stats))
        values, raw = self._jitted[stats]([v.value for v in held], micro)
        for v, x in zip(held, values, strict=True):
            v.assign(x)
        return raw

    def __call__(self, batch: Any) -> StepResult:
        """Runs one step on ``batch`` (a list of ``grad_accum_steps`` micro-batches when
        accumulating; whatever ``loss_fn`` takes; NumPy arrays are fine).

        Returns:
            The :class:`unimp.StepResult` (device values; reading a field reads the device).

        Raises:
            Whatever ``loss_fn`` raises; the model, the optimizer and the loss-scale state are
            then as before the call.
        """
        if [id(v) for v in self.model.trainable_variables] != self._trainable:
            raise ValueError(
                "the model's trainable variables changed since this train step was built (a "
                "layer's `trainable` was set): build a new step, mp.train_step(model, optimizer, "
                "loss_fn), with a new optimizer where layers were unfrozen (as Keras asks for "
                "compile() again)."
            )
        micro = self.options.micro_batches(batch)
        stats_step = self.options.stats_step(self.calls)
        with matmul_precision(self.policy.matmul_precision):  # this call only; JAX keys on it
            raw = self._jax(micro, stats_step) if self.engine == "jax" else self._run(micro, stats_step)
        if "floor_hits" in raw:  # the step's index, named by a floor_action message
            raw["floor_step"] = self.calls
        stats = None
        if stats_step:
            stats = pending(
                self.calls, raw["scale"], raw.pop("stats"), self._stats_order, formats=self.options.stats_formats
            )
        flags = raw.pop("grad_flags", None)
        self.calls += 1
        result = StepResult(
            raw, host_value, self.optimizer.loss_scale_config, stats=stats, watch=self._watch
        )
        if self._recorder is not None:
            lr = self.optimizer.inner_optimizer.learning_rate
            flat = [x for x in keras.tree.flatten(batch) if ops.is_tensor(x) or isinstance(x, np.ndarray)]
            floating = [x for x in flat if "float" in keras.backend.standardize_dtype(x.dtype)]
            finite = ops.all(ops.stack([ops.all(ops.isfinite(x)) for x in floating])) if floating else None
            self._recorder.add(
                self.calls - 1, result, lr=ops.copy(lr), batch_finite=finite,
                grad_flags=None if flags is None else (self._flag_names, flags),
            )  # fmt: skip
        return result

    def state_dict(self) -> dict[str, Any]:
        """The loss-scale state in the portable format (:func:`unimp.loss_scale.state_dict`)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        """Restores a portable loss-scale state (from any backend); the saved config replaces
        the recipe's, as in every backend (JAX compiles the step again)."""
        self.optimizer.load_state_dict(state_dict)
        self._jitted = {}


class StepOps:
    """The phases of one step (:class:`unimp.trainstep.StepPrimitives`) on ``keras.ops``, for
    a :class:`TrainStep`: the gradients are a list of tensors (``None`` for a variable without
    one), in the order of ``model.trainable_variables``. Under JAX they run traced, inside the
    step's ``StatelessScope``: every ``assign`` is recorded there, nothing is written."""

    def __init__(self, step: TrainStep, collector: Collector | None = None) -> None:
        self.step = step
        self.collector = collector  # a statistics step's recording
        self.optimizer = step.optimizer
        self.variables = list(step.model.trainable_variables)
        self.states = [is_state(v) for v in self.variables]  # float8 states (unimp.keras.fp8)
        self.unity = step.optimizer.loss_scale_config.unity  # a scale always 1: no multiply
        self.k = step.options.grad_accum_steps
        self.reported: dict[str, Any] = {}
        self.rescale: Any = None

    def begin(self) -> Any:
        return ops.copy(self.optimizer.dynamic_scale.value)

    def save_forward_state(self) -> Any:
        return [(v, ops.copy(v.value)) for v in forward_state_variables(self.step.model)]

    def abort(self, saved: Any) -> None:
        for v, old in saved:
            v.assign(old)
        if self.step.engine == "torch":
            for v in self.variables:
                v.value.grad = None

    # -- the engine's backward -----------------------------------------------------------

    def _loss(self, batch: Any) -> Any:
        out = self.step.loss_fn(self.step.model, batch)
        if out is None or isinstance(out, (tuple, list, dict, str, bytes)):
            what = f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list, dict)) else repr(out)[:40]
            raise TypeError(
                f"loss_fn must return one scalar loss (a floating tensor), got {what}: return "
                "the loss alone (the step takes no auxiliary outputs; compute metrics from the "
                "model outside the step)."
            )
        loss = ops.convert_to_tensor(out)
        if "float" not in _dtype(loss):
            raise TypeError(f"loss_fn must return a floating loss, got {_dtype(loss)}.")
        if len(loss.shape) != 0:
            raise ValueError(
                f"loss_fn must return a scalar loss, got shape {tuple(loss.shape)}; reduce it "
                "(e.g. keras.ops.mean)."
            )
        return ops.cast(loss, "float32")

    def _scaled(self, loss32: Any, scale: Any) -> Any:
        # a scale that is always 1 (none, or a static 1.0): no multiply, the same bits
        return loss32 if self.unity else ops.multiply(loss32, scale)

    def _scaled_grads(self, batch: Any, scale: Any) -> tuple[list[Any], Any]:
        return getattr(self, f"_grads_{self.step.engine}")(batch, scale)

    def _grads_jax(self, batch: Any, scale: Any) -> tuple[list[Any], Any]:
        import jax

        trainable = self.variables
        known = {id(v) for v in trainable}
        others = [(v, v.value) for v in self.step._variables() if id(v) not in known]

        def scaled_loss(tv: list[Any]) -> tuple[Any, tuple[Any, list[Any]]]:
            mapping = [*zip(trainable, tv, strict=True), *others]
            # collect_losses: the layers' add_loss terms (activity regularizers) are in
            # model.losses inside loss_fn, as in Keras's own JAX trainer (stateless_call)
            with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
                loss32 = self._loss(batch)
            _no_foreign_writes(scope, [v for v, _ in mapping])
            after = [scope.get_current_value(v) for v, _ in others]
            return self._scaled(loss32, scale), (loss32, after)

        tv = [v.value for v in trainable]
        (_, (loss32, after)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(tv)
        for (v, _), x in zip(others, after, strict=True):
            if x is not None:  # the forward's writes (statistics, seeds), into the step's scope
                v.assign(x)
        return list(grads), loss32

    def _grads_torch(self, batch: Any, scale: Any) -> tuple[list[Any], Any]:
        import torch

        for v in self.variables:
            v.value.grad = None
        # gradients on even under the caller's torch.no_grad() (an evaluation loop's block), as
        # unimp's torch step takes them
        with torch.enable_grad():
            loss32 = self._loss(batch)
            if not loss32.requires_grad:  # torch's own message names no fix
                raise ValueError(
                    "loss_fn's loss does not depend on the model's trainable variables (torch has "
                    "no gradient to take): compute it from the model's outputs, without "
                    "stop_gradient / detach on the way."
                )
            self._scaled(loss32, scale).backward()
        grads = [v.value.grad for v in self.variables]
        for v in self.variables:
            v.value.grad = None
        return grads, loss32.detach()

    def _grads_tensorflow(self, batch: Any, scale: Any) -> tuple[list[Any], Any]:
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss32 = self._loss(batch)
            scaled = self._scaled(loss32, scale)
        return list(tape.gradient(scaled, self.variables)), loss32

    # -- the core's phases ---------------------------------------------------------------

    def gradients(self, micro: list[Any], scale: Any) -> tuple[Any, Any, Any]:
        if self.k == 1:
            grads, loss32 = self._scaled_grads(micro[0], scale)
            return grads, loss32, ops.isfinite(loss32)
        # a window: the scaled gradients summed in float32 (or the policy's accum_dtype,
        # rounded at every addition) from exact zeros, the mean taken in float32
        # float8 states are not summed: each takes one step on the window's largest amax
        # (unimp.keras.fp8.window_states)
        accum = self.step.policy.accum_dtype or "float32"
        total: list[Any] = [None] * len(self.variables)
        losses, per_micro = [], []
        for mb in micro:
            grads, loss32 = self._scaled_grads(mb, scale)
            losses.append(loss32)
            per_micro.append(grads)
            for i, g in enumerate(grads):
                if g is not None and not self.states[i]:
                    g = ops.cast(g, accum)
                    total[i] = g if total[i] is None else _rounded_add(total[i], g)
        mean = [None if t is None else ops.divide(ops.cast(t, "float32"), float(self.k)) for t in total]
        for i, merged in window_states(per_micro, self.variables).items():
            mean[i] = merged
        stacked = ops.stack(losses)
        return mean, ops.mean(stacked), ops.all(ops.isfinite(stacked))

    def _plain(self, grads: Any) -> list[Any]:
        """The gradients without the float8 states' (``is_state``: values, not gradients)."""
        return [g for g, state in zip(grads, self.states, strict=True) if not state]

    def unscale(self, grads: Any, scale: Any) -> Any:
        out = []
        for g, v in zip(grads, self.variables, strict=True):
            if g is None or is_state(v):
                out.append(g)
            elif self.k > 1:  # the window's float32 mean, unscaled once, in the variable's dtype
                out.append(ops.cast(g if self.unity else ops.divide(g, scale), _dtype(v)))
            elif self.unity:  # x / 1.0 is x: no divide (nor its casts)
                out.append(g)
            else:
                out.append(unscale(g, scale))  # the optimizer's own unscale
        return out

    def _named(self, grads: Any) -> list[tuple[str, Any]]:
        model = self.step.model
        return [
            (relative_path(model, v.path), g)
            for v, g in zip(self.variables, grads, strict=True)
            if g is not None and not is_state(v)
        ]

    def observe(self, grads: Any, scale: Any) -> dict[str, Any]:
        if self.collector is not None:  # a statistics step: unscaled, before clipping
            self.collector.add_gradients(self._named(grads), scale)
            return {}
        if self.step._recorder is not None:  # logged: which gradient went non-finite first
            self.step._flag_names, flags = grad_flags(self._named(grads))
            return {"grad_flags": flags}
        return {}

    def finite(self, grads: Any, scale: Any) -> tuple[Any, Any]:
        return grads, all_finite(self._plain(grads))

    def global_norm(self, grads: Any, grads_finite: Any) -> tuple[Any, Any]:
        wide = [ops.cast(g, "float32") for g in self._plain(grads) if g is not None]
        if not wide:
            self.rescale = ops.convert_to_tensor(1.0, "float32")
            return ops.convert_to_tensor(0.0, "float32"), grads_finite
        amax = ops.max(ops.stack([ops.max(ops.abs(g)) for g in wide]))
        s = self.rescale = _norm_rescale(amax)
        squares = ops.stack([ops.sum(ops.square(ops.multiply(g, s))) for g in wide])
        norm = ops.divide(ops.sqrt(ops.sum(squares)), s)
        return norm, ops.logical_and(grads_finite, ops.isfinite(norm))

    def clip(self, grads: Any, norm: Any, max_norm: float) -> Any:
        # (g * s) * (max_norm / (norm * s)) where clipping, in float32, rounded once to g's
        # dtype (unimp.trainstep.NORM_RESCALE_ABOVE); g itself elsewhere
        s = self.rescale
        clip = ops.greater(norm, max_norm)
        factor = ops.divide(max_norm, ops.multiply(norm, s))
        return [
            g if g is None or state else ops.where(
                clip, ops.cast(ops.multiply(ops.multiply(ops.cast(g, "float32"), s), factor), _dtype(g)), g
            )
            for g, state in zip(grads, self.states, strict=True)
        ]

    def apply(self, grads: Any, grads_finite: Any, loss_finite: Any) -> Any:
        grads = keep_unrun(grads, self.variables, [v.value for v in self.variables])
        applied, consecutive, total = self.optimizer.apply_unscaled(
            grads, self.variables, grads_finite, loss_finite, self.step.options.schedule_counts
        )
        extra = self.optimizer.loss_scale_extra
        self.reported = {
            "consecutive_skips": consecutive,
            "total_skips": total,
            **floor_hits(
                self.optimizer.loss_scale_config,
                None if extra is None else tuple(ops.unstack(extra.value, num=len(EXTRA_FIELDS))),
            ),
        }
        return applied

    def restore_forward_state(self, saved: Any, applied: Any) -> None:
        for v, old in saved:
            v.assign(ops.where(applied, v.value, old))

    def params_finite(self) -> Any:
        half = [v for v in self.variables if _dtype(v) in ("float16", "bfloat16")]
        if not half:
            return None
        return ops.all(ops.stack([ops.all(ops.isfinite(v.value)) for v in half]))

    def update_scale(self, grads_finite: Any, loss_finite: Any) -> dict[str, Any]:
        return self.reported  # updated by apply
