"""torch tensor statistics: :func:`tensor_stats` on the tensor's device (no host sync), and the
forward hooks a statistics step records layer outputs with.

The definitions are :mod:`unimp.stats`'s: ``v = |x|`` as float32 times the scale as float32,
compared with the float32 constants of :data:`unimp.stats.THRESHOLDS`; the block formats'
errors are :func:`unimp.stats.block_error_arrays` on :class:`FP8Ops` tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from unimp.attached import peek
from unimp.backends.torch.devices import _to
from unimp.backends.torch.fp8 import FP8Ops
from unimp.stats import (
    TARGETS,
    THRESHOLDS,
    StepStats,
    block_error_arrays,
    block_layout,
    check_formats,
    check_scale,
    count_fields,
    magnitude_fields,
    merge_block_sums,
    output_leaves,
)

#: One tensor's statistics on the device: ``(counts, magnitudes, size)``, ``size`` a Python int.
Entry = tuple[torch.Tensor, torch.Tensor, int]


@torch.no_grad()
def tensor_stats(
    x: torch.Tensor, scale: float | torch.Tensor = 1.0, formats: Any = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """The statistics of ``x`` at ``scale``, computed on ``x``'s device without a host sync.

    Args:
        x: a floating tensor of any shape and dtype (float16, bfloat16, float32, float64);
            sparse tensors are taken densely.
        scale: a finite number > 0, or a 0-d float32 tensor (the loss scale; not checked, so
            nothing is read from the device).
        formats: block formats whose quantization error to take as well
            (:func:`unimp.stats.check_formats`; none by default).

    Returns:
        ``(counts, magnitudes)`` on ``x``'s device: ``counts`` int32 of shape
        ``(len(unimp.stats.count_fields(formats)),)`` in that order, ``magnitudes`` float32
        of shape ``(len(unimp.stats.magnitude_fields(formats)),)``: ``amax`` (NaN when an
        element is NaN, 0 for an empty tensor), ``min_nonzero`` (``inf`` when no element is
        nonzero), then the block sums. Equal to :func:`unimp.stats.reference_stats`
        (``TensorStats.from_arrays(x.numel(), scale, counts, magnitudes, formats)``).

    Raises:
        TypeError: ``x`` is not a floating tensor.
        ValueError: a host ``scale`` that is not a finite number > 0, or an unknown block
            format.

    Example:
        >>> import torch
        >>> from unimp.stats import COUNT_FIELDS
        >>> c, m = tensor_stats(torch.tensor([2.0**-k for k in range(41)]))
        >>> dict(zip(COUNT_FIELDS, c.tolist()))["float16_flush"], m.tolist()
        (16, [1.0, 9.094947017729282e-13])
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(
            f"tensor_stats needs a floating tensor, got "
            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}."
        )
    if not isinstance(scale, torch.Tensor):
        scale = check_scale(scale)
    formats = check_formats(formats)
    if x.is_sparse:
        x = x.to_dense()
    a = x.detach().reshape(-1).abs()
    if a.dtype != torch.float32:
        a = a.float()
    dev = a.device
    if a.numel() == 0:  # no block errors to take either: 0 counts, unit 1, 0 sums
        counts = torch.zeros(len(count_fields(formats)), dtype=torch.int32, device=dev)
        mags = torch.zeros(len(magnitude_fields(formats)), dtype=torch.float32, device=dev)
        mags[1] = math.inf  # fills on the device, no host copy
        if formats:
            mags[2] = 1.0
        return counts, mags
    if isinstance(scale, torch.Tensor):
        v = a * _to(scale.detach().float(), dev)
    else:
        v = a if scale == 1.0 else a * float(np.float32(scale))  # the scale as float32
    # the reference's comparisons, literally: with subnormal constants (bfloat16's) a
    # rewriting into fewer comparisons would count differently where a device reads float32
    # subnormals as zero; count_nonzero sums a mask without converting it to int64 first
    count = torch.count_nonzero
    positive = a > 0
    raw = [count(a == 0), a.numel() - count(torch.isfinite(a))]
    for t in TARGETS:
        overflow_at, subnormal_below, flush_at = THRESHOLDS[t]
        raw.append(count(v >= overflow_at))
        raw.append(count((v > flush_at) & (v < subnormal_below)))
        raw.append(count(positive & (v <= flush_at)))
    mags = [a.amax(), torch.where(positive, a, math.inf).amin()]
    if formats:
        rows, cols, padded = block_layout(x.shape)
        blocks = torch.nn.functional.pad(a.reshape(rows, cols), (0, padded - cols))
        block_counts, block_sums = block_error_arrays(blocks, formats, FP8Ops.on(dev))
        raw += block_counts
        mags += block_sums
    return torch.stack([c.to(torch.int32) for c in raw]), torch.stack(mags)


def _merge(a: Entry, b: Entry) -> Entry:
    """The statistics of two tensors taken together (one layer called twice, or on every
    micro-batch): sizes and counts add, the larger ``amax`` (NaN wins), the smaller
    ``min_nonzero``, the block sums in the larger unit (:func:`unimp.stats.merge_block_sums`)."""
    (ca, ma, na), (cb, mb, nb) = a, b
    mb = _to(mb, ma.device)
    amax = torch.maximum(ma[0], mb[0])  # propagates NaN
    mags = [amax.reshape(1), torch.minimum(ma[1], mb[1]).reshape(1)]
    if ma.numel() > 2:
        mags += merge_block_sums(ma[2:3], ma[3:], mb[2:3], mb[3:], torch.where)
    return ca + _to(cb, ca.device), torch.cat(mags), na + nb


def _floating_leaves(out: Any, name: str) -> Iterator[tuple[str, Any]]:
    """:func:`unimp.stats.output_leaves` with this framework's floating test."""
    return output_leaves(out, name, lambda t: isinstance(t, torch.Tensor) and t.is_floating_point())


def _in_backward() -> bool:
    """True while autograd runs a backward pass (where checkpointed layers run again)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class _Recorder:
    """Forward hooks on every leaf module of a model, for one statistics step.

    Each call of a leaf module adds the statistics of its floating outputs (at scale 1) to its
    entry: a module called more than once (shared weights, every micro-batch) gets the
    statistics of all its outputs together; a forward pass run again inside the backward pass
    (``torch.utils.checkpoint``) is not counted twice. Names are ``model.named_modules()``'s
    (``""`` for a model that is itself a leaf). The hooks are removed by :meth:`close`.
    ``formats``: the block formats measured on every recorded tensor (the step's
    ``stats_formats``).
    """

    def __init__(self, model: torch.nn.Module, formats: tuple[str, ...] = ()) -> None:
        self.entries: dict[str, Entry] = {}
        self.formats = formats
        self._handles = []
        seen: set[int] = set()
        for name, module in model.named_modules():
            if id(module) in seen or next(module.children(), None) is not None:
                continue
            seen.add(id(module))
            self._handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Any:
        def record(module: torch.nn.Module, args: Any, out: Any) -> None:
            if _in_backward():  # activation checkpointing recomputing the forward pass
                return
            for key, t in _floating_leaves(out, name):
                entry = (*tensor_stats(t, 1.0, self.formats), t.numel())
                self.entries[key] = _merge(self.entries[key], entry) if key in self.entries else entry

        return record

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """``id(parameter) -> name`` from ``model.named_parameters()``; in module mode a float32
    master parameter takes the name of the model parameter it stands for."""
    names = {id(p): n for n, p in model.named_parameters()}
    master = peek(optimizer, "master", None)
    for model_p, master_p in getattr(master, "pairs", ()):
        if id(model_p) in names:
            names[id(master_p)] = names[id(model_p)]
    return names


def _gradient_stats(
    optimizer: torch.optim.Optimizer, names: dict[int, str], scale: torch.Tensor,
    formats: tuple[str, ...] = (),
) -> dict[str, Entry]:  # fmt: skip
    """The statistics of every gradient the optimizer holds (dense), at ``scale``, with the
    block ``formats``."""
    out: dict[str, Entry] = {}
    i = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            name = names.get(id(p), f"param{i}")
            i += 1
            out[name] = (*tensor_stats(p.grad, scale, formats), p.numel())
    return out


def _grad_flags(
    optimizer: torch.optim.Optimizer, names: dict[int, str], device: torch.device
) -> tuple[list[str], torch.Tensor]:
    """One finite flag per gradient the optimizer holds (a bool vector on ``device``, in the
    order and with the names of :func:`_gradient_stats`): the max-norm of a gradient is finite
    exactly when every element is, so it takes one fused reduction per device."""
    order, grads = [], []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            order.append(names.get(id(p), f"param{len(order)}"))
            grads.append(p.grad.coalesce()._values() if p.grad.is_sparse else p.grad)
    if not grads:
        return order, torch.ones(0, dtype=torch.bool, device=device)
    norms = torch._foreach_norm(grads, float("inf"))
    return order, torch.isfinite(torch.stack([_to(n, device) for n in norms]))


def _pending(
    step: int, scale: torch.Tensor, gradients: dict[str, Entry], activations: dict[str, Entry],
    formats: tuple[str, ...] = (),
) -> Any:  # fmt: skip
    """A function building the :class:`unimp.stats.StepStats` when called: the counts and
    magnitudes are stacked on the device now and read back to the host then, in four copies."""
    device = scale.device

    def stacked(group: dict[str, Entry]) -> tuple[list[str], list[int], Any, Any]:
        names = list(group)
        if not names:
            return names, [], None, None
        counts = torch.stack([_to(c, device) for c, _, _ in group.values()])
        mags = torch.stack([_to(m, device) for _, m, _ in group.values()])
        return names, [n for _, _, n in group.values()], counts, mags

    grads, acts = stacked(gradients), stacked(activations)

    def build() -> StepStats:
        s = float(scale.item())

        def host(packed: tuple[list[str], list[int], Any, Any], at: float) -> dict[str, Any]:
            names, sizes, counts, mags = packed
            if not names:
                return {}
            c, m = counts.cpu().numpy(), mags.cpu().numpy()
            return {n: (sizes[i], at, c[i], m[i]) for i, n in enumerate(names)}

        return StepStats.from_arrays(
            step, host(grads, s), host(acts, 1.0), order=(grads[0], acts[0]), formats=formats
        )

    return build
