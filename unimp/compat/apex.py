"""Apex amp, rebuilt on torch.amp and unimp's torch backend.

Apex's ``amp`` was removed from NVIDIA Apex in 2025 and ``pip install apex`` installs an
unrelated package, yet many training scripts still use it. Change only the import line::

    from apex import amp                      # before
    from unimp.compat.apex import amp         # after

and ``amp.initialize``, ``amp.scale_loss``, ``amp.master_params``, ``amp.state_dict`` and
``amp.load_state_dict`` behave as Apex's did:

* ``O0``: float32, no loss scaling. ``O1``: float32 model under ``torch.autocast`` (float16),
  dynamic loss scale. ``O2``: float16 model with float32 normalization layers, inputs cast to
  float16 and outputs to float32, float32 master weights in the optimizer, dynamic loss scale.
  ``O3``: pure float16, static scale 1.
* The dynamic scale is Apex's (``DynamicLossScale.preset("apex")``: init 2**16, x2 every 2000
  clean steps, /2 on overflow, ``max_loss_scale`` 2**24, ``min_loss_scale``), computed by
  unimp's rule on the device.
* Leaving ``scale_loss`` unscales the gradients the block produced (into the float32 masters in
  O2), checks them, adds back those held before it and updates the scale, as Apex did, so
  several blocks (several losses, or accumulation over iterations) sum into one step; the next
  ``optimizer.step()`` is skipped when any of them overflowed, on the device, leaving
  parameters and optimizer state bitwise unchanged.
* ``num_losses=N`` keeps one loss scaler per loss, as Apex does: ``scale_loss(...,
  loss_id=i)`` scales, checks and updates with scaler ``i`` alone, an overflow in any loss
  skips the step of the optimizers its block names, and ``state_dict()`` holds one entry per
  scaler (``loss_scaler0``, ``loss_scaler1``, ...).
* Several models with one or several optimizers run in O0, O1 and O3. Not supported, and
  refused in one line by :func:`initialize`: O2 with more than one model or more than one
  optimizer (unimp keeps float32 master weights for one model's optimizer), and Apex's
  ``cast_model_type``, ``patch_torch_functions``, ``keep_batchnorm_fp32`` / ``master_weights``
  values other than the level's own.

Unlike Apex, it runs on any device torch.autocast supports (the model's device is used), and
needs no CUDA extension.
"""

from __future__ import annotations

import contextlib
import numbers
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from unimp.attached import attach, peek
from unimp.backends import torch as _ut
from unimp.backends.torch import optimizer as _ut_optimizer
from unimp.loss_scale import DynamicLossScale, LossScaleState, NoLossScale, StaticLossScale
from unimp.loss_scale import state_dict as portable_state_dict
from unimp.recipe import get_recipe

__all__ = ["amp", "initialize", "load_state_dict", "master_params", "scale_loss", "state_dict"]

_OPT_LEVELS = ("O0", "O1", "O2", "O3")
# Apex's per-level defaults: (keep_batchnorm_fp32, master_weights)
_DEFAULTS = {"O0": (None, False), "O1": (None, None), "O2": (True, True), "O3": (False, False)}

_STATE: dict[str, Any] = {"scalers": [], "mp": None, "optimizers": []}

_STRANGER = object()  # peek's default for an optimizer amp.initialize never saw


def _as_list(x: Any) -> tuple[list[Any], bool]:
    if isinstance(x, (list, tuple)):
        return list(x), True
    return [x], False


def _loss_scale_config(opt_level: str, loss_scale: Any, min_loss_scale: Any, max_loss_scale: Any):
    if loss_scale is None:
        loss_scale = {"O0": 1.0, "O1": "dynamic", "O2": "dynamic", "O3": 1.0}[opt_level]
    if isinstance(loss_scale, str):
        if loss_scale != "dynamic":
            raise ValueError(f"loss_scale must be 'dynamic' or a number, got {loss_scale!r}.")
        overrides: dict[str, Any] = {"min_scale": None if min_loss_scale is None else float(min_loss_scale)}
        overrides["max_scale"] = None if max_loss_scale is None else float(max_loss_scale)
        overrides["init_scale"] = min(2.0**16, overrides["max_scale"] or 2.0**16)
        return DynamicLossScale.preset("apex", **overrides)
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)):
        raise ValueError(f"loss_scale must be 'dynamic' or a number, got {loss_scale!r}.")
    if float(loss_scale) == 1.0:
        return NoLossScale()  # scale 1: nothing to unscale, float16 gradients are fine (O3)
    return StaticLossScale(float(loss_scale))


def initialize(
    models: Any,
    optimizers: Any = None,
    opt_level: str = "O1",
    loss_scale: Any = None,
    keep_batchnorm_fp32: bool | None = None,
    master_weights: bool | None = None,
    min_loss_scale: float | None = None,
    max_loss_scale: float | None = 2.0**24,
    **apex_options: Any,
) -> Any:
    """Apex's ``amp.initialize``: applies an opt level to models and optimizers, in place.

    Args:
        models: a ``torch.nn.Module`` or a list of them (on the device to train on).
        optimizers: an optimizer, a list of them, or None (O2 needs them: they get the
            float32 master weights).
        opt_level: ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"``.
        loss_scale: ``"dynamic"`` or a number (static); default per level as Apex.
        keep_batchnorm_fp32, master_weights: accepted where they equal what the level does
            (O2: True, True; O3: False, False).
        min_loss_scale, max_loss_scale: bounds of the dynamic scale (Apex's defaults).
        **apex_options: ``num_losses``, an int >= 1 (default 1): one loss scaler per loss,
            chosen by ``scale_loss(..., loss_id=)``, as Apex keeps. ``verbosity`` is accepted
            and ignored.

    Returns:
        ``models`` (and ``optimizers``, when given), in the structure they were passed.

    Raises:
        ValueError: unknown opt level, an option combination this shim does not run (named),
            or float16 parameters that would get float16 gradients under loss scaling.
        TypeError: an unknown Apex option.
    """
    if opt_level not in _OPT_LEVELS:
        raise ValueError(f"opt_level must be one of {_OPT_LEVELS} (capital O), got {opt_level!r}.")
    unknown = sorted(set(apex_options) - {"verbosity", "num_losses"})
    if unknown:
        raise TypeError(f"unimp.compat.apex.initialize does not support {unknown}.")
    num_losses = apex_options.get("num_losses", 1)
    if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"num_losses must be an int >= 1 (one loss scaler per loss), got {num_losses!r}.")
    bn_default, mw_default = _DEFAULTS[opt_level]
    if keep_batchnorm_fp32 is not None and keep_batchnorm_fp32 != bool(bn_default) and opt_level in ("O2", "O3"):
        raise ValueError(
            f"keep_batchnorm_fp32={keep_batchnorm_fp32} with {opt_level} is not supported; "
            f"{opt_level} runs with keep_batchnorm_fp32={bool(bn_default)}."
        )
    if master_weights is not None and master_weights != bool(mw_default) and opt_level in ("O2", "O3"):
        raise ValueError(
            f"master_weights={master_weights} with {opt_level} is not supported; {opt_level} runs "
            f"with master_weights={bool(mw_default)}."
        )
    model_list, models_listed = _as_list(models)
    opt_list, opts_listed = ([], False) if optimizers is None else _as_list(optimizers)
    for m in model_list:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"models must be torch.nn.Module(s), got {type(m).__name__}.")
    for o in opt_list:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"optimizers must be torch.optim.Optimizer(s), got {type(o).__name__}.")
    if opt_level == "O2" and (len(model_list) != 1 or len(opt_list) != 1):
        raise ValueError(
            "O2 keeps float32 master weights in the optimizer: pass one model and its one optimizer "
            f"(got {len(model_list)} model(s), {len(opt_list)} optimizer(s)); several models or "
            "optimizers run in O1 (autocast), which keeps float32 weights and needs no masters."
        )
    config = _loss_scale_config(opt_level, loss_scale, min_loss_scale, max_loss_scale)
    params = [p for m in model_list for p in m.parameters()]
    device = params[0].device if params else _ut.default_device()
    recipe = get_recipe(opt_level, loss_scale=config)
    mp = _ut.MixedPrecision(recipe, device=device)
    if opt_level == "O2":
        mp.prepare(model_list[0], opt_list[0])
    else:
        # the last model is prepared with the optimizer once every model is cast, so the
        # half-optimizer-state check (O3 with Adam) sees its float16 parameters, as
        # mp.prepare(model, adam) does
        last_opt = opt_list[0] if len(opt_list) == 1 else None
        for i, m in enumerate(model_list):
            mp.prepare(m, last_opt if i == len(model_list) - 1 else None)
        if len(opt_list) > 1:  # each optimizer gets the check mp.prepare(model, opt) runs
            for o in opt_list:
                _ut_optimizer.check_half_state(o)
    scalers = [_ut.GradScaler(config, device=device) for _ in range(num_losses)]
    for o in opt_list:
        _patch_step(o)
    _STATE.update(scalers=scalers, mp=mp, optimizers=opt_list)
    out_models = model_list if models_listed else model_list[0]
    if optimizers is None:
        return out_models
    return out_models, (opt_list if opts_listed else opt_list[0])


def _patch_step(optimizer: torch.optim.Optimizer) -> None:
    """Makes ``optimizer.step()`` skip on the device after an overflowing ``scale_loss``."""
    original = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        pending = peek(optimizer, "apex_bad", None)
        if pending is None:
            return original(*args, **kwargs)
        attach(optimizer).apex_bad = None
        # decided on the host, as Apex's patched step reads its overflow flag
        return _ut_optimizer.guarded_step(optimizer, pending, args, kwargs, step_fn=original, sync=True)

    optimizer.step = step  # type: ignore[method-assign]
    attach(optimizer).apex_bad = None


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: Any = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[torch.Tensor]:
    """Apex's ``amp.scale_loss``: yields ``loss.float() * scale`` and, on exit, unscales only the
    gradients the block produced.

    Follows Apex (apex/amp/handle.py, ``_prepare_amp_backward`` / ``_post_amp_backward`` in
    apex/amp/_process_optimizer.py): the gradients the optimizers' parameters hold on entry are
    set aside and their ``.grad`` set to None, so the block's backward writes its own gradients
    alone; on exit these are unscaled (into the float32 masters in O2) and checked, the set-aside
    gradients are added back (``scaler.unscale_with_stashed``: ``new / scale + stashed``, only
    ``new`` checked), and the scale is updated (Apex's ``update_scale``, at each block's exit).
    So several blocks before one ``optimizer.step()`` sum their gradients, as Apex's gradient
    accumulation does (``loss / iters_to_accumulate`` in each block), and an overflow in any of
    them skips that step, once.

    ``delay_unscale=True`` (Apex's accumulation without unscaling) leaves the block's gradients
    scaled, added to those of earlier delayed blocks, and updates nothing; the next block without
    it unscales them all with its own. The unscaled gradients held before such a run are set
    aside until then, so they are never unscaled twice.

    Args:
        loss: the loss tensor (float16 under autocast is fine: it is scaled in float32).
        optimizers: the optimizer, or a list of them, passed to :func:`initialize`.
        loss_id: which loss scaler, in ``[0, num_losses)`` (:func:`initialize`'s
            ``num_losses``): the block is scaled, checked and updated by that scaler alone.
        model, delay_overflow_check: accepted and ignored, as Apex ignores ``model``
            (``delay_overflow_check`` was for Apex's fused optimizers).
        delay_unscale: keep this block's gradients scaled (see above).

    Yields:
        The float32 scaled loss, to call ``.backward()`` on.

    Raises:
        RuntimeError: :func:`initialize` was not called.
        ValueError: an optimizer that was not passed to :func:`initialize`, or a ``loss_id``
            outside ``[0, num_losses)``.

    A block that raises (in its body or on exit) leaves the gradients as they were on entry.

    Example:
        >>> model = torch.nn.Module()
        >>> model.p = torch.nn.Parameter(torch.ones(()))
        >>> model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> for k in (3.0, 5.0):  # two backward passes into one step
        ...     with amp.scale_loss(k * model.p, opt) as scaled:
        ...         scaled.backward()
        >>> model.p.grad  # 3 + 5, each unscaled once
        tensor(8.)
        >>> opt.step()
        >>> model.p
        Parameter containing:
        tensor(0.2000, requires_grad=True)
    """
    scalers = _STATE["scalers"]
    if not scalers:
        raise RuntimeError("call amp.initialize(model, optimizer, opt_level=...) before amp.scale_loss.")
    if isinstance(loss_id, bool) or not isinstance(loss_id, numbers.Integral) or not 0 <= loss_id < len(scalers):
        raise ValueError(
            f"loss_id must be an int in [0, {len(scalers)}) (amp.initialize(..., num_losses="
            f"{len(scalers)})), got {loss_id!r}; pass num_losses=N to amp.initialize for N losses."
        )
    scaler = scalers[int(loss_id)]
    opts, _ = _as_list(optimizers)
    strangers = [o for o in opts if peek(o, "apex_bad", _STRANGER) is _STRANGER]
    if strangers:
        raise ValueError(
            "scale_loss got an optimizer that was not passed to amp.initialize; its step could not "
            "be skipped on overflow. Pass every optimizer to amp.initialize."
        )
    loss_flag = scaler.loss_finite  # scale() records the loss check: a failed block takes it back
    scaled = scaler.scale(loss.float())
    entry = [_set_aside(o) for o in opts]  # each optimizer's (parameter, gradient) on entry
    try:
        yield scaled
        held, carried = [], []  # unscaled gradients from before the run; scaled ones of delayed blocks
        for o, before in zip(opts, entry, strict=True):
            run = peek(o, "apex_held", None)
            held.append(before if run is None else run)
            carried.append([] if run is None else before)
            _add_back(carried[-1])
        if delay_unscale:
            for o, h in zip(opts, held, strict=True):
                attach(o).apex_held = h
            return
        for o in opts:
            scaler.unscale_(o)
        bads = []
        for o in opts:
            found_inf = scaler.found_inf(o)  # the block's own gradients only
            bads.append(torch.where(scaler.loss_finite, found_inf, torch.ones_like(found_inf)))
        for h in held:
            _add_back(h)
        scaler.update()
    except BaseException:
        for before in entry:
            for p, g in before:
                p.grad = g
        scaler.loss_finite = loss_flag
        raise
    for o, bad in zip(opts, bads, strict=True):
        pending = peek(o, "apex_bad", None)  # an earlier block's overflow still skips the step
        attach(o).apex_bad = bad if pending is None else torch.maximum(pending, bad)
        attach(o).apex_held = None


def _set_aside(optimizer: torch.optim.Optimizer) -> list[tuple[torch.nn.Parameter, torch.Tensor | None]]:
    """Apex's ``_prepare_amp_backward``: sets the ``.grad`` of the optimizer's parameters (and,
    in O2, of the half model parameters behind its masters) to None and returns what they held."""
    params = list(_ut.master_params(optimizer))
    master = peek(optimizer, "master", None)
    if master is not None:
        params += [model_p for model_p, _ in master.pairs]
    out, seen = [], set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append((p, p.grad))
            p.grad = None
    return out


@torch.no_grad()
def _add_back(held: list[tuple[torch.nn.Parameter, torch.Tensor | None]]) -> None:
    """Adds set-aside gradients to the parameters' ``.grad`` (in place where both are dense)."""
    new, old = [], []
    for p, g in held:
        if g is None:
            continue
        if p.grad is None:
            p.grad = g
        elif p.grad.layout == g.layout == torch.strided:
            new.append(p.grad)
            old.append(g)
        else:
            p.grad = p.grad + g
    if new:
        torch._foreach_add_(new, old)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.nn.Parameter]:
    """The parameters the optimizer updates: float32 masters in O2 (clip these)."""
    return _ut.master_params(optimizer)


def state_dict(destination: Any = None) -> dict[str, Any]:
    """The loss scalers' states, as Apex keys them: ``{"loss_scaler0": ..., "loss_scaler1": ...}``
    (one per loss, :func:`initialize`'s ``num_losses``), each in unimp's portable format
    (JSON-able: the config and ``state``, :func:`unimp.loss_scale.state_dict`).

    Args:
        destination: a dict to fill and return (Apex's argument); a new one when None.

    Raises:
        RuntimeError: :func:`initialize` was not called.
    """
    scalers = _STATE["scalers"]
    if not scalers:
        raise RuntimeError("call amp.initialize(...) before amp.state_dict().")
    out = {} if destination is None else destination
    for i, scaler in enumerate(scalers):
        out[f"loss_scaler{i}"] = scaler.state_dict()
    return out


def _portable(scaler: _ut.GradScaler, key: str, value: Any) -> Mapping[str, Any]:
    """One entry of a state dict as the portable state ``scaler`` loads: unimp's own, or an
    Apex checkpoint's ``{"loss_scale": ..., "unskipped": ...}`` (the scale and the clean-step
    count carry over, the count modulo the growth interval)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"amp.load_state_dict: {key!r} must be a dict, got {type(value).__name__}.")
    if "loss_scale" not in value and "unskipped" not in value:
        return value  # unimp's portable state: the scaler checks it
    if "loss_scale" not in value or "unskipped" not in value:
        raise ValueError(f"Apex {key!r} needs 'loss_scale' and 'unskipped'.")
    cfg = scaler.config
    counter = int(value["unskipped"])
    if cfg.dynamic:
        counter %= cfg.growth_interval
    return portable_state_dict(cfg, LossScaleState(float(value["loss_scale"]), counter, 0, 0))


def load_state_dict(state_dict: Mapping[str, Any]) -> None:
    """Loads :func:`state_dict` output, or an Apex checkpoint's ``{"loss_scaler0":
    {"loss_scale": ..., "unskipped": ...}, ...}`` (the scale and the clean-step count carry
    over). As Apex: entries are matched to the loss scalers in order, a count that differs
    from ``num_losses`` warns, and entries beyond ``num_losses`` are skipped.

    Raises:
        RuntimeError: :func:`initialize` was not called.
        ValueError: a malformed dict, or a key that is not ``loss_scalerN``; nothing is
            changed (every entry is checked before any scaler loads).
    """
    scalers = _STATE["scalers"]
    if not scalers:
        raise RuntimeError("call amp.initialize(...) before amp.load_state_dict().")
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"amp.load_state_dict takes a dict, got {type(state_dict).__name__}.")
    unexpected = [k for k in state_dict if not (isinstance(k, str) and k.startswith("loss_scaler"))]
    if unexpected:
        raise ValueError(
            f"amp.load_state_dict: unexpected key(s) {unexpected}; expected 'loss_scaler0', ... "
            "(amp.state_dict()'s output, or an Apex checkpoint's)."
        )
    if len(state_dict) != len(scalers):
        warnings.warn(
            f"amp.load_state_dict: the state dict holds {len(state_dict)} loss scaler(s) while "
            f"amp.initialize(num_losses={len(scalers)}) keeps {len(scalers)}; loading the first "
            f"{min(len(state_dict), len(scalers))} in order, as Apex does.",
            UserWarning,
            stacklevel=2,
        )
    pairs = list(zip(scalers, state_dict.items(), strict=False))
    before = [scaler.state_dict() for scaler, _ in pairs]
    portable = [_portable(scaler, key, value) for scaler, (key, value) in pairs]
    try:
        for scaler, d in zip([s for s, _ in pairs], portable, strict=True):
            scaler.load_state_dict(d)
    except BaseException:
        for (scaler, _), d in zip(pairs, before, strict=True):
            scaler.load_state_dict(d)
        raise


#: ``from unimp.compat.apex import amp`` gives this module, as ``from apex import amp`` did.
amp = sys.modules[__name__]
