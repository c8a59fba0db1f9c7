"""torch overflow detection, on the device, no host sync: ``all_finite`` over a nested structure,
the loss check of a fused step (:func:`_check_loss`, torch's check kernel writing into the
scaler's flag scratch: ``GradScaler.begin_step``), the global norm; and the
replicas' agreement over torch.distributed: the step's flags reduced over the group
(:func:`reduce_step_flags`) and one loss-scale state on every rank (:func:`check_replicas_agree`),
as :mod:`unimp.distributed.torch` documents them."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from unimp.backends.torch.casting import _leaves
from unimp.backends.torch.devices import _to
from unimp.loss_scale import EXTRA_FIELDS, warn_replica_desync
from unimp.trainstep import NORM_RESCALE_ABOVE


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


def _check_loss(loss: torch.Tensor, loss_inf: torch.Tensor, one: torch.Tensor) -> None:
    """Sets ``loss_inf`` (float32 0-d, the scaler's device) to 1 when ``loss`` is not finite, with
    torch's check kernel (one op; it multiplies ``loss`` by ``one`` in place, which changes no
    value); through a scratch on the loss's device when that is another one."""
    if loss.device == loss_inf.device:
        torch._amp_foreach_non_finite_check_and_unscale_([loss], loss_inf, one)
    else:
        here = torch.zeros((), dtype=torch.float32, device=loss.device)
        torch._amp_foreach_non_finite_check_and_unscale_([loss], here, _to(one, loss.device))
        torch.maximum(loss_inf, _to(here, loss_inf.device), out=loss_inf)


def flags_from_bools(grads_finite: torch.Tensor, loss_finite: torch.Tensor, out: torch.Tensor) -> Any:
    """``(overflow, skipped, loss_inf)`` for :func:`update_in_place` from the two finite flags
    (bool 0-d); ``overflow`` is written into ``out`` (float32 0-d)."""
    torch.gt(loss_finite, grads_finite, out=out)  # finite loss, non-finite gradients
    return out, (grads_finite & loss_finite).logical_not(), loss_finite.logical_not()


# --------------------------------------------------------------------------- replicas

#: The entries of :func:`state_fingerprint`, in order.
FINGERPRINT_FIELDS = ("scale", "counter", "consecutive_skips", "total_skips", *EXTRA_FIELDS, "config")


def _initialized_group(group: Any) -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group() "
            "first (torchrun sets the environment it reads)."
        )
    return dist.group.WORLD if group is None else group


def reduce_step_flags(
    found_inf: torch.Tensor, loss_finite: torch.Tensor, group: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's overflow flags reduced over the replicas: any replica bad -> every replica bad.

    One all-reduce (MAX) of a 2-element float32 tensor on the flags' device; no host sync.
    Matches torch's ShardedGradScaler, which all-reduces ``found_inf`` over its process group.

    Args:
        found_inf: float32 0-d, nonzero when a local gradient is non-finite.
        loss_finite: bool 0-d, the local (unscaled) loss is finite.
        group: the process group; ``None`` is the default group.

    Returns:
        ``(found_inf, loss_finite)``: float32 0-d (max over the replicas) and bool 0-d (all
        replicas finite), on the same device.
    """
    group = _initialized_group(group)
    flags = torch.stack(
        [found_inf.to(torch.float32).reshape(()), (~loss_finite.reshape(())).to(torch.float32)]
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags[0], flags[1] == 0


def config_code(config: Any) -> float:
    """A deterministic 32-bit code of the loss-scale config (exact in float64)."""
    return float(zlib.crc32(json.dumps(config.to_dict(), sort_keys=True).encode()))


def state_fingerprint(scaler: Any) -> torch.Tensor:
    """A float64 vector ``[scale, counter, consecutive_skips, total_skips, <EXTRA_FIELDS>,
    config code]`` on the scaler's device (no host sync): equal on two ranks iff they hold the
    same loss-scale state and config (the config code is a CRC-32 of its JSON)."""
    parts = list(scaler.state_tensors())
    code = torch.tensor(config_code(scaler.config), dtype=torch.float64, device=scaler.device)
    return torch.stack([t.to(torch.float64) for t in parts] + [code])


def fingerprint_spread(scaler: Any, reduce_max: Callable[[torch.Tensor], torch.Tensor]) -> list[str]:
    """The loss-scale state's fields that differ across the replicas, every rank reaching the
    same verdict: one MAX reduction of ``[v, -v]`` (:func:`state_fingerprint` ``v``; it gives
    the max and the min of every field) and one host read of its numbers.

    Args:
        scaler: a :class:`unimp.backends.torch.GradScaler`.
        reduce_max: the engine's all-reduce with MAX (torch.distributed's, Horovod's), taking and
            returning a float64 vector on the scaler's device.

    Returns:
        ``["scale in [1024, 65536]", ...]``: each differing field with its min and max; empty
        when the replicas agree.
    """
    v = state_fingerprint(scaler)
    both = reduce_max(torch.cat([v, -v]))
    hi, lo = both[: len(v)].tolist(), (-both[len(v) :]).tolist()
    return [f"{n} in [{a:g}, {b:g}]" for n, a, b in zip(FINGERPRINT_FIELDS, lo, hi, strict=True) if a != b]


def check_replicas_agree(scaler: Any, group: Any = None) -> list[str]:
    """Makes every rank hold the same loss-scale state: a mismatch is re-synchronized from rank 0
    with a :class:`unimp.ReplicaDesyncWarning` (the rule of every unimp engine).

    The scaler calls this once, at its first ``unscale_`` after construction or
    ``load_state_dict``. One all-reduce (MAX over ``[v, -v]``, which gives the max and the min of
    every field) and one host read of 18 numbers; every rank reaches the same verdict.

    Args:
        scaler: a :class:`unimp.backends.torch.GradScaler`.
        group: the process group; ``None`` is the default group.

    Returns:
        The fields that differed (empty when the ranks agreed), e.g. ``["scale in [1024, 65536]"]``.

    Raises:
        RuntimeError: torch.distributed is not initialized.
    """
    group = _initialized_group(group)

    def reduce_max(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t

    differ = fingerprint_spread(scaler, reduce_max)
    if differ:
        broadcast_state(scaler, src=dist.get_global_rank(group, 0), group=group)
        warn_replica_desync(
            "Load the same checkpoint (scaler.load_state_dict) on every rank "
            "('config' above is a code of the loss-scale config)",
            differ,
            stacklevel=4,
        )
    return differ


def broadcast_state(scaler: Any, src: int = 0, group: Any = None) -> None:
    """Copies rank ``src``'s loss-scale state and config to every rank of ``group``.

    A collective: every rank calls it. The config travels as the portable ``state_dict``
    (``torch.distributed.broadcast_object_list``), so the scalers are identical afterwards.

    Args:
        scaler: a :class:`unimp.backends.torch.GradScaler` on every rank.
        src: the global rank whose state is kept.
        group: the process group; ``None`` is the default group.

    Raises:
        RuntimeError: torch.distributed is not initialized.
    """
    group = _initialized_group(group)
    box = [scaler.state_dict() if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    scaler.load_state_dict(box[0])  # (the scaler checks the replicas again at its next step)


def _norm_rescale(amax: torch.Tensor) -> torch.Tensor:
    """The global norm's factor ``s`` for ``amax`` (float32 0-d), as
    :data:`unimp.trainstep.NORM_RESCALE_ABOVE` defines it: a power of two from ``amax``'s
    exponent bits where ``amax`` is finite and above the threshold, else 1."""
    power = (amax.view(torch.int32) & 0x7F800000).view(torch.float32)  # 2**floor(log2 amax)
    big = torch.isfinite(amax) & (amax > NORM_RESCALE_ABOVE)
    return torch.where(big, NORM_RESCALE_ABOVE / power, torch.ones_like(amax))


def _rescale_(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Multiplies the gradients IN PLACE by the global norm's factor ``s`` (float32 0-d, on
    ``device``) and returns it: :data:`unimp.trainstep.NORM_RESCALE_ABOVE`'s rule, from their
    largest magnitude. In place, so that no copy of the gradients is made; ``s`` is a power of
    two (exact), and the caller multiplies by ``1 / s`` again (the clip does, in its own
    multiply)."""
    if not grads:
        return torch.ones((), dtype=torch.float32, device=device)
    amax = torch.stack([_to(n.float(), device) for n in torch._foreach_norm(grads, float("inf"))]).amax()
    s = _norm_rescale(amax)
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device, []).append(g)
    for dev, gs in groups.items():
        torch._foreach_mul_(gs, _to(s, dev))
    return s


def _global_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Global L2 norm (float32) of the gradients, on ``device``; 0 for no gradients."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
    return torch.linalg.vector_norm(torch.stack([_to(n, device) for n in norms]))
