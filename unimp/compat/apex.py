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
* Leaving ``scale_loss`` unscales the gradients (into the float32 masters in O2), checks them
  and updates the scale, as Apex did; the next ``optimizer.step()`` is skipped when they
  overflowed, on the device, leaving parameters and optimizer state bitwise unchanged.

Unlike Apex, it runs on any device torch.autocast supports (the model's device is used), and
needs no CUDA extension.
"""

from __future__ import annotations

import contextlib
import sys
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

_STATE: dict[str, Any] = {"scaler": None, "mp": None, "optimizers": []}

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
        **apex_options: ``verbosity`` and ``num_losses=1`` are accepted and ignored.

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
    if apex_options.get("num_losses", 1) != 1:
        raise ValueError("num_losses > 1 is not supported: one loss scaler serves every loss.")
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
            f"(got {len(model_list)} model(s), {len(opt_list)} optimizer(s))."
        )
    config = _loss_scale_config(opt_level, loss_scale, min_loss_scale, max_loss_scale)
    params = [p for m in model_list for p in m.parameters()]
    device = params[0].device if params else _ut.default_device()
    recipe = get_recipe(opt_level, loss_scale=config)
    mp = _ut.MixedPrecision(recipe, device=device)
    if opt_level == "O2":
        mp.prepare(model_list[0], opt_list[0])
    else:
        for m in model_list:
            mp.prepare(m)
    scaler = _ut.GradScaler(config, device=device)
    for o in opt_list:
        _patch_step(o, scaler)
    _STATE.update(scaler=scaler, mp=mp, optimizers=opt_list)
    out_models = model_list if models_listed else model_list[0]
    if optimizers is None:
        return out_models
    return out_models, (opt_list if opts_listed else opt_list[0])


def _patch_step(optimizer: torch.optim.Optimizer, scaler: _ut.GradScaler) -> None:
    """Makes ``optimizer.step()`` skip on the device after an overflowing ``scale_loss``."""
    original = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        pending = peek(optimizer, "apex_bad", None)
        if pending is None:
            return original(*args, **kwargs)
        attach(optimizer).apex_bad = None
        return _ut_optimizer._guarded_step(optimizer, pending, args, kwargs, step_fn=original)

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
    """Apex's ``amp.scale_loss``: yields ``loss.float() * scale``; on exit unscales the
    optimizers' gradients, checks them and updates the scale (unless ``delay_unscale``, used
    for gradient accumulation: the gradients stay scaled until a later ``scale_loss``).

    Raises:
        RuntimeError: :func:`initialize` was not called.
        ValueError: an optimizer that was not passed to :func:`initialize`.
    """
    scaler = _STATE["scaler"]
    if scaler is None:
        raise RuntimeError("call amp.initialize(model, optimizer, opt_level=...) before amp.scale_loss.")
    opts, _ = _as_list(optimizers)
    strangers = [o for o in opts if peek(o, "apex_bad", _STRANGER) is _STRANGER]
    if strangers:
        raise ValueError(
            "scale_loss got an optimizer that was not passed to amp.initialize; its step could not "
            "be skipped on overflow. Pass every optimizer to amp.initialize."
        )
    yield scaler.scale(loss.float())
    if delay_unscale:
        return
    for o in opts:
        scaler.unscale_(o)
    for o in opts:
        st = scaler._opt_state(o)
        bad = torch.where(scaler._loss_finite, st["found_inf"], torch.ones_like(st["found_inf"]))
        attach(o).apex_bad = bad
    scaler.update()


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.nn.Parameter]:
    """The parameters the optimizer updates: float32 masters in O2 (clip these)."""
    return _ut.master_params(optimizer)


def state_dict(destination: Any = None) -> dict[str, Any]:
    """The loss scaler's state in unimp's portable format (JSON-able)."""
    scaler = _STATE["scaler"]
    if scaler is None:
        raise RuntimeError("call amp.initialize(...) before amp.state_dict().")
    return scaler.state_dict()


def load_state_dict(state_dict: Mapping[str, Any]) -> None:
    """Loads :func:`state_dict` output, or an Apex checkpoint's ``{"loss_scaler0":
    {"loss_scale": ..., "unskipped": ...}}`` (the scale and the clean-step count carry over).

    Raises:
        RuntimeError: :func:`initialize` was not called.
        ValueError: a malformed dict; nothing is changed.
    """
    scaler = _STATE["scaler"]
    if scaler is None:
        raise RuntimeError("call amp.initialize(...) before amp.load_state_dict().")
    if isinstance(state_dict, Mapping) and "loss_scaler0" in state_dict:
        extra = sorted(k for k in state_dict if k != "loss_scaler0")
        if extra:
            raise ValueError(f"Apex state_dict with several loss scalers ({extra}) is not supported.")
        old = state_dict["loss_scaler0"]
        if not isinstance(old, Mapping) or "loss_scale" not in old or "unskipped" not in old:
            raise ValueError("Apex 'loss_scaler0' needs 'loss_scale' and 'unskipped'.")
        cfg = scaler.config
        counter = int(old["unskipped"])
        if cfg.dynamic:
            counter %= cfg.growth_interval
        state = LossScaleState(float(old["loss_scale"]), counter, 0, 0)
        scaler.load_state_dict(portable_state_dict(cfg, state))
        return
    scaler.load_state_dict(state_dict)


#: ``from unimp.compat.apex import amp`` gives this module, as ``from apex import amp`` did.
amp = sys.modules[__name__]
