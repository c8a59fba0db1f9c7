"""unimp with Horovod and torch: the documented AMP pattern, and float16 compression made safe.

Horovod's AMP recipe for torch is::

    scaler.scale(loss).backward()
    optimizer.synchronize()                 # finish the gradient all-reduce
    scaler.unscale_(optimizer)
    with optimizer.skip_synchronize():
        scaler.step(optimizer)
    scaler.update()

:func:`amp_step` runs exactly that with unimp's scaler; :class:`GradScaler` is unimp's torch
scaler whose overflow flag is reduced over the Horovod ranks (``hvd.allreduce(op=hvd.Max)``),
so every rank skips together and keeps the same scale, and whose state is compared across the
ranks once (a mismatch is re-synchronized from rank 0 with a :class:`unimp.ReplicaDesyncWarning`, as in every engine; :func:`broadcast_state` re-syncs
from a root rank on purpose).

Float16 compression. ``hvd.Compression.fp16`` casts each gradient to float16 while it is still
multiplied by the loss scale, and Horovod's ``op=Average`` sums those float16 values before
dividing. With the default scale 65536, two ranks training ``Linear(2, 1)`` on inputs of ones
and of twos with ``loss = out.sum()`` hold scaled weight gradients 65536 and 131072: both are
inf in float16 (max 65504) before the all-reduce even starts, every step overflows and the scale
halves (seen: the first step skipped, the scale 32768). :class:`LossScaleCompression` (what
:func:`DistributedOptimizer` installs for ``compression="fp16"``) divides each gradient by the
loss scale and by the world size IN FLOAT32 before the cast, the ranks sum (``op=hvd.Sum``),
and the sum (already the mean) is multiplied back by the scale in float32. So the wire carries
unscaled mean contributions: it does not overflow when the mean of the unscaled gradients fits
float16, and the loss scale is never the cause of a wire overflow. The price: values below about
``world_size * 2**-25`` (unscaled) flush to 0 on the wire, as with Horovod's fp16 compression
without loss scaling (see :func:`unimp.distributed.fp16_mean`, ``mode="predivide"``). A real
overflow on the wire is inf on every rank, so every rank skips that step.

The policy's ``reduce_dtype`` (issue 17): ``DistributedOptimizer(..., compression=mp.policy)``
puts the gradients on the wire in that dtype (float16 or bfloat16 through
:class:`LossScaleCompression`; float32 or unset: no compression). Horovod is not installed in
unimp's default test environment: this path is tested only in the ``horovod`` tox env.

Build: Horovod 0.28.1 (its last release) needs a C++17 patch to build against current torch;
``scripts/build_horovod.sh`` does it (Gloo, no MPI). Run with
``horovodrun -np 2 -H localhost:2 --gloo python examples/distributed/horovod_torch.py``.
"""

import contextlib
from typing import Any

import torch

from unimp.backends.torch import GradScaler as _TorchGradScaler
from unimp.backends.torch.overflow import fingerprint_spread
from unimp.loss_scale import warn_replica_desync

try:
    import horovod.torch as hvd
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "unimp.distributed.horovod.torch needs Horovod built for torch: run scripts/build_horovod.sh "
        f"(Horovod 0.28.1 with a C++17 patch; Gloo, no MPI). ({e})"
    ) from e

__all__ = [
    "DistributedOptimizer",
    "GradScaler",
    "LossScaleCompression",
    "amp_step",
    "broadcast_state",
]



class GradScaler(_TorchGradScaler):
    """:class:`unimp.backends.torch.GradScaler` whose flags are reduced over the Horovod ranks.

    Same arguments as the torch scaler (``process_group`` does not apply: the ranks are
    Horovod's). In ``unscale_``, the overflow and non-finite-loss flags are all-reduced with
    ``hvd.Max`` before the skip and the scale update, so every rank agrees. The first
    ``unscale_`` after construction or ``load_state_dict`` compares the ranks' loss-scale states
    once; a mismatch is re-synchronized from rank 0 with a :class:`unimp.ReplicaDesyncWarning`.

    Raises:
        ValueError: as the torch scaler; ``process_group`` given.
    """

    def __init__(self, loss_scale: Any = None, device: Any = None, **kwargs: Any) -> None:
        if kwargs.get("process_group") not in (None, False):
            raise ValueError("the Horovod scaler reduces over Horovod's ranks; do not pass process_group.")
        kwargs["process_group"] = False  # never torch.distributed
        super().__init__(loss_scale, device, **kwargs)

    def _reduce_flags(
        self, found_inf: torch.Tensor, loss_finite: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if hvd.size() == 1:
            return found_inf, loss_finite
        flags = torch.stack([found_inf.to(torch.float32).reshape(()), (~loss_finite).to(torch.float32)])
        flags = hvd.allreduce(flags, op=hvd.Max, name="unimp.step_flags")
        return flags[0], flags[1] == 0

    def _agree_replicas(self) -> None:
        if hvd.size() > 1:
            differ = fingerprint_spread(
                self, lambda t: hvd.allreduce(t, op=hvd.Max, name="unimp.state_fingerprint")
            )
            if differ:
                broadcast_state(self, root_rank=0)
                warn_replica_desync("Load the same checkpoint on every rank", differ, stacklevel=4)


def broadcast_state(scaler: GradScaler, root_rank: int = 0) -> None:
    """Copies ``root_rank``'s loss-scale state and config to every rank (a collective)."""
    sd = hvd.broadcast_object(scaler.state_dict(), root_rank=root_rank, name="unimp.scaler_state")
    scaler.load_state_dict(sd)  # (the scaler checks the replicas again at its next step)


class LossScaleCompression:
    """Horovod compression that keeps the loss scale off the float16 wire.

    ``compress`` divides a floating gradient by ``scale * world_size`` in float32 and casts it
    to float16; the ranks must SUM (``op=hvd.Sum``, as :func:`DistributedOptimizer` sets);
    ``decompress`` casts back and multiplies by the scale in float32, giving the mean of the
    scaled gradients, as ``op=hvd.Average`` without compression would. Reads the scale on the
    device (no host sync).

    Args:
        scaler: the loss scaler whose scale multiplies the gradients.
        world_size: the number of ranks summing (default ``hvd.size()``).
        dtype: the wire dtype, the policy's ``reduce_dtype``: ``"float16"`` (default) or
            ``"bfloat16"`` (float32's range: no overflow, 8 significand bits).

    Raises:
        ValueError: ``dtype`` is not a half dtype (float32 needs no compression).
    """

    def __init__(
        self, scaler: _TorchGradScaler, world_size: int | None = None, dtype: str = "float16"
    ) -> None:
        from unimp.backends.torch.casting import to_dtype
        from unimp.dtypes import canonical_dtype

        if canonical_dtype(dtype) not in ("float16", "bfloat16"):
            raise ValueError(
                f"LossScaleCompression dtype must be 'float16' or 'bfloat16', got {dtype!r}; a "
                "float32 reduce needs no compression (compression='none')."
            )
        self.scaler = scaler
        self.world_size = hvd.size() if world_size is None else int(world_size)
        self.dtype = to_dtype(dtype)

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if not tensor.is_floating_point():
            return tensor, None
        scale = self.scaler.scale_tensor.to(tensor.device).clone()
        wire = (tensor.to(torch.float32) / (scale * self.world_size)).to(self.dtype)
        return wire, (tensor.dtype, scale)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if ctx is None:
            return tensor
        dtype, scale = ctx
        return (tensor.to(torch.float32) * scale).to(dtype)


def DistributedOptimizer(  # noqa: N802 - mirrors hvd.DistributedOptimizer
    optimizer: torch.optim.Optimizer,
    scaler: _TorchGradScaler,
    named_parameters: Any = None,
    compression: Any = "none",
    **kwargs: Any,
) -> Any:
    """``hvd.DistributedOptimizer`` set up for unimp's loss scaling.

    Args:
        optimizer, named_parameters, **kwargs: as ``hvd.DistributedOptimizer``.
        scaler: the :class:`GradScaler` scaling the loss.
        compression: ``"none"`` (Horovod's ``Compression.none``, ``op`` as given), ``"fp16"``
            (:class:`LossScaleCompression` with ``op=hvd.Sum``), or a :class:`unimp.Policy`:
            its ``reduce_dtype`` picks the wire (``None`` or float32: ``"none"``; float16 or
            bfloat16: :class:`LossScaleCompression` in that dtype).

    Raises:
        ValueError: ``hvd.Compression.fp16`` with a loss scaler (the scaled gradients overflow
            float16: use ``compression="fp16"``), ``compression="fp16"`` with an ``op`` other
            than ``hvd.Average``, or an unknown ``compression``.
    """
    if compression is hvd.Compression.fp16:
        raise ValueError(
            "hvd.Compression.fp16 casts the loss-scaled gradients to float16, which overflows at "
            "common scales (65536 * a gradient of 1 is already inf): pass compression='fp16', "
            "which unscales and divides by the world size in float32 before the cast."
        )
    from unimp.policy import Policy

    wire = "float16"
    if isinstance(compression, Policy):
        reduce = compression.reduce_dtype
        compression = "none" if reduce in (None, "float32", "float64") else "fp16"
        wire = reduce or wire
    if compression in ("none", None, hvd.Compression.none):
        return hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters,
                                        compression=hvd.Compression.none, **kwargs)
    if compression != "fp16":
        raise ValueError(f"compression must be 'none' or 'fp16', got {compression!r}.")
    if kwargs.get("op", hvd.Average) != hvd.Average:
        raise ValueError("compression='fp16' averages (it sums pre-divided values); leave op unset.")
    kwargs["op"] = hvd.Sum
    return hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters,
                                    compression=LossScaleCompression(scaler, dtype=wire), **kwargs)


def amp_step(optimizer: Any, scaler: _TorchGradScaler, max_grad_norm: float | None = None) -> torch.Tensor:
    """Horovod's documented AMP pattern with unimp's scaler, after ``scaler.scale(loss).backward()``.

    ``optimizer.synchronize()``, ``scaler.unscale_``, optional clipping of the unscaled
    gradients, ``scaler.step`` inside ``optimizer.skip_synchronize()``, ``scaler.update()``.

    A call after the user's own ``optimizer.synchronize()`` does not synchronize again (Horovod
    would all-reduce every gradient a second time).

    Returns:
        0-d bool tensor: the step was applied on every rank (the same on all ranks).
    """
    if not getattr(optimizer, "_synchronized", False):
        optimizer.synchronize()
    scaler.unscale_(optimizer)
    if max_grad_norm is not None:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    ctx = optimizer.skip_synchronize() if hasattr(optimizer, "skip_synchronize") else contextlib.nullcontext()
    with ctx:
        applied = scaler.apply_step(optimizer)
    scaler.update()
    return applied
