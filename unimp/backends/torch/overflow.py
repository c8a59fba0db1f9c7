"""torch overflow detection: ``all_finite`` over a nested structure, on the device, no host sync."""

from __future__ import annotations

from typing import Any

import torch

from unimp.backends.torch.casting import _leaves
from unimp.backends.torch.devices import _to


def all_finite(tree: Any) -> torch.Tensor:
    """A 0-d bool tensor, on the first floating leaf's device: every floating element is finite.

    Does not synchronize with the device (``bool()`` of the result does). A tree without
    floating tensors gives ``True`` on the CPU.
    """
    flags = [torch.isfinite(t).all() for t in _leaves(tree) if t.is_floating_point()]
    if not flags:
        return torch.tensor(True)
    dev = flags[0].device
    return torch.stack([_to(f, dev) for f in flags]).all()
