"""JAX devices: the version, device parsing, committing a step's state to a device, ``device_info``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from unimp.dtypes import device_support, parse_device


def framework_version() -> str:
    """The installed JAX version string, e.g. ``"0.4.35"``."""
    return jax.__version__


def device_info() -> list[dict[str, Any]]:
    """For ``unimp info``: each JAX device with its kind, the half dtypes it runs and the
    recommended recipe, by the core rule :func:`unimp.dtypes.device_support`.

    Returns:
        ``[{"device", "kind", "float16", "bfloat16", "recommended"}, ...]``, one per
        ``jax.devices()`` entry.
    """
    out = []
    for d in jax.devices():
        platform = d.platform.lower()
        kind = "tpu" if platform == "tpu" else "cpu" if platform == "cpu" else "gpu"
        out.append({"device": str(d), **device_support(kind, _capability(d) if kind == "gpu" else None)})
    return out


def _capability(device: jax.Device) -> tuple[int, int] | None:
    """A GPU's NVIDIA compute capability ``(major, minor)`` (JAX gives ``"8.9"``); None where it
    has none (ROCm, CPU)."""
    try:
        cc = tuple(int(v) for v in str(getattr(device, "compute_capability", "")).split(".")[:2])
    except ValueError:
        return None
    return cc if len(cc) == 2 else None  # type: ignore[return-value]


def _as_device(device: Any) -> jax.Device:
    """``"cpu"``, ``"cuda:1"``, ``"tpu"``, ... or a ``jax.Device``, as one of this process's
    devices (``jax.local_devices``: index N counts this host's devices, as torch's ``cuda:N``)."""
    if isinstance(device, jax.Device):
        return device
    platform, index = parse_device(device)  # the core's one reading of the spelling
    try:
        found = jax.local_devices(backend=platform)
    except RuntimeError:
        found = []
    i = index or 0
    if i >= len(found):
        have = []
        for p in ("cpu", "gpu", "tpu"):
            try:
                have += [f"{p}:{j}" for j in range(len(jax.local_devices(backend=p)))]
            except RuntimeError:
                pass
        raise ValueError(f"device={device!r}: JAX has no such device here (it has {', '.join(have)}).")
    return found[i]


def _device_leaf(x: Any) -> Any:
    """``x`` as a device array whose type a jitted step's outputs keep: a host leaf converted,
    a weak-typed array (``jnp.full(shape, 0.5)``) made strong (the step returns it strong, and
    the second call compiled again); placement and values unchanged."""
    if isinstance(x, jax.Array):
        return jax.lax.convert_element_type(x, x.dtype) if x.weak_type else x
    return jnp.asarray(np.asarray(x))


def _commit_like(tree: Any, reference: Any) -> Any:
    """``tree`` with its uncommitted arrays committed where ``reference``'s committed arrays live.

    A jitted step whose arguments mix committed arrays (``jax.device_put(x, device)``, or any
    output of a jitted call on them) and uncommitted ones (``jnp.asarray``, ``init_loss_scale``)
    is compiled for that mix, and its outputs all come back committed: the second call then
    compiles again. Committing everything before the first call keeps it to one compilation.
    Uncommitted trees (or a reference on several devices) are returned unchanged.
    """
    devices = {
        frozenset(x.sharding.device_set)
        for x in jax.tree_util.tree_leaves(reference)
        if isinstance(x, jax.Array) and getattr(x, "committed", False)
    }
    if len(devices) != 1 or len(next(iter(devices))) != 1:
        return tree
    device = next(iter(next(iter(devices))))

    def commit(x: Any) -> Any:
        if isinstance(x, jax.Array) and not getattr(x, "committed", False):
            return jax.device_put(x, device)
        return x

    return jax.tree_util.tree_map(commit, tree)
