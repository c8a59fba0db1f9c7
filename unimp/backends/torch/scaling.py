"""torch loss scaling: :class:`GradScaler`, a drop-in for ``torch.amp.GradScaler`` running unimp's
rule on device tensors (torch's fused kernel where it is the rule bit for bit,
:func:`unimp.loss_scale.update_arrays` elsewhere), with replica agreement over ``torch.distributed``.

The rule's array namespace over torch tensors is :class:`LossScaleOps`, as in every backend's
``scaling`` module. The fused update (below) is torch's alone, inside :meth:`GradScaler.update`:
The loss-scale update on device tensors: :class:`LossScaleOps`, the array namespace that
:func:`unimp.loss_scale.update_arrays` (the reference) runs on, and the fused path, the rule in
as few torch ops as the common configs allow: torch's ``torch._amp_update_scale_`` plus a
clamp, and the skip counters in place.

The reference stays the path for the configs the fused one cannot follow bit for bit (see
:func:`fused_rule`).

torch only, on purpose: torch runs eagerly, one kernel launch per op, so the rule's ~17 small
ops cost a step real time unless a fused kernel does them; TensorFlow and JAX run the same
:func:`~unimp.loss_scale.update_arrays` inside a traced graph / one XLA program, which fuses it
already, so their ``scaling`` modules need no such path. Everything in it runs on the
device, in place (tensors handed out earlier and CUDA graphs see the new values), with no host
sync.

Why ``_amp_update_scale_`` (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp and
cuda/AmpKernels.cu, ``amp_update_scale_cuda_kernel``) equals the reference for these configs:

* it takes the factors as float64 and multiplies the float32 scale by them in float64, then
  rounds to float32. Given the float32 factor (``float(np.float32(f))``), the float64 product of
  two float32 numbers is exact (48 significant bits), so the one rounding gives the correctly
  rounded float32 product: the reference's ``scale * f32(factor)``. (The config already holds
  float32-rounded factors; with 1.1 unrounded, 3 * 1.1 would give 3.3 instead of 3.3000002.)
* overflow (``found_inf`` nonzero): ``scale * backoff``, counter 0; else the counter counts and,
  on reaching ``growth_interval`` (``==``; the reference's ``>=`` is the same because a valid
  state keeps ``counter < growth_interval``), the scale grows unless the product is inf, and
  the counter restarts at 0.
* the reference floors a backoff at ``min_scale`` and caps a growth at ``max_scale``: one
  ``clamp_`` after the kernel does both, because a valid state keeps the scale inside
  ``[floor, max_scale]`` (every load and override is validated), so the clamp changes nothing
  on the other branches. With a ``max_scale`` the reference caps an inf growth at ``max_scale``
  where torch keeps the scale: the fused path is used only where ``max_scale * growth_factor``
  is finite in float32, so no growth from a scale ``<= max_scale`` is inf.
* a non-finite loss (forward overflow) must leave scale and counter alone: ``found_inf`` is
  then 0 and the counter is first lowered by 1, so the kernel's ``+1`` restores it and it never
  reaches ``growth_interval`` (it is below it before).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from unimp import loss_scale as _ls
from unimp.attached import peek
from unimp.backends.torch.casting import _leaves, _map_tree
from unimp.backends.torch.devices import _as_device, _to
from unimp.backends.torch.optimizer import (
    _IN_STEP,
    _param_names,
    _stepping,
    guarded_step,
    param_grads,
)
from unimp.backends.torch.overflow import (
    _check_loss,
    all_finite,
    check_replicas_agree,
    flags_from_bools,
    reduce_step_flags,
)
from unimp.dtypes import finfo
from unimp.loss_scale import (
    EXTRA_FIELDS,
    DynamicLossScale,
    FloorWatch,
    LossScaleConfig,
    LossScaleState,
    loss_scale_from_dict,
    skip_counts,
    tracks_extra,
    update_arrays,
)
from unimp.loss_scale.portable import check_scale_value

_F32 = finfo("float32")


_READY, _UNSCALED, _STEPPED = 0, 1, 2

# ---------------------------------------------------------------------- misuse, named at run time
# The mistakes of seed 000's loop and their silent variants (issue 30): stepping an optimizer
# on gradients still multiplied by the scale, a scaled backward through a graph already freed.

class _Pending:
    """A scaler's scaled backward passes since its last ``update()``: the roots of their graphs
    (kept until then; their saved tensors are already freed), the leaves they reach (walked
    once, when a step needs them) and the parameters the scaler has unscaled since."""

    __slots__ = ("roots", "reached", "unscaled")

    def __init__(self) -> None:
        self.roots: list[Any] = []
        self.reached: set[int] | None = None
        self.unscaled: set[int] = set()

    def reached_ids(self) -> set[int]:
        """``id`` of every leaf tensor (parameter) the pending scaled losses reach."""
        if self.reached is None:
            seen, out, stack = set(), set(), list(self.roots)
            while stack:
                node = stack.pop()
                if node is None or id(node) in seen:
                    continue
                seen.add(id(node))
                var = getattr(node, "variable", None)  # AccumulateGrad: a leaf
                if var is not None:
                    out.add(id(var))
                stack.extend(f for f, _ in node.next_functions)
            self.reached = out
        return self.reached


#: scalers whose scaled loss was backpropagated since their last update()
_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HOOK: list[Any] = []  # the global optimizer step pre-hook, registered at the first scale()


def _check_unscaled_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global optimizer step pre-hook: refuses ``optimizer.step()`` on gradients a
    scaled backward produced and nobody unscaled (the step would apply them times the scale,
    65536 by default): parameters of this optimizer that a pending scaled loss reaches, that
    hold a gradient, and that the scaler has not unscaled since. One dict lookup per step
    while no scaled backward is pending; an optimizer whose parameters the scaled losses do
    not reach (another model's, a GAN's other half) is never refused."""
    if not _PENDING or getattr(_IN_STEP, "active", False) or torch.compiler.is_compiling():
        return  # (a compiled step: the autograd graph walk cannot be traced; see scale())
    for sc, pending in list(_PENDING.items()):
        st = sc._per_opt.get(id(optimizer))
        if st is not None and st["stage"] != _READY:
            continue  # unscaled (or stepped) by this scaler since its last update
        held = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not held or all(id(p) in pending.unscaled for p in held):
            continue  # nothing to step, or unscaled through another optimizer (a wrapper's)
        reached = pending.reached_ids()
        if any(id(p) in reached and id(p) not in pending.unscaled for p in held):
            raise RuntimeError(
                f"optimizer.step() on gradients still multiplied by the loss scale "
                f"({float(sc._scale.item()):g}): scaler.scale(loss).backward() produced them. Call "
                "scaler.step(optimizer) (it unscales, skips on inf/NaN and steps), then "
                "scaler.update(); or scaler.unscale_(optimizer) before optimizer.step(). (A scaled "
                "backward stays pending until scaler.update(): call it to drop one left behind.)"
            )


def _mark_pending(scaler: GradScaler, scaled: Any) -> None:
    """Records the graph of each scaled loss once the backward pass reaches it."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check_unscaled_step))
    ref = weakref.ref(scaler)
    for t in _leaves(scaled):
        if not t.requires_grad:
            continue
        root = t.grad_fn

        def reached(grad: torch.Tensor, root: Any = root) -> None:
            sc = ref()
            if sc is not None:
                pending = _PENDING.setdefault(sc, _Pending())
                pending.roots.append(root)
                pending.reached = None

        t.register_hook(reached)


#: per autograd node type: the names of its saved tensors (looked up once per type)
_SAVED: dict[type, tuple[str, ...]] = {}


def _freed_graph(loss: torch.Tensor) -> str | None:
    """autograd's own message when ``loss``'s graph was already backpropagated (its saved
    tensors freed: ``loss.backward()`` ran on it), else None.

    Looks at the first few nodes that save tensors, through ``_raw_saved_*``'s ``data``, which
    is the stored tensor (None once freed) and never runs a saved-tensor unpack hook (CPU
    offloading, checkpointing): a live graph costs a few attribute reads and no copy."""
    node, seen = loss.grad_fn, 0
    while node is not None and seen < 4:
        seen += 1
        names = _SAVED.get(type(node))
        if names is None:
            names = _SAVED[type(node)] = tuple(
                n[len("_raw_saved_"):] for n in dir(node) if n.startswith("_raw_saved_")
            )
        empty = None
        for name in names:
            try:
                raw = getattr(node, "_raw_saved_" + name)
                data = raw.data if hasattr(raw, "data") else None
            except RuntimeError:
                return None  # not a tensor slot this version can read: assume alive
            if data is not None:
                return None  # a saved tensor still held: the graph is alive
            empty = empty or name
        if empty is not None:
            try:  # None everywhere: freed, or optional tensors that were None (alive, no unpack)
                getattr(node, "_saved_" + empty)
            except RuntimeError as e:
                return str(e).split("\n")[0]
            return None
        nxt = [f for f, _ in node.next_functions if f is not None]
        node = nxt[0] if nxt else None
    return None



# ------------------------------------------------------------------ the rule and the fused update


class LossScaleOps:
    """The array namespace :func:`unimp.loss_scale.update_arrays` runs on: device tensors.

    Constants are made once per value and cached, so an update issues no host-to-device copy
    after the first one.
    """

    where = staticmethod(torch.where)
    minimum = staticmethod(torch.minimum)
    maximum = staticmethod(torch.maximum)
    isfinite = staticmethod(torch.isfinite)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cache: dict[tuple[Any, torch.dtype], torch.Tensor] = {}

    def _const(self, x: Any, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x.to(dtype)
        if torch.compiler.is_compiling():  # a constant of the graph: costs no copy, changes no cache
            return torch.tensor(x, dtype=dtype, device=self.device)
        key = (x, dtype)
        if key not in self._cache:
            self._cache[key] = torch.tensor(x, dtype=dtype, device=self.device)
        return self._cache[key]

    def f32(self, x: Any) -> torch.Tensor:
        return self._const(float(x) if not isinstance(x, torch.Tensor) else x, torch.float32)

    def f64(self, x: Any) -> torch.Tensor:
        return self._const(float(x), torch.float64)

    def i32(self, x: Any) -> torch.Tensor:
        return self._const(int(x) if not isinstance(x, torch.Tensor) else x, torch.int32)

    @property
    def true(self) -> torch.Tensor:
        """A cached 0-d ``True`` on the device (the loss-finite flag's start value)."""
        return self._const(True, torch.bool)


@functools.lru_cache(maxsize=64)
def fused_rule(config: LossScaleConfig) -> bool:
    """True where :func:`update_in_place` equals :func:`unimp.loss_scale.update_arrays` bit for
    bit: every static config, and dynamic ones without the extra fields' rule (hysteresis, overflow
    tolerance, floor action), without ``delayed_first_growth``, and whose ``max_scale`` (if
    any) times the growth factor is finite in float32.

    Asked on every step: the answer is cached per config (configs are frozen dataclasses)."""
    if not config.dynamic:
        return True
    if tracks_extra(config) or config.delayed_first_growth:
        return False
    if config.max_scale is not None:
        with np.errstate(over="ignore"):
            return bool(np.isfinite(np.float32(config.max_scale) * np.float32(config.growth_factor)))
    return True


def _f32(x: float) -> float:
    """``x`` rounded to float32, as a Python float (what the reference multiplies with)."""
    return float(np.float32(x))


@functools.lru_cache(maxsize=64)
def _kernel_args(config: LossScaleConfig) -> tuple[float, float, int, float, float | None]:
    """``(growth, backoff, interval, floor, max_scale)`` as the fused path passes them: the
    factors and bounds rounded to float32, once per config rather than on every step."""
    hi = None if config.max_scale is None else _f32(config.max_scale)
    return (
        _f32(config.growth_factor), _f32(config.backoff_factor), int(config.growth_interval),
        _f32(config.floor), hi,
    )  # fmt: skip


def update_in_place(
    config: LossScaleConfig,
    scale: torch.Tensor,
    counter: torch.Tensor,
    skips: torch.Tensor,
    consecutive: torch.Tensor,
    *,
    loss_inf: torch.Tensor | None,
    overflow: torch.Tensor | None,
    skipped: torch.Tensor,
    skipped_one: torch.Tensor | None = None,
) -> None:
    """One step of the rule, in place, for a config :func:`fused_rule` accepts.

    Args:
        config: the loss-scale config (static in the call).
        scale: float32 0-d; counter: int32 0-d; skips: int32 ``[consecutive_skips,
            total_skips]`` (the state, changed in place; one tensor, so each counter op and the
            snapshot serve both); consecutive: the 0-d view ``skips[0]`` (made once by the caller:
            indexing is an op too).
        loss_inf: bool or int32 0-d, 1 (True) when the loss was not finite.
        overflow: float32 0-d, nonzero when the loss was finite and a gradient was not (the
            step that backs off).
        skipped: bool or int32 0-d, 1 (True) when the step was skipped (non-finite loss or
            gradients).
        skipped_one: optional int32 ``[skipped, 1]`` (``skipped`` a view of its first element):
            then both counters change in one op, ``skips = skipped + skips * [skipped, 1]``.

    Ops: the skip counters 2 (``skips += skipped``, ``consecutive *= skipped``; 1 with
    ``skipped_one``); a dynamic
    scale 3 more (the counter's forward-overflow correction, the kernel, the clamp), against
    :func:`unimp.loss_scale.update_arrays`'s 17 and 4 copies. A report snapshots the state
    itself (the state changes in place). ``loss_inf`` and ``overflow`` are read only for a
    dynamic scale (None otherwise).
    """
    if config.dynamic:
        growth, backoff, interval, floor, hi = _kernel_args(config)
        counter.add_(loss_inf, alpha=-1)  # a forward overflow: the kernel's +1 gives it back
        torch._amp_update_scale_(scale, counter, overflow, growth, backoff, interval)
        scale.clamp_(floor, hi)
    if skipped_one is not None:  # [s + consecutive * s, s + total]: the same, in one op
        torch.addcmul(skipped, skips, skipped_one, out=skips)
        return
    skips.add_(skipped)  # [consecutive + s, total + s]
    consecutive.mul_(skipped)  # (consecutive + s) * s: consecutive + 1 on a skip, 0 otherwise


def check_new_scale(config: LossScaleConfig, new_scale: float | torch.Tensor) -> float:
    """``GradScaler.update(new_scale)``'s value as a Python float, validated against ``config``
    before anything changes (a tensor is read once on the host: an explicit override is rare,
    and a bad value would poison every later step).

    Raises:
        ValueError: not a number or a one-element floating tensor; outside ``[min_scale,
            max_scale]`` (float32's max without a cap) or not finite; different from a static
            scale (:func:`unimp.loss_scale.portable.check_scale_value`, the loaded states' check).
    """
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or not new_scale.is_floating_point():
            raise ValueError(
                f"new_scale must be a float or a one-element floating tensor, got a "
                f"{new_scale.dtype} tensor of shape {tuple(new_scale.shape)}."
            )
        f = float(new_scale.detach().reshape(()).float().cpu())
    else:
        try:
            f = float(new_scale)
        except (TypeError, ValueError):
            raise ValueError(f"new_scale must be a number, got {new_scale!r}.") from None
    check_scale_value(config, f, "new_scale")
    return f


_TORCH_SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")

#: How a step of an optimizer without torch's native amp path is skipped (see GradScaler).
SKIP_MODES = ("auto", "guard")


def check_skip(skip: Any) -> str:
    """``skip`` if it is one of :data:`SKIP_MODES`.

    Raises:
        ValueError: anything else, naming the two and what each costs.
    """
    if not isinstance(skip, str) or skip not in SKIP_MODES:
        raise ValueError(
            f"skip must be 'auto' (a host read of the overflow flag before optimizer.step(), as "
            f"torch.amp) or 'guard' (no sync: the parameters and optimizer state are copied and "
            f"selected back), got {skip!r}."
        )
    return skip


_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "meta", "privateuseone")


class GradScaler:
    """A drop-in for ``torch.amp.GradScaler`` that follows unimp's loss-scale rule.

    Same methods as torch's: ``scale``, ``unscale_``, ``step``, ``update``, ``get_scale``,
    ``is_enabled``, ``state_dict``, ``load_state_dict``. The scale update is unimp's rule on
    device tensors (float32 scale, int32 counter and skip counters; torch's fused
    ``_amp_update_scale_`` plus a clamp and in-place counters for the configs where that is the
    rule, :func:`unimp.loss_scale.update_arrays` for the others), so it matches the NumPy
    reference bit for bit, including what torch
    lacks: ``min_scale`` / ``max_scale``, skip counters, ``max_consecutive_skips`` and the
    forward-overflow rule (a non-finite loss passed to :meth:`scale` skips the step without
    reducing the scale). With ``DynamicLossScale.preset("torch")`` the scale sequence and the
    parameters match ``torch.amp.GradScaler`` exactly (tested).

    How a step with non-finite gradients is skipped (``skip``), per optimizer, by what it
    costs: torch's fused optimizers (``fused=True``) take the overflow flag natively and skip
    in their kernel, with no host sync and no copy; any other optimizer, with the default
    ``skip="auto"``, is skipped as torch.amp skips it: the host reads the flag once before
    ``optimizer.step()`` (one device-to-host sync per step, no copy, the same time and memory
    as torch.amp's GradScaler). ``skip="guard"`` keeps every step free of syncs for those
    optimizers too: the parameters and optimizer state are copied before the step and
    selected back on the device after it (one extra copy of them, and the optimizer's work on
    a skipped step). The non-finite check and unscale are
    ``torch._amp_foreach_non_finite_check_and_unscale_`` (as torch), and the scale update
    never waits for the device.

    Inside a ``torch.compile``d function every method traces with no graph break of its own
    (dynamo runs torch.amp's ``scale``, ``step`` and ``update`` eagerly, each a graph break,
    and its ``step`` reads ``found_inf`` on the host for an optimizer without the native amp
    path): the skip is decided on the device whatever ``skip`` says (the copy-and-select guard,
    which the compiler fuses into the update, for every optimizer: a fused one's kernel runs
    outside the compiler, where the ``found_inf`` of a traced frame does not reach it), the
    update is the reference rule
    (:func:`unimp.loss_scale.update_arrays`, the same values bit for bit), and the misuse checks,
    which walk autograd's graph, are left out. Run the first step eagerly: it creates the
    optimizer's lazy state, which a compiled one would recompile for.

    Differences from torch, on purpose: calling :meth:`unscale_` twice before :meth:`update`
    is harmless (gradients are divided once; torch raises); a parameter listed twice in an
    optimizer's groups is unscaled once; :meth:`state_dict` is unimp's portable format and
    round-trips for a disabled scaler too (torch's disabled scaler saves ``{}``).

    Args:
        loss_scale: a loss-scale config, or anything :func:`unimp.loss_scale.loss_scale_from_dict`
            accepts (``"dynamic"``, ``"none"``, a number). ``None`` is
            ``DynamicLossScale.preset("torch")`` with torch's keyword overrides. A device-type
            string (``"cuda"``, ``"cpu"``) is taken as ``device``, as torch's first argument.
        device: the device of the scale state; default the current accelerator or the CPU.
        enabled: False makes every method a pass-through (as torch's ``enabled=False``).
        process_group: the replicas that must agree (data parallel): a ``torch.distributed``
            process group; ``None`` (default) is the default group whenever
            ``torch.distributed`` is initialized with more than one rank; ``False`` never
            reduces (one scaler per rank on purpose). With a group, :meth:`unscale_` all-reduces
            the overflow flag and the non-finite-loss flag (MAX, on the device, no host sync)
            before the skip and the scale update, so every replica skips together and the scale
            stays identical on every rank (as torch's ``ShardedGradScaler``); the first
            :meth:`unscale_` after construction or :meth:`load_state_dict` also checks once
            that every rank holds the same loss-scale state and raises if not (see
            :func:`unimp.backends.torch.overflow.check_replicas_agree`).
        skip: ``"auto"`` (default) or ``"guard"``: how an optimizer without torch's native
            amp path skips a step (above); fused optimizers always skip natively.

    Keyword Args:
        init_scale (float): torch's keyword, only with ``loss_scale=None``.
        growth_factor (float): torch's keyword, only with ``loss_scale=None``.
        backoff_factor (float): torch's keyword, only with ``loss_scale=None``.
        growth_interval (int): torch's keyword, only with ``loss_scale=None``.

    Raises:
        ValueError: a bad loss scale, device or ``skip``, or torch keywords with a
            ``loss_scale``.

    Example:
        >>> from unimp import DynamicLossScale
        >>> scaler = GradScaler(DynamicLossScale.preset("torch"), device="cpu")
        >>> scaler.get_scale()
        65536.0
    """

    def __init__(
        self,
        loss_scale: Any = None,
        device: Any = None,
        *,
        enabled: bool = True,
        process_group: Any = None,
        skip: str = "auto",
        **torch_options: Any,
    ) -> None:
        self._skip_mode = check_skip(skip)
        if process_group is not None and process_group is not False:
            dist = getattr(torch, "distributed", None)
            if dist is None or not dist.is_available() or not isinstance(process_group, dist.ProcessGroup):
                raise TypeError(
                    f"process_group must be a torch.distributed ProcessGroup, None (the default group "
                    f"when initialized) or False (no reduction), got {type(process_group).__name__}."
                )
        if isinstance(loss_scale, (str, torch.device)) and (
            isinstance(loss_scale, torch.device) or loss_scale.split(":")[0] in _DEVICE_TYPES
        ):
            if device is not None:
                raise ValueError(f"device given twice: {loss_scale!r} and device={device!r}.")
            loss_scale, device = None, loss_scale
        unknown = sorted(set(torch_options) - set(_TORCH_SCALER_KEYS))
        if unknown:
            raise TypeError(f"unknown GradScaler option(s) {unknown}; torch's are {list(_TORCH_SCALER_KEYS)}.")
        if loss_scale is None:
            opts = dict(torch_options)
            if "init_scale" in opts:
                opts["init_scale"] = float(opts["init_scale"])
            config: LossScaleConfig = DynamicLossScale.preset("torch", **opts)
        else:
            if torch_options:
                raise ValueError(
                    f"torch options {sorted(torch_options)} go with loss_scale=None; put them in the "
                    "config instead, e.g. DynamicLossScale.preset('torch', growth_interval=100)."
                )
            config = loss_scale_from_dict(loss_scale)
        self._device = _as_device(device)
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r}: CUDA is not available (torch {torch.__version__}, or no GPU "
                "visible); use device='cpu' or install a CUDA build of torch."
            )
        self._enabled = bool(enabled)
        self._config = config
        self._ops = LossScaleOps(self._device)
        self._set_state(config.initial_state())
        self._loss_finite = self._ops.true
        self._per_opt: dict[int, dict[str, Any]] = {}
        self._process_group = process_group
        self._replicas_checked = False
        self._floor_watch = FloorWatch()  # get_scale and the train step's results: once per hit
        self._fused: tuple[torch.Tensor, ...] | None = None  # a fused step's flags (begin_step)
        self._report: dict[str, Any] | None = None  # a fused step's snapshot (apply_step) ...
        self._report_flags: tuple[torch.Tensor, ...] | None = None  # ... and flags, to end_step
        self._begun = False  # begin_step ran and no end_step / abort_step / update since

    # -- replicas

    def _group(self) -> Any:
        """The process group to reduce over, or None (single process, or ``process_group=False``)."""
        if self._process_group is False:
            return None
        if self._process_group is not None:
            return self._process_group
        dist = getattr(torch, "distributed", None)
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        return dist.group.WORLD if dist.get_world_size() > 1 else None

    def _reduce_flags(
        self, found_inf: torch.Tensor, loss_finite: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(found_inf, loss_finite)`` reduced (MAX of "bad") over the replicas.

        The reduction is :func:`~unimp.backends.torch.overflow.reduce_step_flags` (run only when a
        group is active); a subclass for another engine (Horovod) overrides this hook.
        """
        group = self._group()
        if group is None:
            return found_inf, loss_finite
        return reduce_step_flags(found_inf, loss_finite, group)

    def _agree_replicas(self) -> None:
        """Makes every replica hold the same state (:meth:`check_replicas`' collective):
        :func:`~unimp.backends.torch.overflow.check_replicas_agree` where a group is active; a
        subclass for another engine (Horovod) overrides this hook."""
        group = self._group()
        if group is not None:
            check_replicas_agree(self, group)

    def check_replicas(self) -> None:
        """Makes every replica hold the same loss-scale state, once after construction or
        :meth:`load_state_dict` (later calls return at once): with a process group,
        :func:`~unimp.backends.torch.overflow.check_replicas_agree` (one all-reduce; a mismatch is
        re-synchronized from rank 0 with a :class:`unimp.ReplicaDesyncWarning`); without one,
        nothing. :meth:`scale`, :meth:`unscale_` and :meth:`begin_step` call it."""
        if self._replicas_checked:
            return
        self._agree_replicas()
        self._replicas_checked = True

    # -- state

    def _set_state(self, s: LossScaleState) -> None:
        dev = self._device
        self._scale = torch.tensor(float(s.scale), dtype=torch.float32, device=dev)
        self._counter = torch.tensor(int(s.counter), dtype=torch.int32, device=dev)
        # the skip counters: 0-d views of one tensor, which the fused update changes (and
        # snapshots) with one op for both
        self._skips = torch.tensor([int(s.consecutive_skips), int(s.total_skips)], dtype=torch.int32, device=dev)
        self._consecutive, self._total = self._skips.unbind()
        self._extra = tuple(torch.tensor(int(getattr(s, n)), dtype=torch.int32, device=dev) for n in EXTRA_FIELDS)

    @property
    def config(self) -> LossScaleConfig:
        """The loss-scale config."""
        return self._config

    @property
    def device(self) -> torch.device:
        """The device holding the scale state."""
        return self._device

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The loss scale as the float32 0-d tensor on :attr:`device` that holds it (no sync;
        :meth:`update` changes it in place: clone it to keep a value)."""
        return self._scale

    def state_tensors(self) -> tuple[torch.Tensor, ...]:
        """The loss-scale state as the tensors on :attr:`device` that hold it, in
        :class:`unimp.LossScaleState` field order (float32 scale, int32 counters; no sync;
        changed in place by :meth:`update`)."""
        return (self._scale, self._counter, self._consecutive, self._total, *self._extra)

    @property
    def state(self) -> LossScaleState:
        """The loss-scale state as host values (synchronizes)."""
        return LossScaleState(*(t.item() for t in self.state_tensors()))

    @property
    def floor_watch(self) -> FloorWatch:
        """The run's :class:`unimp.loss_scale.FloorWatch`: a floor hit (``floor_action`` "warn"
        / "raise") is reported once, at :meth:`get_scale` or the first train-step result read
        after it."""
        return self._floor_watch

    def is_enabled(self) -> bool:
        """False when built with ``enabled=False`` (then every method passes through)."""
        return self._enabled

    def get_scale(self) -> float:
        """The current scale as a Python float (synchronizes; 1.0 when disabled).

        Raises:
            LossScaleError: more than ``max_consecutive_skips`` skipped steps in a row.
        """
        if not self._enabled:
            return 1.0
        self._floor_watch.check(self._config, self.state)
        return float(self._scale.item())

    def get_growth_factor(self) -> float | None:
        """The growth factor (None for a static or disabled scale)."""
        return getattr(self._config, "growth_factor", None)

    def get_backoff_factor(self) -> float | None:
        """The backoff factor (None for a static or disabled scale)."""
        return getattr(self._config, "backoff_factor", None)

    def get_growth_interval(self) -> int | None:
        """The growth interval (None for a static or disabled scale)."""
        return getattr(self._config, "growth_interval", None)

    def _set(self, field: str, value: Any) -> None:
        if not self._config.dynamic:
            raise ValueError(f"{field} belongs to a dynamic loss scale; this one is {self._config.kind!r}.")
        self._config = self._config.replace(**{field: value})  # validated before it is kept

    def set_growth_factor(self, new_factor: float) -> None:
        """Sets the growth factor (> 1). Raises ValueError for a bad value or a static scale."""
        self._set("growth_factor", new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        """Sets the backoff factor (in (0, 1)). Raises ValueError for a bad value or a static scale."""
        self._set("backoff_factor", new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        """Sets the growth interval (>= 1, above the current counter). Raises ValueError otherwise."""
        if not self._config.dynamic:
            raise ValueError(f"growth_interval belongs to a dynamic loss scale; this one is {self._config.kind!r}.")
        config = self._config.replace(growth_interval=new_interval)
        counter = int(self._counter.item())
        if counter >= config.growth_at:
            raise ValueError(f"growth_interval={new_interval} must exceed the current counter {counter}.")
        self._config = config

    def _opt_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self._per_opt.setdefault(id(optimizer), {"stage": _READY, "found_inf": None})

    # -- scale / unscale / step / update

    def scale(self, outputs: Any) -> Any:
        """Multiplies a loss (or a nested structure of losses) by the scale.

        Also records, on the device, whether the unscaled losses are finite: a non-finite loss
        skips this iteration's steps without reducing the scale (unimp's forward-overflow rule).

        Args:
            outputs: a tensor or nested lists/tuples/dicts of tensors (the unscaled losses).

        Returns:
            The same structure multiplied by the scale (matches torch: ``outputs * scale``).

        Raises:
            TypeError: ``outputs`` holds no tensor.
        """
        if not self._enabled:
            return outputs
        if not any(True for _ in _leaves(outputs)):
            raise TypeError(f"scale() needs a tensor or a structure of tensors, got {type(outputs).__name__}.")
        # the misuse checks walk autograd's graph, which torch.compile cannot trace: a compiled
        # step runs without them (its eager runs have them)
        compiling = torch.compiler.is_compiling()
        for t in () if compiling else _leaves(outputs):
            freed = _freed_graph(t) if t.grad_fn is not None else None
            if freed is not None:
                raise RuntimeError(
                    f"{freed} scaler.scale(loss) got a loss whose graph loss.backward() already "
                    "ran through: call only scaler.scale(loss).backward() (it replaces "
                    "loss.backward()), then scaler.step(optimizer) and scaler.update()."
                )
        self._loss_finite = self._loss_finite & _to(all_finite(outputs), self._device)
        self.check_replicas()  # replicas must agree on the scale before the loss is scaled
        scaled = _map_tree(outputs, lambda t: t * _to(self._scale, t.device))
        if not compiling:
            _mark_pending(self, scaled)
        return scaled

    def _check_fp16(self, optimizer: torch.optim.Optimizer) -> None:
        bad = [
            (name, p)
            for name, p in _param_names(optimizer)
            if p.grad is not None and p.grad.dtype == torch.float16
        ]
        if bad:
            names = ", ".join(n for n, _ in bad[:8]) + (" ..." if len(bad) > 8 else "")
            raise ValueError(
                f"float16 gradients cannot be unscaled safely (parameters: {names}): keep the "
                "parameters float32 (autocast computes in float16 anyway), or use cast_mode='module' "
                "with mp.prepare(model, optimizer), which keeps float32 master weights."
            )

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's gradients by the scale, in place, and checks them for inf/NaN.

        Matches torch.amp.GradScaler.unscale_: ``inv_scale`` is the float64 reciprocal of the
        scale rounded to float32, and the check and multiply are one fused kernel per device
        and dtype. Calling it again before :meth:`update` does nothing (torch raises).

        Raises:
            ValueError: a float16 gradient while the loss is scaled (names the parameters and
                the fix); with ``NoLossScale`` float16 gradients are only checked.
            RuntimeError: called after :meth:`step` and before :meth:`update`.
        """
        if not self._enabled:
            return
        st = self._opt_state(optimizer)
        if st["stage"] == _UNSCALED:
            return
        if st["stage"] == _STEPPED:
            raise RuntimeError("unscale_() is being called after step(); call update() first.")
        self.check_replicas()  # before anything changes: raises on every rank on a mismatch
        master = peek(optimizer, "master", None)
        if master is not None:
            master.to_master()
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for _, g in param_grads(optimizer):
            groups.setdefault((g.device, g.dtype), []).append(g)
        # a scale of exactly 1 unscales exactly: float16 is fine then
        if not self._config.unity and any(dt == torch.float16 for _, dt in groups):
            self._check_fp16(optimizer)  # raises, naming the parameters
        # torch's float64 reciprocal rounded once to float32 (scale.double().reciprocal().float()),
        # in one op: 1.0 (float64) / scale promotes to float64, written into a float32 scratch
        if self._config.unity:  # 1/1: the cached constant, no op
            inv_scale = self._ops.f32(1.0)
        else:
            inv_scale = torch.div(self._ops.f64(1.0), self._scale, out=self._buffer("inv_scale"))
        # in a fused step (begin_step) the flag is the step's scratch, which its report reads
        into = None if self._fused is None else self._fused[1]
        with torch.no_grad():
            per_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
            for (dev, _), grads in groups.items():
                if dev not in per_device:
                    per_device[dev] = (
                        into if into is not None and dev == into.device
                        else torch.zeros((), dtype=torch.float32, device=dev),
                        _to(inv_scale, dev),
                    )  # fmt: skip
                fi, inv = per_device[dev]
                torch._amp_foreach_non_finite_check_and_unscale_(grads, fi, inv)
            flags = [_to(fi, self._device) for fi, _ in per_device.values()]
            if len(flags) == 1:
                found_inf = flags[0]
            elif flags:
                found_inf = torch.stack(flags).amax()  # 0 / 1: fused optimizers skip on == 1 only
            else:
                found_inf = torch.zeros((), dtype=torch.float32, device=self._device)
        st["found_inf"], self._loss_finite = self._reduce_flags(found_inf, self._loss_finite)
        st["stage"] = _UNSCALED
        pending = _PENDING.get(self)
        if pending is not None:  # these gradients are unscaled now, whichever optimizer steps them
            pending.unscaled.update(id(p) for p, _ in param_grads(optimizer))

    def step(self, optimizer: torch.optim.Optimizer | None = None, *args: Any, **kwargs: Any) -> Any:
        """Unscales (unless :meth:`unscale_` was called) and steps, skipping on the device.

        Each optimizer skips on its own non-finite gradients or on a non-finite loss given to
        :meth:`scale` (torch.amp semantics, plus the forward-overflow rule). A skipped step leaves
        the parameters and the whole optimizer state (moments, ``step``) bitwise unchanged and
        needs no host sync: fused optimizers take ``found_inf`` natively, others are restored
        with ``torch.where`` (details in the module's ``guarded_step``). ``*args``/``**kwargs``
        go to ``optimizer.step``; with positional arguments (a closure, as LBFGS takes it) the
        skip is decided on the host first and ``optimizer.step`` is not called on a skipped
        step, as torch.amp's GradScaler does (one sync).

        Returns:
            What ``optimizer.step(*args, **kwargs)`` returned, or ``None`` when the step was
            skipped (matches torch.amp.GradScaler: ``loss = scaler.step(optimizer, closure)``);
            telling the two apart syncs only when the optimizer returned something (``SGD``,
            ``Adam`` & co return ``None`` without a closure). With ``enabled=False``, whatever
            ``optimizer.step`` returns.

        Raises:
            RuntimeError: a ``closure=`` keyword argument ("Closure use is not currently
                supported if GradScaler is enabled", as in torch.amp), or a second ``step``
                before :meth:`update`.
        """
        if optimizer is None:
            raise TypeError(
                "GradScaler.step() takes the optimizer to step, got no optimizer: call "
                "scaler.step(optimizer), then scaler.update()."
            )
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError(
                "Closure use is not currently supported if GradScaler is enabled (as in "
                "torch.amp); pass the closure positionally, scaler.step(optimizer, closure), to "
                "run it on an applied step only."
            )
        return self._step(optimizer, args, kwargs)[0]

    def _unscaled_once(self, optimizer: torch.optim.Optimizer, twice: str) -> dict[str, Any]:
        """``optimizer``'s record for this iteration, unscaled (``unscale_`` unless done), before
        its one step; raises ``RuntimeError(twice)`` where it has stepped already."""
        st = self._opt_state(optimizer)
        if st["stage"] == _STEPPED:
            raise RuntimeError(twice)
        if st["stage"] == _READY:
            self.unscale_(optimizer)
        return st

    def _step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[Any, torch.Tensor]:
        """:meth:`step`'s work: ``(what optimizer.step returned or None, applied)``, ``applied``
        a 0-d bool device tensor (the train step's report reads it without a sync)."""
        st = self._unscaled_once(optimizer, "step() has already been called since the last update(): "
                                 "call scaler.update() once per iteration, after scaler.step(optimizer), "
                                 "so the loss scale moves.")  # fmt: skip
        bad = torch.where(self._loss_finite, st["found_inf"], self._ops.f32(1.0))
        if torch.compiler.is_compiling() and not args:
            # traced: skipped on the device with no context manager around optimizer.step
            # (guarded_step's compiled path); an applied step's return value is kept as it is
            st["stage"] = _STEPPED
            return guarded_step(optimizer, bad, args, kwargs), bad == 0
        with _stepping():
            if args:  # a closure runs on an applied step only: decided on the host, as torch does
                ret = None if bool(bad != 0) else optimizer.step(*args, **kwargs)
            else:
                ret = guarded_step(optimizer, bad, args, kwargs, sync=self._skip_mode == "auto")
                if ret is not None and bool(bad != 0):
                    ret = None
        st["stage"] = _STEPPED
        return ret, bad == 0

    def _combined(self) -> tuple[torch.Tensor, torch.Tensor]:
        found = [st["found_inf"] for st in self._per_opt.values() if st["found_inf"] is not None]
        if not found:
            raise RuntimeError("update() found no unscale_()/step() since the last update().")
        total = found[0] if len(found) == 1 else torch.stack(found).sum()
        return total == 0, self._loss_finite

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Updates the scale and skip counters once per iteration, on the device.

        Combines the overflow checks of every optimizer unscaled or stepped since the last
        update and applies unimp's rule (:meth:`_apply_update`; matches torch.amp.GradScaler:
        back off on overflow, grow on the growth_interval-th consecutive finite step, never to
        inf; plus min/max scale, skip counters and the forward-overflow rule).

        Args:
            new_scale: set the scale to this value instead of running the rule (matches
                torch.amp.GradScaler: the growth counter, and here the extra fields' trackers, are
                left as they were, and no ``unscale_``/``step`` is needed before it); the skip
                counters still record a step taken since the last update. A tensor is read
                once on the host to validate it.

        Raises:
            RuntimeError: no ``unscale_``/``step`` since the last update (without
                ``new_scale``).
            ValueError: ``new_scale`` not a number or one-element tensor, outside the config's
                ``[min_scale, max_scale]``, or different from a static scale; nothing changes.
        """
        if not self._enabled:
            return
        if new_scale is None:
            self._update(*self._combined())
            return
        value = self._ops.f32(check_new_scale(self._config, new_scale))  # before any change
        if any(st["found_inf"] is not None for st in self._per_opt.values()):
            kept = [t.clone() for t in (self._counter, *self._extra)]
            self._update(*self._combined())  # the skip counters; the rule's scale is replaced
            for held, old in zip((self._counter, *self._extra), kept, strict=True):
                held.copy_(old)
        self._per_opt.clear()
        self._begun = False
        _PENDING.pop(self, None)
        self._loss_finite = self._ops.true
        self._scale.copy_(value)

    def _update(self, grads_finite: torch.Tensor, loss_finite: torch.Tensor, flags: Any = None) -> tuple[torch.Tensor, ...]:
        """The end of an iteration: the rule applied (:meth:`_apply_update`) and the
        per-optimizer stages reset; returns the rule's results."""
        out = self._apply_update(grads_finite, loss_finite, flags)
        self._per_opt.clear()
        self._begun = False
        _PENDING.pop(self, None)
        return out

    def _buffer(self, name: str, shape: tuple[int, ...] = ()) -> torch.Tensor:
        """A float32 scratch on the scaler's device, made once (``inv_scale``, the fused
        update's ``overflow``, the train step's ``flags``); never pickled."""
        scratch = self.__dict__.setdefault("_scratch", {})
        buf = scratch.get(name)
        if buf is None:
            buf = scratch[name] = torch.zeros(shape, dtype=torch.float32, device=self._device)
        return buf

    def _apply_update(self, grads_finite: torch.Tensor, loss_finite: torch.Tensor, flags: Any = None) -> tuple[torch.Tensor, ...]:
        """Runs the rule on the state, in place; returns ``(scale, counter, consecutive_skips,
        total_skips, *extra)`` where the skip counters (and, on the reference path, every
        field) are snapshots that later updates leave alone, for a step's report.

        Where :func:`fused_rule` holds, the update is torch's fused kernel and a
        few in-place ops (``flags``: the caller's ``(overflow, skipped, loss_inf[, [skipped, 1]])`` if it has them,
        then the skip counters come back as None: the caller snapshots them);
        elsewhere :func:`unimp.loss_scale.update_arrays`, copied into the state.
        """
        # traced (torch.compile): the reference rule, which the compiler fuses itself; equal to
        # the fused path bit for bit where that is taken (fused_rule), and no cache to change
        if not torch.compiler.is_compiling() and fused_rule(self._config):
            overflow, skipped, loss_inf, *one = flags or flags_from_bools(grads_finite, loss_finite, self._buffer("overflow"))
            update_in_place(
                self._config, self._scale, self._counter, self._skips, self._consecutive,
                loss_inf=loss_inf, overflow=overflow, skipped=skipped, skipped_one=(one or [None])[0],
            )  # fmt: skip
            self._loss_finite = self._ops.true
            # the caller's flags come with its own report; else the counters' snapshot
            skips = (None, None) if flags else tuple(self._skips.clone().unbind())
            return (self._scale, self._counter, *skips, *self._extra)
        out = update_arrays(
            self._ops, self._config, self._scale, self._counter, self._consecutive, self._total,
            grads_finite, loss_finite, extra=self._extra,
        )
        # in place, so tensors handed out earlier (and CUDA graphs) see the new values
        held_all = (self._scale, self._counter, self._consecutive, self._total, *self._extra)
        for held, new in zip(held_all, out, strict=True):
            if new is not held:  # a static scale returns scale and counter as they were
                held.copy_(new)
        self._loss_finite = self._ops.true  # never changed in place: every update rebinds it
        return out

    # -- one training step as an engine runs it (unimp's train step)

    def begin_step(self) -> torch.Tensor:
        """Starts one training step as an engine runs it, in place of :meth:`scale`: checks
        that the replicas agree (:meth:`check_replicas`) and returns the loss scale the step
        uses, a float32 0-d tensor on the scaler's device whose value this step's
        :meth:`end_step` does not change. The engine multiplies each loss by it itself.

        The calls of one step, in order: ``begin_step``; for each micro-batch the backward
        of ``loss * scale`` and :meth:`record_loss`; :meth:`unscale_`; optionally
        :meth:`found_inf` and :meth:`mark_non_finite`; :meth:`apply_step`; :meth:`end_step`.
        Where anything raises before ``end_step``, :meth:`abort_step`.

        On one process, for a config :func:`fused_rule` accepts, the step is fused: its loss
        and gradient overflow flags, skip flag and backoff flag are one scratch, zeroed here
        (one op) and written by torch's check kernels; :meth:`apply_step` takes the step's
        report as one packed snapshot (two ops) and :meth:`end_step` runs the fused update
        on the same flags. A step costs no host sync either way. Traced by ``torch.compile``,
        the step is never fused (the compiler fuses it).
        """
        if self._begun or self._per_opt:
            raise RuntimeError(
                "begin_step() while a step is in progress (unscale_ or a step since the last "
                "update): end it with end_step() (or update()), or forget it with abort_step()."
            )
        self.check_replicas()  # replicas must agree on the scale before the loss is scaled
        self._begun = True
        if not torch.compiler.is_compiling() and fused_rule(self._config) and self._group() is None:
            self._fused = self._zero_flags()
            return self._scale  # unchanged until the update, after the report's snapshot
        self._fused = None
        # the update changes the state in place: a static scale never changes
        return self._scale.clone() if self._config.dynamic else self._scale

    def record_loss(self, loss: torch.Tensor) -> None:
        """Records on the device whether ``loss`` (a step's unscaled loss, detached) is
        finite: the forward-overflow rule's flag, as :meth:`scale` records it. Call it after
        the loss's backward: in a fused step torch's check kernel multiplies ``loss`` by 1 in
        place (no value changes).

        Raises:
            TypeError: ``loss`` is not a 0-d floating tensor.
        """
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
            raise TypeError(
                "record_loss takes the step's loss as a 0-d floating tensor (detached), got "
                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
                f"{' ' + str(loss.dtype) if isinstance(loss, torch.Tensor) else ''}."
            )
        if self._fused is not None:
            _check_loss(loss, self._fused[0], self._ops.f32(1.0))
            return
        finite = _to(torch.isfinite(loss), self._device)
        # the flag starts as the cached True, and True & x is x: one op fewer a step
        start = self._loss_finite is self._ops.true
        self._loss_finite = finite if start else self._loss_finite & finite

    @property
    def loss_finite(self) -> torch.Tensor | None:
        """Whether every loss given to :meth:`scale` or :meth:`record_loss` since the last
        update was finite: a 0-d bool tensor on the scaler's device (no sync). None inside a
        fused step, whose flag is a field of the report :meth:`apply_step` takes."""
        return None if self._fused is not None else self._loss_finite

    @loss_finite.setter
    def loss_finite(self, flag: torch.Tensor) -> None:
        """Sets the flag back to one read earlier (an engine undoing a failed block, as
        ``unimp.compat.apex.scale_loss`` does)."""
        if not isinstance(flag, torch.Tensor) or flag.dtype != torch.bool or flag.dim() != 0:
            raise TypeError("loss_finite must be a 0-d bool tensor (a value read from loss_finite).")
        if self._fused is not None:
            raise RuntimeError(
                "loss_finite cannot be set inside a fused step (its flag is the step's scratch): "
                "record the loss with record_loss(loss), or abort_step() first."
            )
        self._loss_finite = _to(flag, self._device)

    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """The overflow flag :meth:`unscale_` found for ``optimizer``'s gradients: a float32
        0-d tensor on the scaler's device, nonzero where a gradient was not finite (agreed
        over the replicas); what :meth:`step` and :meth:`update` read.

        Raises:
            RuntimeError: ``optimizer`` was not unscaled since the last update.
        """
        flag = self._per_opt.get(id(optimizer), {}).get("found_inf")
        if flag is None:
            raise RuntimeError("found_inf(optimizer) needs scaler.unscale_(optimizer) first.")
        return flag

    def mark_non_finite(self, optimizer: torch.optim.Optimizer, non_finite: torch.Tensor) -> None:
        """Marks ``optimizer``'s gradients non-finite where ``non_finite`` (a 0-d bool tensor,
        e.g. a global norm beyond float32) is True: the step is skipped and the scale backs
        off, as for an inf gradient. In place, on the device (one op).

        Raises:
            RuntimeError: ``optimizer`` was not unscaled since the last update.
        """
        if not isinstance(non_finite, torch.Tensor) or non_finite.dtype != torch.bool or non_finite.dim() != 0:
            raise TypeError(
                "mark_non_finite takes a 0-d bool tensor (e.g. ~torch.isfinite(norm)), got "
                f"{type(non_finite).__name__}"
                f"{' ' + str(non_finite.dtype) if isinstance(non_finite, torch.Tensor) else ''}: a "
                "flag of 0.5 would skip in the report and step a fused optimizer."
            )
        flag = self.found_inf(optimizer)
        torch.maximum(flag, _to(non_finite, flag.device).float(), out=flag)

    def apply_step(self, optimizer: torch.optim.Optimizer) -> Any:
        """Steps ``optimizer`` as :meth:`step` does (unscaling first where needed), skipped on
        the device where the loss or a gradient was not finite, and returns ``applied``: a
        0-d bool on the scaler's device (in a fused step, a field of the step's report,
        which stands for one). No host sync, except ``skip="auto"``'s one read for an
        optimizer without torch's native amp path."""
        if self._fused is None:
            return self._step(optimizer, (), {})[1]
        st = self._unscaled_once(optimizer, "apply_step() has already stepped this optimizer in this "
                                 "step: call end_step() once per step, after apply_step(optimizer).")  # fmt: skip
        loss_inf, grads_inf, skip, overflow = self._fused  # step() with the loss flag as found_inf
        if st["found_inf"] is not grads_inf:  # gradients on other devices too: their flag (0 / 1)
            grads_inf.copy_(st["found_inf"])
        self._skip_flags()  # skip (exactly 1 or 0) and the backoff flag, one op
        guarded_step(optimizer, skip, (), {}, sync=self._skip_mode == "auto")
        st["stage"] = _STEPPED
        # the report: one snapshot, every field derived when read
        self._report, (loss_bad, skipped, skipped_one) = _snapshot(self)
        self._report_flags = (overflow, skipped, loss_bad, skipped_one)
        return self._report["applied"]

    def applied_tensor(self) -> torch.Tensor | None:
        """In a fused step after :meth:`apply_step`, whether it applied, as a 0-d bool tensor
        (one op; the report's ``applied`` field stands for one without being one); else None,
        and ``apply_step``'s result is that tensor."""
        return None if self._fused is None else torch.eq(self._fused[2], 0)

    def end_step(self, grads_finite: Any, loss_finite: Any) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """Ends the step: the loss-scale update (:meth:`update`'s rule; in a fused step the
        fused update on the step's flags, which are then the ones reported).

        Args:
            grads_finite, loss_finite: the step's 0-d bool flags (ignored in a fused step:
                its report holds them).

        Returns:
            ``(fields, extra)``: the report's fields the update decides, ``consecutive_skips``
            and ``total_skips`` (after this step) and, in a fused step, ``scale``,
            ``loss_finite`` and ``grads_finite`` too; and the state's extra fields
            (:data:`unimp.loss_scale.EXTRA_FIELDS`) after the step, for ``floor_hits``.
        """
        if self._fused is None:
            if not any(st["found_inf"] is not None for st in self._per_opt.values()):
                raise RuntimeError(
                    "end_step() found no step: begin_step(), the backward, unscale_(optimizer) and "
                    "apply_step(optimizer) come first."
                )
            grads_finite, loss_finite = (
                torch.as_tensor(f, dtype=torch.bool, device=self._device) for f in (grads_finite, loss_finite)
            )
            _, _, consecutive, total, *extra = self._update(grads_finite, loss_finite)
            return {"consecutive_skips": consecutive, "total_skips": total}, tuple(extra)
        report = self._report
        if report is None:
            raise RuntimeError("end_step() in a fused step needs apply_step(optimizer) first.")
        _, _, _, _, *extra = self._update(report["grads_finite"], report["loss_finite"], self._report_flags)
        self._fused = self._report = self._report_flags = None
        return {f: report[f] for f in _REPORTED}, tuple(extra)

    def abort_step(self) -> None:
        """Forgets a step that raised before :meth:`end_step`: the loss flag, a half-done
        :meth:`unscale_` (the optimizers' stages) and a fused step's flags; the loss-scale
        state is as it was."""
        self._loss_finite = self._ops.true
        self._per_opt.clear()
        self._fused = self._report = self._report_flags = None
        self._begun = False

    def _zero_flags(self) -> tuple[torch.Tensor, ...]:
        """``(loss_inf, grads_inf, skip, overflow)``: 0-d float32 views of the fused step's flag
        scratch, zeroed (one op; the views are made once)."""
        scratch = self.__dict__.setdefault("_scratch", {})
        views = scratch.get("flag_views")
        if views is None:
            flags = self._buffer("flags", (4,))
            end = torch.tensor([1.0, 0.0], dtype=torch.float32, device=self._device)
            views = scratch["flag_views"] = (*flags.unbind(), flags[:3], flags[2:], end)
        self._buffer("flags", (4,)).zero_()
        return views[:4]

    def _skip_flags(self) -> None:
        """Writes ``skip = max(loss_inf, grads_inf)`` (exactly 1.0 or 0.0: torch's fused
        optimizers skip on ``found_inf == 1`` only) and ``overflow = grads_inf and not
        loss_inf`` (the backoff flag: finite loss, non-finite gradients) in one op:
        ``lerp(grads_inf, [1, 0], loss_inf)`` is ``[grads_inf, grads_inf]`` for a finite loss
        and ``[1, 0]`` for a non-finite one (a weight of exactly 0 or 1 gives the start or the
        end exactly)."""
        loss_inf, grads_inf, _, _, _, skip_overflow, end = self._scratch["flag_views"]
        torch.lerp(grads_inf, end, loss_inf, out=skip_overflow)

    # -- state dicts

    def __getstate__(self) -> dict[str, Any]:
        """Pickles everything but the constant cache (rebuilt on load, on the same device), so a
        pickle names no private class of this package."""
        if self._begun or self._per_opt:  # torch.amp.GradScaler asserts the same
            raise RuntimeError(
                "a GradScaler can be pickled or copied only between steps (before unscale_ / "
                "begin_step, or after update / end_step): a step in progress would be half-copied."
            )
        d = self.__dict__.copy()
        d.pop("_ops", None)
        d.pop("_scratch", None)  # made again on first use
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._ops = LossScaleOps(self._device)
        # a pickle holds the two counters apart: one tensor again
        self._skips = torch.stack([self._consecutive, self._total])
        self._consecutive, self._total = self._skips.unbind()

    def state_dict(self) -> dict[str, Any]:
        """unimp's portable loss-scale state (``unimp.loss_scale.state_dict``), JSON-able; the
        same in every backend, also for a disabled scaler and before the first step."""
        return _ls.state_dict(self._config, self.state)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads a portable state dict, or converts a ``torch.amp.GradScaler`` one.

        A torch state dict (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) keeps this scaler's min/max scale and takes
        torch's factors, interval, scale and growth tracker; skip counters start at 0.
        Everything is validated before anything changes.

        Raises:
            ValueError: a malformed dict (the key is named), or torch's empty ``{}`` from a
                disabled torch scaler.
        """
        if isinstance(state_dict, Mapping) and "_growth_tracker" in state_dict:
            config, state = self._from_torch(state_dict)
        elif isinstance(state_dict, Mapping) and len(state_dict) == 0:
            raise ValueError(
                "empty state_dict: torch's disabled GradScaler saves {}, which holds no state; "
                "nothing to load (unimp's scalers always save the portable format)."
            )
        else:
            config, state = _ls.from_state_dict(state_dict, current=self._config)
        self._config = config
        self._set_state(state)
        self._replicas_checked = False  # a checkpoint loaded on some ranks only is caught next step

    def _from_torch(self, d: Mapping[str, Any]) -> tuple[LossScaleConfig, LossScaleState]:
        need = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
        missing = [k for k in need if k not in d]
        if missing:
            raise ValueError(f"torch GradScaler state_dict is missing {missing}.")
        base = self._config if self._config.dynamic else DynamicLossScale.preset("torch")
        values = {k: d[k].item() if isinstance(d[k], torch.Tensor) and d[k].numel() == 1 else d[k]
                  for k in need}
        for k, v in values.items():  # as torch writes them: Python numbers (or 0-d tensors)
            integral = k in ("growth_interval", "_growth_tracker")
            if isinstance(v, bool) or not isinstance(v, int if integral else (int, float)):
                raise ValueError(
                    f"torch GradScaler state_dict {k!r} must be {'an int' if integral else 'a number'}"
                    f", got {v!r}; pass the dict torch.amp.GradScaler.state_dict() returned."
                )
            if integral and not 0 <= v <= 2**31 - 1:  # unimp's counters are int32
                raise ValueError(
                    f"torch GradScaler state_dict {k!r} must be an int in [0, 2**31 - 1], got "
                    f"{v if abs(v) < 10**20 else f'an integer of {len(str(abs(v)))} digits'}."
                )
        d = values
        scale = float(d["scale"])
        try:
            config = base.replace(
                growth_factor=float(d["growth_factor"]),
                backoff_factor=float(d["backoff_factor"]),
                growth_interval=int(d["growth_interval"]),
                init_scale=min(max(scale, base.floor), base.max_scale or _F32.max),
            )
        except ValueError as e:
            raise ValueError(f"cannot convert torch GradScaler state_dict: {e}") from None
        sd = _ls.state_dict(config, LossScaleState(scale, int(d["_growth_tracker"]), 0, 0))
        return _ls.from_state_dict(sd)


# ------------------------------------------------------------------- a fused step's report
# A fused step's report is one packed int32 snapshot taken after the flags are written and
# before the loss-scale update (``ne`` + ``cat``):
# ``[scale bits, consecutive_skips, total_skips, loss_inf, grads_inf, skip]`` before the
# update, the scale as its float32 bit pattern (a view: exact). The values after the update are
# derived as the core's rule defines them: ``applied = not skip`` and the skip counters by
# :func:`unimp.loss_scale.skip_counts`, on the host or on the device.


def to_host(x: Any) -> Any:
    """A step value on the host: a tensor's (or a fused report field's) ``item()``; else ``x``
    (what :class:`unimp.StepResult` converts each raw value with)."""
    return x.item() if isinstance(x, (torch.Tensor, _Field)) else x


def _snapshot(sc: GradScaler) -> tuple[dict[str, _Field], tuple[torch.Tensor, ...]]:
    """The step's report (two ops: ``ne`` and ``cat``), taken after the step's flags are
    written and before the loss-scale update.

    Returns:
        ``(fields, (loss_inf, skip, skip_one))``: the report's fields (``scale``,
        ``applied``, ``loss_finite``, ``grads_finite``, ``consecutive_skips``,
        ``total_skips``), each a :class:`_Field` of one snapshot; and for ``update_in_place``
        the int32 flags (0-d, 1: non-finite loss, 1: skipped) and ``[skip, 1]``.
    """
    s = sc.__dict__.setdefault("_scratch", {})
    held = s.get("report")
    if held is None or held[0] is not sc._scale or held[1] is not sc._skips:  # a new state
        bits = torch.tensor([0, 0, 0, 1], dtype=torch.int32, device=sc.device)  # [.., .., .., 1]
        parts = [sc._scale.view(torch.int32).reshape(1), sc._skips, bits[:3]]
        held = s["report"] = (sc._scale, sc._skips, bits[:3], (*bits.unbind()[::2], bits[2:]), parts)
    _, _, bits, (loss_bad, skip, skip_one), parts = held
    torch.ne(s["flag_views"][4], 0, out=bits)
    snap = _Snapshot(torch.cat(parts))
    return {name: _Field(snap, name) for name in _DERIVE}, (loss_bad, skip, skip_one)


def _scale_of(bits: int) -> float:
    return float(np.array(bits, dtype=np.int32).view(np.float32))


# name -> (dtype of the device value it stands for, its value from the packed values
# [scale bits, consecutive, total, loss_inf, grads_inf, skip]: the host list, or the device
# tensor itself, where the same indexing and arithmetic are torch ops)
_DERIVE = {
    "scale": (torch.float32, lambda v: _scale_of(v[0])),
    "applied": (torch.bool, lambda v: v[5] == 0),
    "loss_finite": (torch.bool, lambda v: v[3] == 0),
    "grads_finite": (torch.bool, lambda v: v[4] == 0),
    "consecutive_skips": (torch.int32, lambda v: skip_counts(v[1], v[2], v[5])[0]),
    "total_skips": (torch.int32, lambda v: skip_counts(v[1], v[2], v[5])[1]),
}

#: the fields a fused step's :meth:`GradScaler.end_step` reports (all but ``applied``, which
#: :meth:`GradScaler.apply_step` returns)
_REPORTED = ("scale", "loss_finite", "grads_finite", "consecutive_skips", "total_skips")


class _Snapshot:
    """One step's packed int32 report on the device, read to the host once (on first need)."""

    __slots__ = ("packed", "_host")

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed
        self._host: list[int] | None = None

    def host(self) -> list[int]:
        if self._host is None:
            self._host = self.packed.tolist()  # the only sync, shared by every field
        return self._host


class _Field:
    """A step's report field on the fused path: stands for a 0-d device value of ``dtype``,
    derived from its step's :class:`_Snapshot` when read (``item()``, ``bool()``, ``int()``,
    ``float()``: each waits for the device once per step)."""

    __slots__ = ("_snap", "name")

    def __init__(self, snap: _Snapshot, name: str) -> None:
        self._snap = snap
        self.name = name

    @property
    def dtype(self) -> torch.dtype:
        return _DERIVE[self.name][0]

    def item(self) -> Any:
        return _DERIVE[self.name][1](self._snap.host())

    def __bool__(self) -> bool:
        return bool(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def device_value(self) -> torch.Tensor:
        """The field as the 0-d device tensor it stands for, derived from the snapshot with
        torch ops on its device (no host sync): what :attr:`unimp.StepResult.raw` hands out."""
        p = self._snap.packed
        if self.name == "scale":  # the bit pattern back as float32 (a view: exact)
            return p[0].view(torch.float32)
        return _DERIVE[self.name][1](p)  # the host rule, run on the packed device tensor

    def __repr__(self) -> str:
        return f"<unimp step {self.name}: {self.dtype}, read on access>"
