"""torch casting: canonical dtype names to torch dtypes, ``cast_tree`` over nested structures,
and module mode (Apex O2): the float32 master weights the optimizer updates, the hooks that move
gradients and values between them and the half model, and checkpoints that carry the masters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from unimp.dtypes import canonical_dtype

_TORCH_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


_NORM_LAYERS = (
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.LocalResponseNorm,
    *((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ()),
)


def to_dtype(name: Any) -> torch.dtype:
    """The torch dtype for a floating dtype name or any dtype unimp recognises.

    Raises:
        ValueError: not a floating dtype unimp supports (the message lists accepted names).

    Example:
        >>> to_dtype("bf16")
        torch.bfloat16
    """
    if isinstance(name, torch.dtype) and name in _TORCH_DTYPES.values():
        return name
    return _TORCH_DTYPES[canonical_dtype(name)]


def _map_tree(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):
        items = [(k, _map_tree(v, fn)) for k, v in tree.items()]
        if type(tree) is dict:  # built, not copied: torch.compile cannot trace dict.copy
            return dict(items)
        try:  # a shallow copy keeps the mapping's type (OrderedDict, defaultdict, HF ModelOutput)
            out = copy.copy(tree)
            for k, v in items:
                out[k] = v
            return out
        except TypeError:  # an immutable mapping: a plain dict keeps the values
            return dict(items)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
        return type(tree)(*(_map_tree(v, fn) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tree(v, fn) for v in tree)
    return tree


def _leaves(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, Mapping):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)


def cast_tree(tree: Any, dtype: Any) -> Any:
    """Casts the floating tensors of a nested structure (dicts, lists, tuples, namedtuples).

    Integer, boolean and complex tensors, Python scalars and anything else pass through
    unchanged (as jmp's ``_cast_floating_to`` and Keras's ``_should_cast``). Casting to a
    tensor's own dtype returns that same tensor; autograd flows through the casts.

    Args:
        tree: a tensor or a nested structure holding tensors.
        dtype: a torch dtype or a name (``"float16"``, ``"bf16"``, ...).

    Returns:
        The same structure with floating tensors in ``dtype``.

    Raises:
        ValueError: ``dtype`` is not a floating dtype unimp supports.
    """
    target = to_dtype(dtype)
    return _map_tree(tree, lambda t: t.to(target) if t.is_floating_point() else t)


class _MasterWeights:
    """Apex O2: the model holds half parameters, the optimizer float32 copies of them.

    Gradients move model -> master (added to the master's ``.grad`` in float32, the model's
    ``.grad`` set to None) before unscaling or stepping; after the step the master values are
    copied back into the model and the master gradients dropped, so ``model.zero_grad()`` and
    ``optimizer.zero_grad()`` both start the next iteration clean.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]]):
        self.pairs = pairs
        self.in_guard = False
        optimizer.register_step_pre_hook(lambda opt, a, k: None if self.in_guard else self.to_master())
        optimizer.register_step_post_hook(lambda opt, a, k: None if self.in_guard else self.to_model())

    @torch.no_grad()
    def to_master(self) -> None:
        for model_p, master_p in self.pairs:
            g = model_p.grad
            if g is None:
                continue
            if master_p.grad is None:
                master_p.grad = g.to(master_p.dtype)
            else:
                master_p.grad.add_(g.to(master_p.dtype))
            model_p.grad = None

    @torch.no_grad()
    def to_model(self) -> None:
        for model_p, master_p in self.pairs:
            model_p.copy_(master_p)
            master_p.grad = None


def _checkpoint_masters(
    model: torch.nn.Module, names: dict[int, str], pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]]
) -> None:
    """Makes checkpoints carry the float32 masters: ``model.state_dict()`` holds the master
    values (so nothing is lost to half precision, and the checkpoint loads into a float32 model),
    and ``model.load_state_dict()`` sets the masters too (else the next step would copy the old
    masters back over the loaded weights)."""
    by_name = {names[id(p)]: master for p, master in pairs if id(p) in names}
    pending: list[tuple[torch.nn.Parameter, torch.Tensor]] = []

    def save(module: Any, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        for name, master in by_name.items():
            if prefix + name in state_dict:
                state_dict[prefix + name] = master.detach()

    def load_pre(module: Any, state_dict: Mapping, prefix: str, *rest: Any) -> None:
        pending.clear()
        for name, master in by_name.items():
            v = state_dict.get(prefix + name)
            if isinstance(v, torch.Tensor) and v.shape == master.shape:
                pending.append((master, v))

    @torch.no_grad()
    def load_post(module: Any, incompatible_keys: Any) -> None:
        for master, v in pending:
            master.copy_(v)
        pending.clear()

    model.register_state_dict_post_hook(save)
    model.register_load_state_dict_pre_hook(load_pre)
    model.register_load_state_dict_post_hook(load_post)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.nn.Parameter]:
    """The parameters the optimizer updates (float32 masters after a module-mode ``prepare``):
    clip these, as with ``apex.amp.master_params``."""
    for group in optimizer.param_groups:
        yield from group["params"]
