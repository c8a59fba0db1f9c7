"""torch devices: the version, the default device, device parsing (the core's spellings
plus torch's own), whether a device runs a half dtype, and ``device_info`` for ``unimp info``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from unimp.dtypes import device_support, parse_device


def framework_version() -> str:
    """The installed torch version string, e.g. ``"2.13.0+cpu"``."""
    return torch.__version__


def default_device() -> torch.device:
    """The current accelerator (``torch.accelerator``) when there is one, else the CPU."""
    acc = getattr(torch, "accelerator", None)
    dev = acc.current_accelerator() if acc is not None and acc.is_available() else None
    return torch.device(dev) if dev is not None else torch.device("cpu")


def _as_device(device: Any) -> torch.device:
    """``None`` (the default device), a ``torch.device``, or a name: torch's (``"cuda:1"``) or
    the other backends' spelling (``"gpu:1"``, ``" CPU "``). A CUDA device this process
    does not have is a ValueError listing the ones it has."""
    if device is None:
        return default_device()
    if isinstance(device, str):
        try:  # the core's reading of the shared spellings; torch's own ("mps", "meta") pass
            kind, index = parse_device(device)
            device = ("cuda" if kind == "gpu" else kind) + ("" if index is None else f":{index}")
        except ValueError:
            pass
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a torch device; use e.g. 'cuda', 'cuda:1', 'cpu'.") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            have = ", ".join(["cpu"] + [f"cuda:{i}" for i in range(count)])
            why = (
                f"CUDA is not available (torch {torch.__version__}, or no GPU visible)"
                if count == 0
                else "torch has no such device here"
            )
            raise ValueError(f"cannot run on {dev}: {why}; this process has {have}.")
    return dev


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: asynchronous host-to-device or device-to-device, but a blocking copy
    into CPU memory (a non-blocking device-to-host copy may be read before it lands)."""
    if t.device == device:
        return t
    return t.to(device, non_blocking=device.type != "cpu")


def _dtype_ok(device: torch.device, dtype: torch.dtype, autocast: bool) -> str | None:
    """None when ``device`` runs ``dtype`` (in autocast when asked), else the reason."""
    if dtype in (torch.float32, torch.float64):
        return None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"CUDA is not available (torch {torch.__version__}, or no GPU visible)"
        with torch.cuda.device(device):
            if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
                return "this GPU has no native bfloat16 (compute capability < 8.0); use 'mixed_float16'"
    if autocast:
        if not torch.amp.is_autocast_available(device.type):
            return f"torch has no autocast for device type {device.type!r}; use cast_mode='module'"
        with warnings.catch_warnings():
            # torch.autocast warns and silently disables itself for an unsupported dtype
            warnings.simplefilter("error")
            try:
                torch.autocast(device.type, dtype=dtype)
            except (UserWarning, RuntimeError) as e:
                return f"torch.autocast({device.type!r}, dtype={dtype}) is not supported ({e})"
    try:  # a tiny probe of the dtype on the device: matmul and a reduction
        x = torch.ones(2, 2, dtype=dtype, device=device)
        (x @ x).sum()
    except (RuntimeError, AssertionError, TypeError) as e:
        return f"{device} cannot compute in {dtype} ({e})"
    return None


def device_info() -> list[dict[str, Any]]:
    """For ``unimp info``: each device with its kind, the half dtypes it runs and the
    recommended recipe, by the core rule :func:`unimp.dtypes.device_support`.

    Returns:
        ``[{"device", "kind", "float16", "bfloat16", "recommended"}, ...]``: the CPU, then
        each CUDA device.
    """
    out = [{"device": "cpu", **device_support("cpu")}]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            dev = torch.device("cuda", i)
            entry = device_support("gpu", torch.cuda.get_device_capability(dev))
            out.append({"device": f"{dev} ({torch.cuda.get_device_name(dev)})", **entry})
    return out
