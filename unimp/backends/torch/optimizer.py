"""torch optimizer: ``optimizer.step`` guarded so that a skipped step leaves parameters and the
whole optimizer state bitwise unchanged without a host sync, the half-optimizer-state check,
:class:`UpdateOps`, the array namespace of :mod:`unimp.rounding` (how a half parameter takes
its update), and :func:`half_update`, which applies that rule to any ``torch.optim`` optimizer.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from unimp.attached import attach, peek
from unimp.backends.torch.devices import _to
from unimp.rounding import check_seed, check_update_mode, check_update_state, update_half
from unimp.step import warn_half_optimizer_state


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[dict, str]]:
    return [(s, k) for s in optimizer.state.values() for k, v in s.items() if isinstance(v, torch.Tensor)]


@contextlib.contextmanager
def _amp_attributes(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> Iterator[None]:
    """``optimizer.grad_scale`` and ``optimizer.found_inf`` set while its step runs, as
    torch.amp.GradScaler.step does for an optimizer with ``_step_supports_amp_scaling``: the
    gradients are already unscaled, so ``grad_scale`` is None; ``found_inf`` is the float32 0-d
    skip flag on the scale's device (nonzero: skip). What the optimizer held before is put back
    after the step: the blocks nest (a compiled train step's :func:`native_flag` around a guarded
    step that runs eagerly, as under ``TORCHDYNAMO_DISABLE=1``)."""
    held = {k: optimizer.__dict__[k] for k in _AMP_ATTRIBUTES if k in optimizer.__dict__}
    optimizer.grad_scale = None  # type: ignore[attr-defined]
    optimizer.found_inf = bad  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for k in _AMP_ATTRIBUTES:
            optimizer.__dict__.pop(k, None)
        optimizer.__dict__.update(held)


#: the attributes torch.amp.GradScaler.step sets on an optimizer with _step_supports_amp_scaling
_AMP_ATTRIBUTES = ("grad_scale", "found_inf")


#: set while unimp itself calls ``optimizer.step`` (a guarded step, GradScaler.step): the
#: GradScaler's check for a user's ``optimizer.step()`` on scaled gradients stays out of it
_IN_STEP = threading.local()


@contextlib.contextmanager
def _stepping() -> Iterator[None]:
    before = getattr(_IN_STEP, "active", False)
    _IN_STEP.active = True
    try:
        yield
    finally:
        _IN_STEP.active = before


def guarded_step(
    optimizer: torch.optim.Optimizer,
    bad: torch.Tensor,
    args: tuple,
    kwargs: dict,
    step_fn: Callable[..., Any] | None = None,
    sync: bool = False,
) -> Any:
    """Runs ``optimizer.step`` so that, where ``bad`` (float32 0-d, nonzero = skip) is set, the
    parameters and the whole optimizer state stay bitwise as they were.

    * Optimizers with torch's native amp path (``_step_supports_amp_scaling``: fused
      Adam/AdamW/SGD/Adagrad) get ``found_inf=bad``: their kernels leave parameters and
      moments alone and undo the ``step`` increment. No extra memory, no host sync.
    * Any other optimizer with ``sync=True`` (the GradScaler's default ``skip="auto"``): the
      host reads ``bad`` once and ``optimizer.step`` runs only on an applied step, as
      torch.amp's GradScaler decides every step. One sync, no copy. (An amp-aware optimizer
      of one's own, ``_step_supports_amp_scaling`` without torch's fused kernel, is stepped
      every time with ``found_inf`` set, as torch.amp steps it, and guarded as below.)
    * Any other optimizer with ``sync=False`` (``skip="guard"``): the parameters with gradients
      and the state tensors are copied before the step and selected back with
      ``torch.where(bad, old, new)`` after it, with no host sync (one extra copy of parameters
      and state, and the optimizer's work on a skipped step; the values of an applied step
      are the optimizer's own).

    Without ``sync``, host syncs happen only where the decision cannot stay on the device: for sparse
    parameters (``torch.where`` has no sparse kernel; the step is run or not, as torch does), on the step that
    creates an optimizer's lazy per-parameter state (to drop it when the step is skipped, so a
    skipped first step leaves ``optimizer.state`` empty, as never stepping would), and for state
    that is not a tensor on the flag's device (e.g. non-capturable Adam's CPU ``step`` with CUDA
    parameters; use ``fused=True`` or ``capturable=True`` to avoid it).

    Cost of the copy-and-select guard, measured on CPU (Adam, 4.2M parameters, torch 2.13):
    fused 3.2 ms per step with or without it; foreach 28.8 -> 54.1 ms; for-loop 40.2 -> 109.3
    ms, plus one copy of the parameters and moments; the host-decided step costs what
    torch.amp's does (``benchmarks.overhead``'s optimizer rows). Prefer ``fused=True`` where
    torch has it: no copy and no sync.

    ``step_fn`` replaces ``optimizer.step`` (the Apex shim passes the original bound method).

    The call is marked as unimp's own: the GradScaler's check for a user's ``optimizer.step()``
    on gradients still multiplied by the scale stays out of it.

    Inside ``torch.compile`` (:func:`_compiled_guarded_step`) the skip is always decided on the
    device, whatever ``sync`` says: a host read would break the graph.
    """
    if torch.compiler.is_compiling():
        return _compiled_guarded_step(optimizer, bad, args, kwargs, step_fn)
    with _stepping():
        step_fn = optimizer.step if step_fn is None else step_fn
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        # the optimizer's own lazy state (half_update's keys may be there before it: imported)
        fresh = [p for p in params if not _own_state(optimizer, p)]
        imported = {id(p): set(optimizer.state.get(p, {})) & set(_RULE_KEYS) for p in fresh}
        amp_aware = getattr(optimizer, "_step_supports_amp_scaling", False)
        # torch's fused kernels are known to honour found_inf; any other amp-aware optimizer gets
        # the attributes too (its step may read them) and the copy-and-select guard as well
        native = _native(optimizer)
        master = peek(optimizer, "master", None)
        if master is not None:
            master.in_guard = True
        host_skip: bool | None = None
        try:
            if (sync and not amp_aware) or any(p.layout != torch.strided for p in params):
                # decided on the host, as torch.amp.GradScaler decides every step (one sync): asked
                # for, or sparse parameters (torch.where has no sparse kernel). An amp-aware
                # optimizer of one's own is stepped on every call, as torch.amp steps it (it reads
                # found_inf), and guarded below
                with _amp_attributes(optimizer, bad) if amp_aware else contextlib.nullcontext():
                    host_skip = bool(bad != 0)
                    if host_skip:
                        ret = None
                        # the step was taken, and skipped: an LR scheduler stepped after it must
                        # not warn that it ran before optimizer.step() (torch.amp's skip makes it
                        # warn: pytorch/pytorch#44511); the flag its step wrapper sets
                        optimizer._opt_called = True  # type: ignore[attr-defined]
                    else:
                        ret = step_fn(*args, **kwargs)
            elif native:
                with _amp_attributes(optimizer, bad):
                    ret = step_fn(*args, **kwargs)
            else:
                skip = bad != 0
                with torch.no_grad():
                    p_old = [p.detach().clone() for p in params]
                    s_old = {}
                    host = {}
                    for p in params:
                        for k, v in optimizer.state.get(p, {}).items():
                            if isinstance(v, torch.Tensor):
                                s_old[(id(p), k)] = v.detach().clone()
                            else:
                                host[(id(p), k)] = v
                with _amp_attributes(optimizer, bad) if amp_aware else contextlib.nullcontext():
                    ret = step_fn(*args, **kwargs)
                with torch.no_grad():
                    for p, old in zip(params, p_old, strict=True):
                        p.copy_(torch.where(_to(skip, p.device), old, p))
                    changed_host = []
                    for p in params:
                        state = optimizer.state.get(p, {})
                        for k, v in state.items():
                            key = (id(p), k)
                            if key in s_old:
                                # a sync only for state on the host while the flag is on a device
                                v.copy_(torch.where(_to(skip, v.device), s_old[key], v))
                            elif key in host and host[key] is not v and host[key] != v:
                                changed_host.append((state, k, host[key]))
                    if changed_host and bool(skip):
                        for state, k, old in changed_host:
                            state[k] = old
            created = [p for p in fresh if _own_state(optimizer, p)]
            # once per parameter: the step that creates its lazy state (decided on the host already
            # where the step was)
            if created and (host_skip if host_skip is not None else bool(bad != 0)):
                for p in created:
                    # half_update's state that was there before (restored by the guard above) stays
                    kept = {k: v for k, v in optimizer.state.pop(p, {}).items() if k in imported[id(p)]}
                    if kept:
                        optimizer.state[p] = kept
            if master is not None:
                master.to_model()
        finally:
            if master is not None:
                master.in_guard = False
        return ret


def _compiled_guarded_step(
    optimizer: torch.optim.Optimizer,
    bad: torch.Tensor,
    args: tuple,
    kwargs: dict,
    step_fn: Callable[..., Any] | None,
) -> Any:
    """:func:`guarded_step` as ``torch.compile`` traces it: always the copy-and-select guard (the
    compiler fuses the copies and selects into the update's kernels), and nothing decided on the
    host.

    A fused optimizer's kernel runs outside the compiler (``torch.compiler.disable``), and a
    ``found_inf`` attribute set in the traced frame does not reach it across torch.optim's graph
    break (measured, torch 2.13: a skipped step wrote inf into the parameters). So it skips
    natively only where the caller set ``optimizer.found_inf`` to a float32 0-d tensor before the
    compiled call (:func:`native_flag`; the compiled train step does): the flag is written in
    place and the kernel reads it, with no copy. Otherwise the guard, right for every optimizer. Nothing is wrapped around ``optimizer.step``: torch's step
    graph-breaks on purpose (``torch.optim``'s ``_use_grad``), and dynamo cannot resume a graph
    inside a context manager of unimp's; the GradScaler's misuse check is off under compilation.
    Two things need the host and are not done here: dropping the lazy per-parameter state a
    skipped first step creates (run the first step eagerly: the compiled train step does), and
    restoring state that is not a tensor (torch's optimizers keep none per parameter).
    """
    step_fn = optimizer.step if step_fn is None else step_fn
    held = optimizer.__dict__.get("found_inf")
    if isinstance(held, torch.Tensor) and _native(optimizer):  # set before the call: native skip
        held.copy_(bad)
        return step_fn(*args, **kwargs)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    master = peek(optimizer, "master", None)
    if master is not None:
        master.in_guard = True
    skip = bad != 0
    with torch.no_grad():
        p_old = [p.detach().clone() for p in params]
        s_old = [
            (v, v.detach().clone()) for p in params for v in optimizer.state.get(p, {}).values()
            if isinstance(v, torch.Tensor)
        ]  # fmt: skip
    ret = step_fn(*args, **kwargs)
    with torch.no_grad():
        for p, old in zip(params, p_old, strict=True):
            p.copy_(torch.where(_to(skip, p.device), old, p))
        for v, old in s_old:
            v.copy_(torch.where(_to(skip, v.device), old, v))
    if master is not None:
        master.to_model()
        master.in_guard = False
    return ret


def _native(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips natively on ``found_inf``: torch's fused kernels."""
    amp_aware = getattr(optimizer, "_step_supports_amp_scaling", False)
    return amp_aware and all(g.get("fused", False) for g in optimizer.param_groups)


@contextlib.contextmanager
def native_flag(optimizer: torch.optim.Optimizer, device: torch.device) -> Iterator[None]:
    """For a call of a compiled step: a fused optimizer holds ``grad_scale = None`` and a
    float32 0-d ``found_inf`` on ``device`` (zero; the compiled guard writes the step's flag into
    it, and torch's fused kernel skips on it), removed after the call; any other optimizer is
    left alone (the compiled guard copies and selects)."""
    if not _native(optimizer):
        yield
        return
    with _amp_attributes(optimizer, torch.zeros((), dtype=torch.float32, device=device)):
        yield


def _own_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> bool:
    """Whether ``p`` has optimizer state besides :func:`half_update`'s keys."""
    return any(k not in _RULE_KEYS for k in optimizer.state.get(p, {}))


def check_half_state(optimizer: torch.optim.Optimizer) -> None:
    """Once per optimizer: :func:`unimp.step.warn_half_optimizer_state` when an adaptive
    optimizer (a numeric ``eps``) holds trainable float16 parameters, so torch keeps its
    moments in float16 too. Optimizers whose ``eps`` is not a number (Adafactor's pair) are
    left alone, as Keras's and optax's Adafactor."""
    if peek(optimizer, "half_checked", False):
        return
    attach(optimizer).half_checked = True
    if "eps" not in optimizer.defaults:
        return  # SGD & co keep no second moment
    eps = []
    for g in optimizer.param_groups:
        if any(p.dtype == torch.float16 and p.requires_grad for p in g["params"]):
            value = g.get("eps", optimizer.defaults["eps"])
            try:  # a float, a NumPy scalar or a 0-d tensor
                eps.append(float(value))
            except (TypeError, ValueError, RuntimeError):
                return
    if eps:
        warn_half_optimizer_state(type(optimizer).__name__, min(eps))


def param_grads(optimizer: torch.optim.Optimizer) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """``(parameter, gradient)`` for each parameter of ``optimizer`` with a gradient, each ONCE:
    a parameter listed twice in the parameter groups (torch's optimizers warn and allow it) is
    unscaled, checked and clipped once (torch.amp's GradScaler unscales it twice). A sparse
    gradient is given as its values (a float16 one coalesced first, in place of ``p.grad``)."""
    out, seen = [], set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None or id(p) in seen:
                continue
            seen.add(id(p))
            if p.grad.is_sparse:
                if p.grad.dtype is torch.float16:
                    p.grad = p.grad.coalesce()
                out.append((p, p.grad._values()))
            else:
                out.append((p, p.grad))
    return out


def _param_names(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.nn.Parameter]]:
    names = peek(optimizer, "names", {})
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            out.append((names.get(id(p), f"param_groups[{gi}]['params'][{pi}]"), p))
    return out


class UpdateOps:
    """:mod:`unimp.rounding`'s array namespace over torch tensors on one device: float32 /
    int32 tensors, bit patterns by ``view`` (exact), int32 arithmetic wrapping as NumPy's."""

    where = staticmethod(torch.where)
    isfinite = staticmethod(torch.isfinite)

    def __init__(self, device: Any = "cpu") -> None:
        self.device = torch.device(device)

    def f32(self, x: Any) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x.to(torch.float32)
        return torch.tensor(x, dtype=torch.float32, device=self.device)

    def i32(self, x: Any) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x.to(torch.int32)
        return torch.tensor(x, dtype=torch.int32, device=self.device)

    @staticmethod
    def to_dtype(x: torch.Tensor, dtype: str) -> torch.Tensor:
        return x.to(getattr(torch, dtype))

    @staticmethod
    def bits(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32).view(torch.int32)

    @staticmethod
    def from_bits(b: torch.Tensor) -> torch.Tensor:
        return b.view(torch.float32)

    def iota(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.arange(math.prod(shape), dtype=torch.int32, device=self.device).reshape(shape)

    xor = staticmethod(torch.bitwise_xor)
    and_ = staticmethod(torch.bitwise_and)

    @staticmethod
    def shr(x: torch.Tensor, k: int) -> torch.Tensor:
        """Logical right shift (torch's ``>>`` on int32 is arithmetic: masked)."""
        return torch.bitwise_and(torch.bitwise_right_shift(x, k), (1 << (32 - k)) - 1)

    @staticmethod
    def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    @staticmethod
    def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b  # int32 wraps modulo 2**32


_HALF = (torch.float16, torch.bfloat16)
#: the keys :func:`half_update` keeps in a half parameter's optimizer state
_COMPENSATION = "compensation"
_UPDATE_STEP = "update_step"
_RULE_KEYS = (_COMPENSATION, _UPDATE_STEP)


class _HalfUpdate:
    """The hooks :func:`half_update` installs on one optimizer (see it)."""

    def __init__(self, optimizer: torch.optim.Optimizer, mode: str, seed: int) -> None:
        self.mode = mode
        self.seed = seed
        self.started = False  # a step has run: the seed is part of the parameters now
        self.warned_sparse = False
        self.pending: list[tuple[int, int, torch.nn.Parameter, torch.Tensor, dict]] | None = None
        self.loaded: dict[int, torch.Tensor] = {}
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)
        optimizer.register_load_state_dict_pre_hook(self._load_pre)
        optimizer.register_load_state_dict_post_hook(self._load_post)

    @torch.no_grad()
    def _pre(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        # torch hands the hook the step's arguments with the optimizer first
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:
            raise TypeError(
                "an optimizer with unimp's half_update takes no closure (its float32 step runs on "
                "copies of the parameters, so a closure would not see them): compute the loss and "
                "call loss.backward() before optimizer.step(), as with torch.amp's GradScaler."
            )
        self._restore(optimizer)  # a step that raised left its float32 copies in the groups
        if self.mode == "stochastic":  # a float16 group added since: refused before any write
            for g in optimizer.param_groups:
                for p in g["params"]:
                    if p.dtype == torch.float16 and p.grad is not None:
                        check_update_mode("stochastic", "float16")
        pending = []
        index = 0
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                here, index = index, index + 1
                if p.grad is None or p.dtype not in _HALF or p.layout != torch.strided:
                    continue
                if p.grad.is_sparse:
                    if not self.warned_sparse:
                        self.warned_sparse = True
                        warnings.warn(
                            f"half_update: a sparse gradient (a torch.nn.Embedding(sparse=True)) is "
                            f"applied by the optimizer itself, rounded to nearest, not by "
                            f"update={self.mode!r}; use dense gradients (sparse=False) for the rule.",
                            UserWarning,
                            stacklevel=4,
                        )
                    continue
                wide = p.detach().to(torch.float32).requires_grad_(p.requires_grad)
                wide.grad = p.grad.to(torch.float32)
                held = optimizer.state.pop(p, None)
                if held is not None:
                    optimizer.state[wide] = {
                        k: (v.to(torch.float32) if isinstance(v, torch.Tensor) and v.dtype == p.dtype
                            and k != _COMPENSATION else v)
                        for k, v in held.items()
                        if k not in (_COMPENSATION, _UPDATE_STEP)
                    }
                group["params"][pi] = wide
                pending.append((gi, pi, p, wide, here, held))
        self.pending = pending

    @torch.no_grad()
    def _post(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        pending, self.pending = self.pending, None
        if not pending:
            return
        self.started = True
        found_inf = getattr(optimizer, "found_inf", None)  # set by unimp's guard / GradScaler
        for gi, pi, p, wide, index, held in pending:
            optimizer.param_groups[gi]["params"][pi] = p
            state = optimizer.state.pop(wide, {})
            held = {} if held is None else held
            ops = UpdateOps(p.device)
            comp = held.get(_COMPENSATION)
            if self.mode == "kahan" and comp is None:
                comp = torch.zeros_like(p)
            count = held.get(_UPDATE_STEP)
            if self.mode == "stochastic" and count is None:
                count = torch.zeros((), dtype=torch.int32, device=p.device)
            new, new_comp = update_half(
                ops, self.mode, p.detach(), wide.detach(), comp,
                seed=self.seed, step=count if count is not None else 0, index=index,
            )
            skip = None if found_inf is None else _to(found_inf != 0, p.device)
            if skip is not None:
                new = torch.where(skip, p, new)
            p.copy_(new)
            out = {}
            for k, v in state.items():  # the inner optimizer's state, in the dtypes it had
                old = held.get(k)
                if isinstance(v, torch.Tensor) and isinstance(old, torch.Tensor) and old.dtype == p.dtype:
                    old.copy_(v.to(p.dtype))
                    out[k] = old
                elif (old is None and isinstance(v, torch.Tensor) and v.dtype == torch.float32
                      and k != "step" and v.shape == p.shape):
                    out[k] = v.to(p.dtype)  # created by this step: as it would be for p
                else:
                    out[k] = v
            if self.mode == "kahan":
                out[_COMPENSATION] = new_comp if skip is None else torch.where(skip, comp, new_comp)
            if self.mode == "stochastic":
                out[_UPDATE_STEP] = count + 1 if skip is None else torch.where(skip, count, count + 1)
            if out:
                optimizer.state[p] = out

    @torch.no_grad()
    def _restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Puts back the parameters and state of a step that raised (nothing applied)."""
        pending, self.pending = self.pending, None
        for gi, pi, p, wide, _, held in pending or ():
            optimizer.param_groups[gi]["params"][pi] = p
            optimizer.state.pop(wide, None)
            if held is not None:
                optimizer.state[p] = held

    def _load_pre(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        # torch casts every floating param's state tensor to the param's dtype (the counter
        # is int32): kept aside and put back after the load
        self._restore(optimizer)
        self.loaded = {}
        state = dict(state_dict.get("state", {}))
        for key, entry in state.items():
            if isinstance(entry, dict) and _UPDATE_STEP in entry:
                entry = dict(entry)
                self.loaded[key] = entry.pop(_UPDATE_STEP)
                state[key] = entry
        return {**state_dict, "state": state}

    def _load_post(self, optimizer: torch.optim.Optimizer) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for key, count in self.loaded.items():
            if isinstance(key, int) and 0 <= key < len(params):
                p = params[key]
                optimizer.state[p][_UPDATE_STEP] = torch.as_tensor(count).to(torch.int32).to(p.device)
        self.loaded = {}


def half_update(
    optimizer: torch.optim.Optimizer, update: str = "kahan", *, seed: int = 0
) -> torch.optim.Optimizer:
    """Makes ``optimizer`` (any ``torch.optim`` optimizer) apply its updates to half-precision
    parameters Kahan-compensated or stochastically rounded (:mod:`unimp.rounding`; pure
    bfloat16 training that learns), in place.

    Each step runs the optimizer in float32 on float32 copies of the half parameters and
    gradients that have one (its half state tensors seen as float32 and stored back in the
    dtype it keeps them, so Adam's moments of bfloat16 parameters stay bfloat16), and writes
    each half parameter by the rule :func:`unimp.rounding.update_half`, the same in
    TensorFlow and JAX. The copies are made per step: the optimizer's persistent state is
    what it keeps plus, for ``"kahan"``, a compensation buffer per half parameter in its dtype
    (``optimizer.state[p]["compensation"]``: 2 bytes per bfloat16 parameter) and, for
    ``"stochastic"``, an int32 count of the parameter's applied updates
    (``state[p]["update_step"]``, the ``step`` of its random bits; the parameter's ``index``
    is its position in ``param_groups``). Both are in ``state_dict()`` and load back exactly.
    Float32 parameters step as the optimizer steps them.

    Under unimp's guard (``mp.train_step``, unimp's ``GradScaler.step``) a skipped step leaves
    parameters, state, compensation and count bitwise as they were, with no host sync; torch's
    own ``GradScaler`` steps only clean steps. ``step`` takes no closure.

    Args:
        optimizer: a ``torch.optim.Optimizer``.
        update: ``"kahan"``, ``"stochastic"`` (bfloat16 parameters) or ``"nearest"``
            (rounded to nearest from the float32 result).
        seed: the stochastic-rounding seed, an integer (its low 32 bits are used).

    Returns:
        ``optimizer`` itself.

    Raises:
        TypeError: not a torch optimizer, a seed that is not an integer, or the rule installed
            on it already.
        ValueError: an unknown ``update``; stochastic rounding of float16 parameters.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
        >>> opt = half_update(torch.optim.SGD([w], lr=1.0), "kahan")
        >>> for _ in range(1000):
        ...     w.grad = torch.full_like(w, 1e-3)
        ...     opt.step()
        >>> abs(float(w)) < 1e-2
        True
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"half_update needs a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    mode = check_update_mode(update)
    seed = check_seed(seed, "half_update: seed")
    if mode == "stochastic":
        for g in optimizer.param_groups:
            for p in g["params"]:
                if p.dtype == torch.float16:
                    check_update_mode(mode, "float16")
    if peek(optimizer, "half_update", None) is not None:
        raise TypeError("half_update is installed on this optimizer already.")
    # a state_dict loaded before the rule was installed had its int32 counters cast to the
    # parameters' dtype by torch: back to int32 (exact below 2**8 in bfloat16; load after
    # installing, as mp.prepare does, to keep larger counts)
    for state in optimizer.state.values():
        count = state.get(_UPDATE_STEP)
        if isinstance(count, torch.Tensor) and count.dtype != torch.int32:
            state[_UPDATE_STEP] = count.round().to(torch.int32)
    attach(optimizer).half_update = _HalfUpdate(optimizer, mode, seed)
    return optimizer


def _rule_of(optimizer: torch.optim.Optimizer) -> _HalfUpdate:
    held = peek(optimizer, "half_update", None) if isinstance(optimizer, torch.optim.Optimizer) else None
    if held is None:
        raise ValueError(
            "this optimizer applies no update rule: install one with "
            "unimp.backends.torch.half_update(optimizer, 'kahan') (mp.prepare does for a policy "
            "with update=)."
        )
    return held


def export_update_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's update-rule state in the portable format of
    :func:`unimp.rounding.check_update_state` (NumPy arrays, parameter order of
    ``param_groups``), for :func:`import_update_state` in any backend.

    Raises:
        ValueError: the optimizer has no :func:`half_update`.
    """
    held = _rule_of(optimizer)
    held._restore(optimizer)
    params = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            state = optimizer.state.get(p, {})
            comp, step = state.get(_COMPENSATION), state.get(_UPDATE_STEP)
            if comp is None and step is None:
                params.append(None)
                continue
            params.append({
                "step": 0 if step is None else int(step),
                "compensation": None if comp is None else comp.detach().float().cpu().numpy(),
            })
    return {"update": held.mode, "seed": held.seed, "params": params}


def import_update_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Sets the optimizer's update-rule state (compensation buffers, stochastic rounding's
    counters, the seed) from :func:`export_update_state`'s dict of any backend, so the run
    continues where that one stopped. All is checked before anything changes.

    Raises:
        ValueError: no :func:`half_update`, another mode, another number of parameters, or a
            compensation buffer whose shape is not its parameter's.
    """
    held = _rule_of(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    checked = check_update_state(state, held.mode, len(params))
    for i, (p, entry) in enumerate(zip(params, checked["params"], strict=True)):
        comp = None if entry is None else entry["compensation"]
        if comp is not None and (p.dtype not in _HALF or tuple(comp.shape) != tuple(p.shape)):
            raise ValueError(
                f"params[{i}]: a compensation buffer of shape {tuple(comp.shape)} for a {p.dtype} "
                f"parameter of shape {tuple(p.shape)}: export and import the same model (a "
                "transposed layout needs the buffer transposed too)."
            )
    held._restore(optimizer)
    with torch.no_grad():
        for p, entry in zip(params, checked["params"], strict=True):
            st = optimizer.state.get(p)
            if entry is None:
                if st is not None:
                    st.pop(_COMPENSATION, None)
                    st.pop(_UPDATE_STEP, None)
                continue
            st = optimizer.state[p]  # a defaultdict: created when missing
            if held.mode == "kahan":
                comp = entry["compensation"]
                st[_COMPENSATION] = (
                    torch.zeros_like(p) if comp is None else torch.from_numpy(comp).to(p.device, p.dtype)
                )
            if held.mode == "stochastic":
                st[_UPDATE_STEP] = torch.tensor(entry["step"], dtype=torch.int32, device=p.device)
    held.seed = checked["seed"]
    held.started = True
