"""torch per-layer overrides: :mod:`unimp.overrides` matched on module names, each matched module
run under its own policy.

The paths are ``model.named_modules()`` names (``"l2"``, ``"blocks.0.attn"``); a pattern that
covers a module covers its submodules (the dotted-prefix rule), so the override is applied once,
on the outermost matched modules, by replacing their ``forward`` with :class:`_OverrideForward`:

* autocast mode: a half override runs under ``torch.autocast(device_type, dtype=its compute)``
  (nested autocast regions take the innermost dtype); a float32 override runs under
  ``torch.autocast(device_type, enabled=False)`` with its floating inputs cast to float32,
  which is the guidance of ``torch.autocast``'s docstring (torch/amp/autocast_mode.py:
  "autocast(enabled=False) subregions can be nested in autocast-enabled regions ... In the
  subregion, inputs from the surrounding region should be cast to dtype before use"). Outputs leave in
  the override's output dtype and the model's autocast takes them from there (in a float32 model
  with a half override, which has no autocast outside, they are handed on in float32).
* module mode: the module's parameters and buffers are held in the override's compute dtype
  (float32 ones need no master copy), its floating inputs are cast to that dtype and its
  floating outputs back to the model's compute dtype (what the next module's weights are in),
  as unimp already does for normalization layers.
"""

from __future__ import annotations

from typing import Any

import torch

from unimp.attached import attach
from unimp.backends.torch.casting import cast_tree, to_dtype
from unimp.overrides import resolve_overrides, top_paths
from unimp.policy import Policy


def layer_paths(model: torch.nn.Module) -> list[str]:
    """The dotted paths overrides match in torch: ``named_modules()`` names, the root left out.

    Example:
        >>> import torch
        >>> layer_paths(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
        ['0', '1']
    """
    return [name for name, _ in model.named_modules() if name]


def resolve(policy: Policy, model: torch.nn.Module) -> dict[str, Policy]:
    """The outermost modules the policy's overrides cover: ``{name: override policy}``.

    Raises:
        ValueError: an override conflict (:func:`unimp.overrides.match_overrides`).

    Warns:
        OverrideWarning: a pattern matches no module.
    """
    if not policy.overrides:
        return {}
    return top_paths(resolve_overrides(policy.overrides, layer_paths(model), what="module"))


class _OverrideForward:
    """``module.forward`` of an overridden module: an object holding the module (not a closure),
    so ``copy.deepcopy`` and pickle carry it with the module."""

    def __init__(self, module: torch.nn.Module, policy: Policy, mp: Any) -> None:
        self.module = module
        self.policy = policy
        self.mp = mp
        self.forward = module.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        p, mp = self.policy, self.mp
        compute = to_dtype(p.compute_dtype)
        if mp.mode == "module":
            args, kwargs = cast_tree(args, compute), cast_tree(kwargs, compute)
            return cast_tree(self.forward(*args, **kwargs), mp.compute_dtype)
        device_type = mp.device.type
        if p.is_mixed:
            with torch.autocast(device_type, dtype=compute):
                out = self.forward(*args, **kwargs)
        else:
            with torch.autocast(device_type, enabled=False):
                out = self.forward(*cast_tree(args, compute), **cast_tree(kwargs, compute))
        if mp.compute_dtype == torch.float32:  # a float32 model: no autocast to take them on
            return cast_tree(out, torch.float32)
        return cast_tree(out, p.output_dtype)


def apply_overrides(mp: Any, model: torch.nn.Module, resolved: dict[str, Policy] | None = None) -> dict[str, Policy]:
    """Runs each module the recipe's overrides cover under its override policy, in place.

    Called by ``MixedPrecision.prepare`` (after the module-mode cast); call it yourself only
    for a model you run under :meth:`MixedPrecision.autocast` without ``prepare``.

    Args:
        mp: the torch ``MixedPrecision``.
        model: the ``torch.nn.Module``.
        resolved: :func:`resolve`'s result, when already computed.

    Returns:
        ``{module name: override policy}`` of the wrapped modules.

    Raises:
        ValueError: an override conflict.
    """
    resolved = resolve(mp.policy, model) if resolved is None else resolved
    modules = dict(model.named_modules())
    for name, policy in resolved.items():
        module = modules[name]
        module.forward = _OverrideForward(module, policy, mp)  # type: ignore[method-assign]
    attach(model).overrides = True  # train_step applies them once
    return resolved


def cast_module(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Module mode: an overridden module's floating parameters and buffers held in ``dtype``."""
    with torch.no_grad():
        for t in (*module.parameters(), *module.buffers()):
            if t.is_floating_point() and t.dtype != dtype:
                t.data = t.data.to(dtype)
