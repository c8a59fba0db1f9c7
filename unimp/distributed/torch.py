"""unimp on torch.distributed: replicas that agree, DDP comm hooks that average float16 safely.

The loss scaler is :class:`unimp.backends.torch.GradScaler` itself: built with
``process_group=...`` (or the default group, whenever ``torch.distributed`` is initialized) it
all-reduces its overflow and non-finite-loss flags (MAX) over the group inside ``unscale_``,
before the skip and the scale update, on the device and without a host sync. So a non-finite
gradient on any replica (e.g. in a gradient shard, or injected after DDP's all-reduce) makes
every replica skip, and the loss-scale state and the parameters stay identical on every rank.
``MixedPrecision.train_step`` builds such a scaler, so it works unchanged under DDP.

Replicas that start from different loss-scale states (a checkpoint loaded on one rank only) are
detected, once, at the first ``unscale_`` after the scaler is built or loaded: the ranks compare a
fingerprint of the state (:func:`check_replicas_agree`) and on a mismatch every rank takes rank
0's state and warns with :class:`unimp.ReplicaDesyncWarning` (one host sync, once): the same
rule as tf.distribute and JAX, never silent, never averaged. A rank that loaded another
checkpoint may also hold other parameters: the warning says to restore on every rank.

Example (started with ``torchrun --nproc-per-node 2``; see ``examples/distributed/torch_ddp.py``):

    dist.init_process_group("gloo")          # "nccl" on GPUs
    mp = unimp.mixed_precision("mixed_float16", backend="torch", device=device)
    model = DDP(mp.prepare(model))
    model.register_comm_hook(None, unimp.distributed.torch.fp16_mean_hook)   # optional
    # or the policy's reduce_dtype ("...,reduce=bfloat16"): reduce_hook(mp.policy)
    step = mp.train_step(model, optimizer, loss_fn)   # scaler reduces over the default group
"""


from typing import Any

import torch
import torch.distributed as dist

from unimp.backends.torch.overflow import (
    broadcast_state,
    check_replicas_agree,
    reduce_step_flags,
    state_fingerprint,
)

__all__ = [
    "broadcast_state",
    "check_replicas_agree",
    "fp16_gather_mean_hook",
    "fp16_mean_hook",
    "fsdp_mixed_precision",
    "reduce_hook",
    "reduce_step_flags",
    "state_fingerprint",
]

# --------------------------------------------------------------------------- DDP comm hooks


def fp16_mean_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average gradients over a float16 wire, dividing FIRST (in float32).

    Unlike torch's ``fp16_compress_hook`` (which casts to float16 first, so a local scaled
    gradient above 65504 is already inf on the wire), each bucket is divided by the world size
    in its own precision (float32), then cast to float16 and all-reduced (summed) in float16:
    the sum of same-sign values never exceeds their mean, so the mean does not overflow when it
    is representable (2 workers with 40000: 40000, not inf). The price of predividing: a mean
    below about ``world_size * 2**-25`` is flushed toward 0 (2 workers each holding 2**-24, the
    smallest float16 subnormal, average to 0); :func:`fp16_gather_mean_hook` keeps those.
    The rule is :func:`unimp.distributed.fp16_mean` with ``mode="predivide"``.

    An overflow on the wire gives the same inf on every replica (the all-reduce result is
    shared), so unimp's scaler skips the step on every replica and backs the scale off.

    Args:
        state: the process group (``None``: the default group), as torch's default hooks.
        bucket: DDP's gradient bucket (any floating dtype).

    Returns:
        A future holding the averaged bucket, in the bucket's dtype.

    Example:
        >>> ddp_model.register_comm_hook(None, fp16_mean_hook)  # doctest: +SKIP
    """
    group = dist.group.WORLD if state is None else state
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    wire = (buf.to(torch.float32) / world).to(torch.float16)
    fut = dist.all_reduce(wire, group=group, async_op=True).get_future()

    def done(f: torch.futures.Future) -> torch.Tensor:
        buf.copy_(f.value()[0])
        return buf

    return fut.then(done)


def fp16_gather_mean_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: float16 on the wire, accumulated in float32.

    Each worker's bucket is cast to float16 and all-gathered; the float16 copies are summed in
    float32 and divided by the world size. Nothing is lost below the float16 range (2 workers
    each holding 2**-24 average to exactly 2**-24; 40000 and 40000 to 40000), but each worker's
    own value must fit float16 (a local value above 65504 is inf on the wire: that step is
    non-finite on every replica and the scaler backs off). Costs an all-gather (each rank
    receives ``world_size`` float16 buckets) instead of an all-reduce.
    The rule is :func:`unimp.distributed.fp16_mean` with ``mode="float32"``.

    Args:
        state: the process group (``None``: the default group).
        bucket: DDP's gradient bucket.

    Returns:
        A future holding the averaged bucket, in the bucket's dtype.
    """
    group = dist.group.WORLD if state is None else state
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    wire = buf.to(torch.float16).reshape(-1)
    out = torch.empty(world * wire.numel(), dtype=torch.float16, device=wire.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in 2.13
    fut = gather(out, wire, group=group, async_op=True).get_future()

    def done(f: torch.futures.Future) -> torch.Tensor:
        total = out.view(world, -1).to(torch.float32).sum(0).div_(world)
        buf.copy_(total.view_as(buf))
        return buf

    return fut.then(done)


# --------------------------------------------------------------------------- the policy's reduce_dtype


def _reduce_dtype(policy_or_dtype: Any) -> torch.dtype | None:
    from unimp.backends.torch.casting import to_dtype
    from unimp.policy import Policy

    name = policy_or_dtype.reduce_dtype if isinstance(policy_or_dtype, Policy) else policy_or_dtype
    return None if name is None else to_dtype(name)


def reduce_hook(policy_or_dtype: Any) -> Any:
    """A DDP comm hook that all-reduces the gradients in the policy's ``reduce_dtype``.

    Each bucket is divided by the world size in its own dtype (as torch's default
    ``allreduce_hook``), cast to ``reduce_dtype``, summed over the ranks in that dtype, and cast
    back. With ``reduce_dtype="float32"`` on float32 gradients this is torch's default hook,
    bitwise. In float16, a sum above 65504 is inf on every rank: unimp's scaler then skips the
    step on every replica and backs the scale off.

    Args:
        policy_or_dtype: a :class:`unimp.Policy` (its ``reduce_dtype``) or a dtype name.

    Returns:
        ``hook(state, bucket) -> Future`` for ``ddp_model.register_comm_hook(group, hook)``
        (``group`` ``None``: the default group).

    Raises:
        ValueError: the policy has no ``reduce_dtype`` (nothing to register), or a bad dtype.

    Example:
        >>> ddp_model.register_comm_hook(None, reduce_hook(mp.policy))  # doctest: +SKIP
    """
    dtype = _reduce_dtype(policy_or_dtype)
    if dtype is None:
        raise ValueError(
            "reduce_hook needs a reduce dtype: the policy's reduce_dtype is None (DDP's default "
            "all-reduce in the gradients' dtype applies); set it, e.g. 'mixed_bfloat16' -> "
            "Policy(..., reduce_dtype='bfloat16') or '...,reduce=bfloat16'."
        )

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = dist.group.WORLD if state is None else state
        buf = bucket.buffer()
        wire = buf.div(dist.get_world_size(group)).to(dtype)
        fut = dist.all_reduce(wire, group=group, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            buf.copy_(f.value()[0])
            return buf

        return fut.then(done)

    hook.__name__ = hook.__qualname__ = f"reduce_hook_{str(dtype).replace('torch.', '')}"
    return hook


def fsdp_mixed_precision(policy: Any) -> Any:
    """The recipe's FSDP2 ``MixedPrecisionPolicy`` (``torch.distributed.fsdp``) for ``fully_shard``.

    ``param_dtype`` is the policy's compute dtype (FSDP2 casts the unsharded parameters to it
    for the forward and backward), ``reduce_dtype`` the policy's ``reduce_dtype`` (``None``:
    the param dtype the sharded parameters are stored in; FSDP2's own default, the
    ``param_dtype`` above, would reduce-scatter in the compute dtype), ``output_dtype`` the
    output dtype.

    Args:
        policy: a :class:`unimp.Policy` or any name :func:`unimp.get_policy` accepts.

    Returns:
        ``torch.distributed.fsdp.MixedPrecisionPolicy``.

    Example:
        >>> fully_shard(model, mp_policy=fsdp_mixed_precision(mp.policy))  # doctest: +SKIP
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from unimp.backends.torch.casting import to_dtype
    from unimp.policy import get_policy

    policy = get_policy(policy)
    return MixedPrecisionPolicy(
        param_dtype=to_dtype(policy.compute_dtype),
        reduce_dtype=to_dtype(policy.reduce_dtype or policy.param_dtype),
        output_dtype=to_dtype(policy.output_dtype),
    )
