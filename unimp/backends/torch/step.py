"""torch train step: :class:`TrainStep` (autocast forward, scaled backward, unscale, clipping,
gradient accumulation, the guarded optimizer step and the loss-scale update).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from unimp.attached import peek
from unimp.backends._base import MixedPrecisionBase
from unimp.backends.torch.casting import to_dtype
from unimp.backends.torch.devices import _to
from unimp.backends.torch.fp8 import fp8_window
from unimp.backends.torch.optimizer import check_half_state, half_update, native_flag, param_grads
from unimp.backends.torch.overflow import _global_norm, _rescale_, all_finite
from unimp.backends.torch.precision import matmul_precision
from unimp.backends.torch.scaling import GradScaler, check_skip, to_host
from unimp.backends.torch.stats import (
    _grad_flags,
    _gradient_stats,
    _param_names,
    _pending,
    _Recorder,
)
from unimp.rounding import step_seed
from unimp.step import StepResult, floor_hits
from unimp.steprecorder import LoggedStep
from unimp.trainstep import StepOptions, run_step, run_step_traced


def _forward_state(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each persistent buffer of ``model`` (running statistics, ``num_batches_tracked``,
    spectral norm's vectors: the state a checkpoint holds) with a copy of its value.

    Non-persistent buffers are caches a forward pass does not learn into (rotary tables,
    masks): copying them every step would cost their memory and time for nothing, as the
    TensorFlow backend leaves frozen weights alone.
    """
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for module in model.modules():
            skip = module._non_persistent_buffers_set
            for name, b in module._buffers.items():
                if b is not None and name not in skip and id(b) not in seen:
                    seen[id(b)] = (b, b.detach().clone())
    return list(seen.values())


def _restore_forward_state(
    saved: list[tuple[torch.Tensor, torch.Tensor]], applied: torch.Tensor | None
) -> None:
    """Puts the saved buffer values back where the step was skipped (``applied`` False), with
    ``torch.where`` on each buffer's device (no host sync); ``None``: always (a failed call)."""
    with torch.no_grad():
        for b, old in saved:
            if applied is None:
                b.copy_(old)
            else:
                b.copy_(torch.where(_to(applied, b.device), b, old))


def _install_half_update(optimizer: torch.optim.Optimizer, mode: str, seed: int) -> None:
    """The policy's ``update`` rule on ``optimizer`` (:func:`half_update`), once. One that
    ``mp.prepare`` installed (seed 0) takes the step's seed until its first step."""
    held = peek(optimizer, "half_update", None)
    if held is None:
        if mode != "nearest":
            half_update(optimizer, mode, seed=seed)
        return
    held.seed = step_seed(held.mode, held.seed, held.started, mode, seed, "a plain optimizer")


class TrainStep(LoggedStep):
    """``step(batch) -> StepResult``: one optimizer step (one accumulation window) per call.

    Each call runs :func:`unimp.trainstep.run_step` (the algorithm of every backend) over this
    module's :class:`StepOps`, under the policy's ``matmul_precision`` (set with
    :func:`unimp.backends.torch.matmul_precision` for the call, restored after it) and runs
    ``loss_fn(model, micro_batch)`` under the recipe's autocast, backpropagates
    ``loss * scale`` for each micro-batch, divides the window's sum by ``grad_accum_steps``
    and unscales once (as TensorFlow's and JAX's steps take the mean), computes the
    global gradient norm and clips on the UNSCALED gradients (``g * min(1, max_norm / norm)``),
    steps (skipped when the loss or a gradient is non-finite: parameters,
    optimizer state and the model's buffers, e.g. BatchNorm's running statistics and
    ``num_batches_tracked``, stay bitwise unchanged), updates the loss scale with unimp's rule, and
    resets the gradients (to None, i.e. exact zeros, never by subtracting them).

    The result costs two ops a step (one process, a rule torch's fused update follows): its
    ``scale``, flags and skip counters are one packed int32 snapshot, derived when read; in
    ``result.raw`` they stand for 0-d tensors (``item()``, ``bool()``, ``dtype``) and all read
    the device once, together (:meth:`GradScaler.begin_step`).

    Args:
        mp: the bound :class:`MixedPrecision`.
        model, optimizer: as given to (or returned by) :meth:`MixedPrecision.prepare`.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor`` (the unscaled loss).
        options: the step's options (:class:`unimp.trainstep.StepOptions`, validated there),
            as torch reads them. ``grad_accum_steps``: the gradients add up in the
            parameters' gradient dtype (autograd's accumulation), or, when the policy sets
            ``accum_dtype``, in that dtype (each micro-batch's gradient rounded to it and
            added, rounded at every addition), then cast back. ``schedule_counts``:
            ``"applied"`` (default) advances ``scheduler`` only after applied steps, which
            needs ``applied`` on the host (one sync a step, with a scheduler only);
            ``"attempted"`` steps it on every call, with no sync. ``stats_every``: the
            statistics hold each gradient the optimizer holds (named as in
            ``model.named_parameters()``; in module mode the float32 master gradient, under the
            model parameter's name), unscaled and before clipping, at the step's loss scale;
            and the floating outputs of every leaf module (``model.named_modules()`` names;
            ``name.0`` / ``name.key`` for tuple and dict outputs), at scale 1, taken by
            forward hooks registered for that step only: a module called more than once (every
            micro-batch, shared weights) gets the statistics of all its outputs together. They
            are computed on the device; reading ``result.stats`` is the only sync. The other
            steps run exactly the code they run without the option. Under DDP the gradients
            are the all-reduced ones (the same on every rank), the layer outputs each rank's
            own.
        scheduler: a torch LR scheduler, stepped as ``options.schedule_counts`` says.
        skip: how a step is skipped for an optimizer without torch's native amp path
            (:class:`GradScaler`): ``"auto"`` (default) reads the overflow flag on the host
            once before ``optimizer.step()``, as torch.amp does; ``"guard"`` never syncs (a
            copy of the parameters and optimizer state, selected back on the device).
            torch's fused optimizers skip in their kernel either way: with one, and without
            a scheduler on ``"applied"``, a step never syncs.
        compile: ``True`` runs the step (:func:`unimp.trainstep.run_step`: the forward and
            backward passes, the unscale, finite check, clipping, guarded update and
            loss-scale update) as one ``torch.compile``d function (the default inductor
            backend), with no graph break of unimp's and no recompilation as steps are applied
            and skipped; see :meth:`MixedPrecision.train_step`. Known limits: FP8 and
            block-scaled layers compile with graph breaks of their own (the values are the
            eager step's); an optimizer that keeps per-parameter state other than tensors
            (torch's keep none) has that state advanced by a skipped step; and
            ``torch.compiler.is_compiling()`` is one flag per process, so an eager unimp step
            must not run while another thread compiles.

    Raises:
        ValueError: a model on another device type than the bound one, a ``batch`` that is
            not a sequence of ``grad_accum_steps`` micro-batches, a loss that is not a
            scalar, a ``skip`` other than ``"auto"`` / ``"guard"``, or ``compile=True`` with
            an option that needs the host inside the step, or that it would run wrong (a
            policy ``update`` rule, ``accum_dtype`` over micro-batches; named, with the fix).
    """

    def __init__(
        self,
        mp: MixedPrecisionBase,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        *,
        options: StepOptions | None = None,
        scheduler: Any = None,
        skip: str = "auto",
        compile: bool = False,
    ) -> None:
        options = StepOptions() if options is None else options
        check_skip(skip)  # before anything else is checked or built
        self.options = options
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        if compile:
            _check_compile(options, optimizer, scheduler, mp.policy)
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable as loss_fn(model, batch).")
        if scheduler is not None and not hasattr(scheduler, "step"):
            raise TypeError("scheduler must be a torch LR scheduler (with .step()).")
        if mp.mode != "none":
            mp._check_model_device(model)
        self.mp = mp
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scheduler = scheduler
        self.scaler = GradScaler(mp.loss_scale, device=mp.device, skip=skip)
        self.calls = 0  # steps taken: decides the statistics steps, never read from the device
        check_half_state(optimizer)
        _install_half_update(optimizer, mp.policy.update, options.rounding_seed)
        self._compiled = torch.compile(self._traced) if compile else None
        self._warm = False  # a call applied its update: the optimizer holds its lazy state

    def _traced(self, micro: list[Any], saved: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
        """The step's device work, as ``torch.compile`` traces it (no statistics, no log);
        ``saved``: the forward state the caller saved, eagerly, before the call."""
        return run_step_traced(StepOps(self, None), micro, self.options, saved)

    # the step's options, read from the one checked record (StepOptions)
    grad_accum_steps = property(lambda self: self.options.grad_accum_steps)
    max_grad_norm = property(lambda self: self.options.max_grad_norm)
    stats_every = property(lambda self: self.options.stats_every)
    schedule_counts = property(lambda self: self.options.schedule_counts)

    def __call__(self, batch: Any) -> StepResult:
        # the recipe's float32 matmul precision for this call only (restored, also on error);
        # gradients on even when called under torch.no_grad() (an evaluation loop's block), as
        # a training step needs them
        with torch.enable_grad(), matmul_precision(self.mp.policy.matmul_precision):
            if not self.options.stats_step(self.calls):
                result, grad_flags = self._run(batch, None)
            else:
                recorder = _Recorder(self.model, self.options.stats_formats)
                try:
                    result, grad_flags = self._run(batch, recorder)
                finally:
                    recorder.close()
        self.calls += 1
        if self._recorder is not None:
            lr = self.optimizer.param_groups[0].get("lr") if self.optimizer.param_groups else None
            self._recorder.add(
                self.calls - 1, result, lr=lr, batch_finite=all_finite(batch),
                grad_flags=grad_flags,
            )  # fmt: skip
        return result

    def _run(self, batch: Any, recorder: _Recorder | None) -> tuple[StepResult, Any]:
        """One step; returns its result and, when the step logs without statistics, the
        gradients' finite flags (``(names, bool vector)``, else None)."""
        micro = self.options.micro_batches(batch)
        # compiled from the call after the first applied one: the steps up to it run eagerly, as
        # they create the optimizer's lazy state (a skipped one drops it again, on the host), so
        # the compiled graph never changes the state's layout (which would recompile it)
        if self._warm:
            self.scaler.check_replicas()  # once, eagerly (its flag would retrace the step)
            ops = StepOps(self, None)
            saved = ops.save_forward_state()  # selected back on a skip; all of a raising call undone
            try:
                with _tracing_backward(), native_flag(self.optimizer, self.scaler.device):
                    raw = self._compiled(micro, saved)
            except BaseException:
                ops.abort(saved)
                raise
        else:
            raw = run_step(StepOps(self, recorder), micro, self.options)
            self._warm = self._compiled is not None and bool(raw["applied"])  # (a read while warming)
        if "floor_hits" in raw:  # the step's index, named by a floor_action message
            raw["floor_step"] = self.calls
        stats, grad_flags = raw.pop("stats", None), raw.pop("grad_flags", None)
        # the weights changed: autocast keeps its low-precision copies of them for the life of
        # the outermost autocast block, so a step called inside the user's own `with
        # mp.autocast():` would be served the old ones on every later call (NVIDIA/apex#132);
        # outside such a block the cache is already empty (each micro-batch's block cleared it)
        torch.clear_autocast_cache()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None and (self.schedule_counts == "attempted" or bool(raw["applied"])):
            self.scheduler.step()
        sc = self.scaler
        return StepResult(raw, to_host, sc.config, stats=stats, watch=sc.floor_watch), grad_flags

    def state_dict(self) -> dict[str, Any]:
        """unimp's loss-scale state in the portable format (see :meth:`GradScaler.state_dict`)."""
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads a portable (or torch GradScaler) loss-scale state; validated first."""
        self.scaler.load_state_dict(state_dict)


def _check_compile(options: StepOptions, optimizer: torch.optim.Optimizer, scheduler: Any, policy: Any) -> None:
    """Refuses what a compiled step cannot run without host reads inside it, or cannot run
    right, naming the fix.

    Raises:
        ValueError: ``stats_every`` or ``log`` (per-step host bookkeeping: forward hooks, a
            step log), a ``scheduler`` over a Python-float learning rate (each new value
            would recompile the step), a policy ``update`` rule other than ``"nearest"``
            (inductor folds the float32 -> half -> float32 cast pair the rule's rounding
            error is taken from, and the rule's state is replaced, not updated, which the
            compiled guard does not put back on a skipped step), or ``accum_dtype`` with
            ``grad_accum_steps > 1`` (its accumulation does not trace).
    """
    if policy.update != "nearest":
        raise ValueError(
            f"compile=True cannot run the policy's update={policy.update!r}: inductor folds the "
            "float32 -> half -> float32 casts its rounding is measured with (measured, torch 2.13: "
            "the Kahan compensation stays 0), and a skipped step would not put its state back; "
            "use compile=False for this policy."
        )
    if policy.accum_dtype is not None and options.grad_accum_steps > 1:
        raise ValueError(
            f"compile=True cannot accumulate gradients in accum_dtype={policy.accum_dtype!r} over "
            f"grad_accum_steps={options.grad_accum_steps}: that accumulation does not trace; use "
            "compile=False, or a policy without accum (autograd accumulates in the gradients' dtype)."
        )
    if options.stats_every is not None or options.log is not None:
        which = "stats_every" if options.stats_every is not None else "log"
        raise ValueError(
            f"compile=True cannot take {which}=: the statistics and the step log keep per-step "
            f"host bookkeeping (forward hooks, records) that would break the compiled graph; "
            f"drop {which}= from the compiled step, or use compile=False to observe the run."
        )
    if scheduler is not None:
        floats = [i for i, g in enumerate(optimizer.param_groups) if not isinstance(g.get("lr"), torch.Tensor)]
        if floats:
            raise ValueError(
                f"compile=True with a scheduler needs the learning rate as a tensor (param group "
                f"{floats[0]} holds a Python float, and each new value would recompile the "
                "step): build the optimizer with lr=torch.tensor(lr), as torch.compile's "
                "optimizer guide does (on CUDA with fused=True or capturable=True: torch's "
                "foreach kernels take no tensor lr otherwise)."
            )


@contextlib.contextmanager
def _tracing_backward() -> Any:
    """The dynamo options a compiled step runs under, for the call: ``loss.backward()`` traced
    into the step's graph (``trace_autograd_ops``), and a graph break in a nested call
    (``torch.optim``'s step breaks on purpose) resumed where it happened
    (``nested_graph_breaks``), not at the outermost call, which would cut the step into a
    graph per phase. A torch without them (before 2.13) compiles with more graphs."""
    config = torch._dynamo.config
    options = {k: True for k in ("trace_autograd_ops", "nested_graph_breaks") if hasattr(config, k)}
    with config.patch(**options):
        yield


class StepOps:
    """The phases of one step (:class:`unimp.trainstep.StepPrimitives`) for a torch
    :class:`TrainStep`, run eagerly or traced by ``torch.compile`` (``compile=True``: then with
    no statistics recorder): the gradients live in the parameters' ``.grad`` fields,
    so the handle passed between the phases is the optimizer. The loss scaling is the
    :class:`GradScaler`'s, through its public step calls (``begin_step`` ... ``end_step``),
    which decide whether the step is fused (one flag scratch, one report snapshot).
    """

    def __init__(self, step: TrainStep, recorder: _Recorder | None) -> None:
        self.step = step
        self.recorder = recorder
        self.sc = step.scaler
        self.opt = step.optimizer
        self.k = step.options.grad_accum_steps

    def begin(self) -> Any:
        return self.sc.begin_step()

    def save_forward_state(self) -> Any:
        # state the forward pass changes (norm running statistics, num_batches_tracked): kept
        # to be selected back on a skipped step, on the device (pytorch/pytorch#88474)
        return _forward_state(self.step.model)

    def abort(self, saved: Any) -> None:
        # a failed step leaves nothing behind: no partial gradients, no stale loss flag, no
        # half-done unscale_ (the scaler's record of this iteration), the buffers as they were
        self.opt.zero_grad(set_to_none=True)
        self.step.model.zero_grad(set_to_none=True)
        self.sc.abort_step()
        _restore_forward_state(saved, None)

    def gradients(self, micro: list[Any], scale: Any) -> tuple[Any, Any, Any]:
        sc, step = self.sc, self.step
        unscaled = sc.config.unity  # loss * 1 is the loss: backward on it directly
        # a window sums each micro-batch's scaled gradient and divides the sum by k once, as
        # TensorFlow's and JAX's steps do, so a float8 layer's output gradient is the
        # micro-batch's own (at the loss scale) in every backend; its scaling takes one step
        # per window (unimp.fp8.window_merge)
        losses = []
        accum = step.mp.policy.accum_dtype if self.k > 1 else None
        sums: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        # (a window that raises leaves the float8 states as they were)
        with fp8_window(step.model) if self.k > 1 else contextlib.nullcontext():
            for mb in micro:
                with step.mp.autocast():
                    loss = step.loss_fn(step.model, mb)
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise ValueError(
                        f"loss_fn must return a 0-d (scalar) tensor, got "
                        f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}; "
                        "reduce it, e.g. loss.mean()."
                    )
                detached = loss.detach()
                (loss if unscaled else loss * _to(scale, loss.device)).backward()
                sc.record_loss(detached)  # after backward (a fused step's check writes in place)
                losses.append(_to(detached.float(), sc.device))
                if accum is not None:
                    _accumulate(step.model, sums, to_dtype(accum))
        if self.k > 1:
            _window_mean(sums, self.k)
            _divide(param_grads(self.opt), {id(p) for p, _ in sums.values()}, self.k)
        mean_loss = losses[0] if self.k == 1 else torch.stack(losses).mean()
        # the loss flag (a fused step's is in its report, from apply)
        return self.opt, mean_loss, sc.loss_finite

    def unscale(self, grads: Any, scale: Any) -> Any:
        self.sc.unscale_(grads)
        return grads

    def observe(self, grads: Any, scale: Any) -> dict[str, Any]:
        step = self.step
        if self.recorder is not None:  # unscaled, before clipping, at the step's scale
            scale32 = scale.clone()  # a fused step's scale is the state, which the update changes
            formats = self.recorder.formats
            grad_stats = _gradient_stats(grads, _param_names(step.model, grads), scale32, formats)
            return {"stats": _pending(step.calls, scale32, grad_stats, self.recorder.entries, formats)}
        if step._recorder is not None:  # logged: which gradient went non-finite first
            return {"grad_flags": _grad_flags(grads, _param_names(step.model, grads), self.sc.device)}
        return {}

    def finite(self, grads: Any, scale: Any) -> tuple[Any, Any]:
        # computed by unscale_'s kernel; a fused step's flag is reported by the update
        fused = self.sc.loss_finite is None
        return grads, (None if fused else self.sc.found_inf(grads) == 0)

    def global_norm(self, grads: Any, grads_finite: Any) -> tuple[Any, Any]:
        sc = self.sc
        pairs = param_grads(grads)
        self.rescale = _rescale_([g for _, g in pairs], sc.device)  # exact; the clip undoes it
        # a sparse gradient's norm is that of its coalesced values (duplicate indices add
        # up first: pytorch/pytorch#35810 kind); scaling the uncoalesced values is the same
        values = [p.grad.coalesce()._values() if p.grad.is_sparse else g for p, g in pairs]
        self.scaled_norm = _global_norm(values, sc.device)  # of g * s
        norm = self.scaled_norm / self.rescale
        # a norm beyond float32 is a non-finite gradient: the flag the update and report read
        sc.mark_non_finite(grads, torch.isfinite(norm).logical_not())
        return norm, (None if grads_finite is None else sc.found_inf(grads) == 0)

    def clip(self, grads: Any, norm: Any, max_norm: float) -> Any:
        # (g * s) * (max_norm / (norm * s)) where clipping, (g * s) / s (exact) elsewhere:
        # the factor stays in float32's normal range (unimp.trainstep.NORM_RESCALE_ABOVE)
        coef = torch.where(norm > max_norm, max_norm / self.scaled_norm, 1.0 / self.rescale)
        groups: dict[torch.device, list[torch.Tensor]] = {}
        for _, g in param_grads(grads):
            groups.setdefault(g.device, []).append(g)
        for dev, gs in groups.items():
            torch._foreach_mul_(gs, _to(coef, dev))
        return grads

    def apply(self, grads: Any, grads_finite: Any, loss_finite: Any) -> Any:
        return self.sc.apply_step(grads)

    def restore_forward_state(self, saved: Any, applied: Any) -> None:
        if saved and not isinstance(applied, torch.Tensor):  # a fused step's report field
            applied = self.sc.applied_tensor()
        _restore_forward_state(saved, applied)

    def params_finite(self) -> Any:
        # the optimizer's half-precision parameters (float32 masters are not): none, no op
        # (an empty parameter is finite, and _foreach_norm refuses it; loops, not a
        # comprehension: dynamo cannot trace one here, after the optimizer's graph break)
        half = []
        for g in self.opt.param_groups:
            for p in g["params"]:
                if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16) and p.numel():
                    half.append(p)
        if not half:
            return None
        # the largest magnitude per tensor (NaN and inf stay themselves, one fused op), then
        # one finite test per device and dtype: a constant number of ops, not one per tensor
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for peak in torch._foreach_norm(half, float("inf")):
            groups.setdefault((peak.device, peak.dtype), []).append(peak)
        flags = [torch.isfinite(torch.stack(g)).all() for g in groups.values()]
        return flags[0] if len(flags) == 1 else torch.stack([_to(f, flags[0].device) for f in flags]).all()

    def update_scale(self, grads_finite: Any, loss_finite: Any) -> dict[str, Any]:
        fields, extra = self.sc.end_step(grads_finite, loss_finite)
        # the step's index is added on the host (TrainStep._run), as TensorFlow and JAX do: a
        # Python int read in a compiled graph would recompile it on every call
        return {**fields, **floor_hits(self.sc.config, extra)}


def _window_mean(sums: dict[int, tuple[torch.nn.Parameter, torch.Tensor]], k: int) -> None:
    """The window's running sums in the policy's ``accum_dtype``, divided by ``k`` in float32
    and put back in each gradient's dtype (TensorFlow and JAX take the mean of their sums in
    float32 too)."""
    for param, total in sums.values():
        param.grad = (total.float() / k).to(param.dtype)


def _divide(pairs: list[tuple[torch.nn.Parameter, torch.Tensor]], done: set[int], k: int) -> None:
    """The gradients autograd summed over the window (in the parameters' dtype), divided by
    ``k`` in place, once per device and dtype; those in ``done`` already were."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p, g in pairs:
        if id(p) not in done:
            groups.setdefault((g.device, g.dtype), []).append(g)
    for grads in groups.values():
        torch._foreach_div_(grads, float(k))


def _accumulate(
    model: torch.nn.Module, sums: dict[int, tuple[torch.nn.Parameter, torch.Tensor]], dtype: torch.dtype
) -> None:
    """Moves each dense gradient of ``model`` into its running sum in ``dtype`` (the policy's
    ``accum_dtype``): ``sum = sum + grad.to(dtype)``, rounded to ``dtype`` at every addition
    (the first micro-batch's gradient is the sum of exact zeros and itself), and clears it.
    Sparse gradients stay with autograd's accumulation."""
    for p in model.parameters():
        g = p.grad
        if g is None or g.is_sparse:
            continue
        g = g.to(dtype)
        entry = sums.get(id(p))
        sums[id(p)] = (p, g if entry is None else entry[1] + g)
        p.grad = None
