"""torch :class:`MixedPrecision`: a recipe bound to torch (autocast or module mode, ``prepare``,
``train_step``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from unimp.attached import attach, check_attachable, peek
from unimp.backends._base import MixedPrecisionBase
from unimp.backends.torch.blockscale import block_swap
from unimp.backends.torch.casting import (
    _NORM_LAYERS,
    _checkpoint_masters,
    _MasterWeights,
    cast_tree,
    to_dtype,
)
from unimp.backends.torch.devices import _as_device, _dtype_ok
from unimp.backends.torch.fp8 import FP8Dense, fp8_select, fp8_swap
from unimp.backends.torch.optimizer import check_half_state, half_update
from unimp.backends.torch.overrides import apply_overrides, cast_module, resolve
from unimp.backends.torch.precision import matmul_precision
from unimp.backends.torch.scaling import GradScaler, to_host
from unimp.backends.torch.step import TrainStep
from unimp.registry import resolve_cast_mode
from unimp.step import check_scaled_half_params
from unimp.steprecorder import with_log
from unimp.trainstep import StepOptions


def _prepared_forward(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a prepared model: inputs cast (module mode) or autocast around the
    original forward, floating outputs cast to the output dtype."""
    mp = model._unimp.mp
    forward = model._unimp.forward
    if mp._mode == "module":
        args, kwargs = mp.cast_to_compute(args), mp.cast_to_compute(kwargs)
        out = forward(*args, **kwargs)
    else:
        with mp.autocast():
            out = forward(*args, **kwargs)
    return mp.cast_to_output(out)


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Any:
    """Enters ``first`` then ``second`` when the block starts, and leaves them in reverse."""
    with first, second:
        yield


class _PreparedForward:
    """``model.forward`` after ``prepare``: holds the model, so ``copy.deepcopy`` (an EMA copy)
    and pickling carry it with the model instead of a closure over the original."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _prepared_forward(self.model, *args, **kwargs)


class MixedPrecision(MixedPrecisionBase):
    """A recipe bound to PyTorch and a device.

    Args:
        recipe: a :class:`~unimp.Recipe` or anything :func:`~unimp.get_recipe` accepts.
        device: where the model runs (``"cuda"``, ``"cuda:1"``, ``"cpu"``, a ``torch.device``);
            default the current accelerator, else the CPU.

    Cast modes: ``autocast`` (and ``auto``) runs the forward under ``torch.autocast(device_type,
    dtype=compute)``; ``module`` casts the model to the compute dtype, keeps normalization layers
    float32, casts floating inputs at the model boundary and keeps float32 master weights in the
    optimizer (Apex O2). Recipes whose parameters are half (``"bf16-true"``, O3) run in module
    mode. In every mode the model's floating outputs are cast to the output dtype.

    Raises:
        ValueError: the device cannot run the compute dtype (e.g. bfloat16 on a pre-Ampere
            GPU, or a dtype torch's autocast disables on that device), never a silent
            fallback to float32. A disabled or float32 recipe is a no-op on any device.

    Example:
        >>> mp = MixedPrecision("mixed_float16", device="cpu")
        >>> mp.mode, mp.compute_dtype
        ('autocast', torch.float16)
    """

    _cast_tree = staticmethod(cast_tree)

    backend = "torch"

    def __init__(self, recipe: Any = "mixed_float16", device: Any = None) -> None:
        super().__init__(recipe)
        self._device = _as_device(device)
        policy = self.policy
        self.param_dtype = to_dtype(policy.param_dtype)
        self.compute_dtype = to_dtype(policy.compute_dtype)
        self.output_dtype = to_dtype(policy.output_dtype)
        mode = resolve_cast_mode(self.recipe, "torch")
        # a float32 model with half overrides: autocast only inside the overridden modules
        f32_base = policy.param_dtype == policy.compute_dtype == "float32"
        if mode == "autocast" and not (policy.is_mixed or f32_base):
            raise ValueError(
                f"cast_mode='autocast' needs half compute with wider parameters; policy {policy} "
                "is not mixed: use cast_mode='module' or 'auto'."
            )
        self._mode = mode
        for pattern, o in policy.overrides:
            if mode == "autocast" and o.param_dtype != policy.param_dtype:
                raise ValueError(
                    f"Policy.overrides[{pattern!r}] keeps parameters in {o.param_dtype}, but in autocast "
                    f"mode every parameter stays {policy.param_dtype}: give the override a dtype "
                    "(compute and output), or use cast_mode='module'."
                )
        if mode != "none":
            checks = {(self.compute_dtype, mode == "autocast"), (self.param_dtype, False)}
            checks |= {(to_dtype(o.compute_dtype), mode == "autocast" and o.is_mixed) for _, o in policy.overrides}
            for dt, in_autocast in checks:
                if dt == torch.float32 and in_autocast:
                    continue  # a float32 model's autocast is off outside the overridden modules
                why = _dtype_ok(self._device, dt, autocast=in_autocast)
                if why:
                    raise ValueError(f"recipe {policy} cannot run on {self._device}: {why}.")

    @property
    def device(self) -> torch.device:
        """The bound device."""
        return self._device

    @property
    def mode(self) -> str:
        """``"autocast"``, ``"module"`` or ``"none"`` (a float32 recipe: nothing to cast)."""
        return self._mode

    def autocast(self) -> contextlib.AbstractContextManager:
        """``torch.autocast(device_type, dtype=compute)`` in autocast mode (a half compute dtype),
        else a no-op context; with the policy's ``matmul_precision`` set for the block (restored
        after it)."""
        precision = self.policy.matmul_precision
        if self._mode != "autocast" or self.compute_dtype == torch.float32:
            return matmul_precision(precision) if precision else contextlib.nullcontext()
        if precision is None:
            return torch.autocast(self._device.type, dtype=self.compute_dtype)
        return _both(matmul_precision(precision), torch.autocast(self._device.type, dtype=self.compute_dtype))

    def grad_scaler(self, skip: str = "auto") -> GradScaler:
        """A :class:`GradScaler` for the recipe's loss scale on the bound device (``skip`` as
        there: how an optimizer without torch's native amp path skips a step)."""
        return GradScaler(self.loss_scale, device=self._device, skip=skip)

    # -- prepare

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Applies the recipe to a model (and its optimizer), in place.

        * autocast mode: ``model.forward`` runs under :meth:`autocast`.
        * module mode: the model is cast to the compute dtype except normalization layers
          (float32, their inputs cast up and outputs back down), floating inputs are cast to the
          compute dtype, and the optimizer's parameters are replaced by float32 master copies
          (moved optimizer state included); gradients flow model -> master before unscaling or
          ``optimizer.step()``, and new values master -> model after it (Apex O2). Clip
          :func:`master_params`. ``model.state_dict()`` holds the float32 master values and
          ``model.load_state_dict()`` sets the masters, so checkpoints lose nothing.
        * every mode: the model's floating outputs are cast to the output dtype, and each module
          the policy's ``overrides`` cover runs under its override policy
          (:mod:`unimp.backends.torch.overrides`): autocast to its dtype, or autocast off with
          inputs cast (a float32 override), or held in its dtype (module mode).
        * an FP8 recipe: the ``nn.Linear`` modules it selects (:meth:`fp8_layers`; the first
          and last out by default) are replaced by :class:`unimp.backends.torch.FP8Dense`
          modules sharing their Parameters (the optimizer's references stay valid), emulated
          float8 matmuls with float32 scaling states (buffers, in ``state_dict``).
        * a block-scaled recipe (``mxfp8``, ``fp8-block``, ``nvfp4``, ``mxfp4``): the
          ``nn.Linear`` modules it selects (the same first/last rule) are replaced by
          :class:`unimp.backends.torch.blockscale.BlockScaledLinear` modules sharing their
          Parameters (:func:`unimp.backends.torch.blockscale.block_swap`).

        A float32 recipe returns the model (and optimizer) untouched.

        Args:
            model: a ``torch.nn.Module`` on the bound device.
            optimizer: its optimizer; required in module mode with float32 master weights.

        Returns:
            ``model``, or ``(model, optimizer)`` when an optimizer is given (as Apex's
            ``amp.initialize``): the shape of every backend's ``prepare``.

        Raises:
            TypeError: not a Module / Optimizer, or one with an attribute ``_unimp`` of its own
                (:mod:`unimp.attached`).
            ValueError: the model was already prepared; an override conflict (two patterns give
                one module different policies); its parameters are on another device type
                than the bound device (autocast would silently leave it in float32); module mode
                without the optimizer; or
                loss scaling is on and a float16 parameter would receive float16 gradients
                (names the parameters; torch's GradScaler only fails at the first unscale).
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"prepare() needs a torch.nn.Module, got {type(model).__name__}.")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        check_attachable(model)  # where unimp keeps its facts: refused before anything changes
        if optimizer is not None:
            check_attachable(optimizer)
        if peek(model, "prepared", False):
            raise ValueError("this model was already prepared; prepare() applies the recipe once.")
        out = model if optimizer is None else (model, optimizer)
        if self._mode == "none":
            return out
        self._check_model_device(model)
        overridden = resolve(self.policy, model)  # warns / raises before anything changes
        module_masters = self._mode == "module" and self.param_dtype != self.compute_dtype
        if module_masters and optimizer is None:
            raise ValueError(
                "cast_mode='module' keeps float32 master weights in the optimizer: call "
                "mp.prepare(model, optimizer)."
            )
        names = {id(p): n for n, p in model.named_parameters()}
        # validate before changing anything
        if not self.loss_scale.unity:
            pure_f16 = self._mode == "module" and not module_masters and self.param_dtype == torch.float16
            will_be_f16 = [n for n, p in model.named_parameters() if p.requires_grad] if pure_f16 else []
            held = [] if module_masters else (
                [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else list(model.parameters())
            )
            f16 = [names.get(id(p), "?") for p in held if p.requires_grad and p.dtype == torch.float16]
            check_scaled_half_params([*f16, *will_be_f16], self.loss_scale, "model.float()")
        if self._recipe.fp8 is not None:
            fp8_swap(model, self._recipe.fp8)
        if self._recipe.block is not None:
            block_swap(model, self._recipe.block)
        if module_masters:
            f32_values = self._to_module_mode(model, overridden)
            pairs = []
            moved = {}
            for group in optimizer.param_groups:
                new = []
                for p in group["params"]:
                    # held in the compute dtype or a half override's: a float32 master
                    if p.is_floating_point() and p.dtype != self.param_dtype:
                        start = f32_values.get(id(p), p.detach())  # exact, not rounded through half
                        master = torch.nn.Parameter(start.to(self.param_dtype).clone(), requires_grad=p.requires_grad)
                        pairs.append((p, master))
                        if p in optimizer.state:
                            moved[master] = optimizer.state.pop(p)
                        names[id(master)] = names.get(id(p), "?") + " (master)"
                        new.append(master)
                    else:
                        new.append(p)
                group["params"] = new
            optimizer.state.update(moved)
            attach(optimizer).master = _MasterWeights(optimizer, pairs)
            _checkpoint_masters(model, names, pairs)
        elif self._mode == "module":
            model.to(self.param_dtype)
            for name, o in overridden.items():
                cast_module(model.get_submodule(name), to_dtype(o.compute_dtype))
            for m in model.modules():  # the float8 scaling states stay float32
                if isinstance(m, FP8Dense):
                    for name, b in m.named_buffers(recurse=False):
                        setattr(m, name, b.float())
        apply_overrides(self, model, overridden)
        if optimizer is not None:
            attach(optimizer).names = names
        self._wrap_forward(model)
        attach(model).prepared = True
        if optimizer is not None:
            check_half_state(optimizer)
            if self.policy.update != "nearest":  # Kahan / stochastic updates of half parameters
                half_update(optimizer, self.policy.update)
        return out

    def fp8_layers(self, model: torch.nn.Module) -> tuple[str, ...]:
        """The dotted paths of the layers that run float8 matmuls under the recipe (after
        :meth:`prepare`, the FP8Dense modules it put in; before, those it would), in model
        order; a block-scaled recipe's layers under one; ``()`` without an FP8 or block-scaled
        recipe. The same rule and names in every backend
        (:meth:`unimp.fp8.recipe.FP8Recipe.select`; first and last Linear out by default).

        Raises:
            TypeError: ``model`` is not a ``torch.nn.Module``.
            ValueError: a selected module shared by several paths (named).
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"mp.fp8_layers(model) takes a torch.nn.Module, got {type(model).__name__}.")
        recipe = self._recipe.fp8 if self._recipe.fp8 is not None else self._recipe.block
        if recipe is None:
            return ()
        return fp8_select(model, recipe)

    def _check_model_device(self, model: torch.nn.Module) -> None:
        """Autocast for one device type leaves ops on another in float32: refuse a model whose
        parameters live on another device type than the bound one, instead of a silent
        float32 run."""
        wrong = sorted({str(p.device) for p in model.parameters() if p.device.type != self._device.type})
        if wrong:
            raise ValueError(
                f"the model has parameters on {', '.join(wrong)} but the recipe is bound to "
                f"{self._device}: move the model (model.to({str(self._device)!r})) or bind the "
                f"recipe to its device (unimp.mixed_precision(..., device={wrong[0]!r}))."
            )

    def _to_module_mode(self, model: torch.nn.Module, overridden: dict[str, Any]) -> dict[int, torch.Tensor]:
        """Casts the model to the compute dtype with float32 normalization layers and the
        overridden modules in their override's compute dtype; returns the parameters' values
        from before the cast (by ``id``), from which the masters start."""
        before = {id(p): p.detach().clone() for p in model.parameters()}
        kept = {name: model.get_submodule(name) for name in overridden}
        inside_kept = {id(sub) for m in kept.values() for sub in m.modules()}
        norms = [m for m in model.modules() if isinstance(m, _NORM_LAYERS) and id(m) not in inside_kept]
        inside_norm = {id(sub) for m in norms for sub in m.modules()} | inside_kept
        for name, m in kept.items():
            cast_module(m, to_dtype(overridden[name].compute_dtype))
        with torch.no_grad():
            # module by module: a normalization layer's parameters and statistics are never
            # rounded through the compute dtype (casting the whole model to float16 and the norm
            # layers back, as before, turned a running_var of 1e5 into inf: NVIDIA/apex#144 kind)
            for m in model.modules():
                if id(m) in inside_norm:
                    continue
                buffers = () if isinstance(m, FP8Dense) else m.buffers(recurse=False)  # float8 states stay float32
                for t in (*m.parameters(recurse=False), *buffers):
                    if t.is_floating_point() and t.dtype != self.compute_dtype:
                        t.data = t.data.to(self.compute_dtype)
        for m in norms:
            m.float()  # a no-op for float32 layers: their values stay bitwise as they were
            m.register_forward_pre_hook(lambda mod, args: cast_tree(args, torch.float32))
            m.register_forward_hook(lambda mod, args, out: cast_tree(out, self.compute_dtype))
        return before

    def _wrap_forward(self, model: torch.nn.Module) -> None:
        # an object holding the model, not a closure over it: copy.deepcopy (an EMA copy of
        # the model) and pickle carry it with the copy, where a closure ran the original model
        attach(model).forward = model.forward
        attach(model).mp = self
        model.forward = _PreparedForward(model)  # type: ignore[method-assign]

    # -- train step

    def train_step(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        *,
        grad_accum_steps: int = 1,
        max_grad_norm: float | None = None,
        scheduler: Any = None,
        schedule_counts: str = "applied",
        stats_every: int | None = None,
        log: Any = None,
        log_every: int = 100,
        rounding_seed: int = 0,
        stats_formats: Any = (),
        skip: str = "auto",
        compile: bool = False,
    ) -> TrainStep:
        """A training step following unimp's rules; see :class:`TrainStep`.

        ``skip``: how a skipped step is made for an optimizer without torch's native amp path
        (:class:`GradScaler`): ``"auto"``, one host read of the overflow flag before
        ``optimizer.step()`` as torch.amp does (torch's fused optimizers never sync), or
        ``"guard"``, no sync, at the cost of a copy of the parameters and optimizer state.

        ``compile=True``: the whole step (forward and backward under autocast, unscale, finite
        check, clipping, the guarded update and the loss-scale update) is one
        ``torch.compile``d function (the default inductor backend): nothing in it reads the
        device on the host, so unimp adds no graph break (the graphs are those torch itself
        cuts: ``torch.optim``'s step breaks on purpose before and after its update, a fused
        optimizer runs outside the compiler) and applied and skipped steps run the same graphs
        with no recompilation. The calls up to the first applied one run eagerly (they create
        the optimizer's lazy state; one host read of ``applied`` each). Inside the graph a skip is always decided on the device (``skip`` is then
        ``"guard"`` for an optimizer without torch's native amp path; the compiler fuses the
        copy and select into the update), and the loss-scale update is the reference rule,
        the same values bit for bit. Refused (``ValueError``, naming the fix): ``stats_every``
        and ``log`` (per-step host bookkeeping), and a ``scheduler`` over a Python-float
        learning rate (each value would recompile; pass ``lr=torch.tensor(lr)``). Needs what
        torch.compile needs (a C++ compiler for inductor on a CPU); torch 2.13 traces the
        backward into the graph (``torch._dynamo.config.trace_autograd_ops``, set for the
        call), an older torch breaks the graph there.

        ``grad_accum_steps``, ``max_grad_norm``, ``stats_every``, ``schedule_counts``, ``log``,
        ``log_every``, ``rounding_seed`` and ``stats_formats`` are the options every backend
        takes, validated and documented once by :class:`unimp.trainstep.StepOptions`
        (``stats_every=k``: tensor statistics of the gradients and layer outputs in the results
        of steps 0, k, 2k, ..., with ``stats_formats`` their quantization error in block-scaled
        formats; ``log=path``: a step log, ``docs/steplog.md``). ``schedule_counts``: what a skipped step does to
        ``scheduler``. The policy's ``overrides`` are applied to a model that :meth:`prepare`
        did not see.
        """
        options = StepOptions(
            grad_accum_steps, max_grad_norm, stats_every, schedule_counts, log, log_every, rounding_seed,
            stats_formats=stats_formats,
        )
        if self.policy.overrides and self._mode != "none" and not peek(model, "overrides", False):
            apply_overrides(self, model)  # a model not prepared still runs its overrides
        step = TrainStep(
            self, model, optimizer, loss_fn, options=options, scheduler=scheduler, skip=skip, compile=compile
        )
        return with_log(step, self, log, options.log_every, step.scaler.config, to_host)
