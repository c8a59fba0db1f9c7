"""TensorFlow devices: the Keras 3 / TensorFlow-backend check (run on import, before any other
module of the package uses Keras), the version, device parsing and placement, ``device_info``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

try:
    import keras
except ImportError as e:  # pragma: no cover - keras ships with TensorFlow >= 2.16
    raise ImportError(
        'unimp\'s tensorflow backend needs Keras 3: pip install "unimp[tensorflow]"'
    ) from e

from unimp.dtypes import device_support, parse_device


def _check_keras() -> None:
    major = int(str(keras.__version__).split(".")[0])
    if major < 3:
        raise ImportError(
            f"unimp's tensorflow backend needs Keras 3, found keras {keras.__version__}. "
            'Install it with: pip install "unimp[tensorflow]" (TensorFlow >= 2.16 ships Keras 3).'
        )
    current = keras.backend.backend()
    if current != "tensorflow":
        other = (
            f" (or, for Keras on {current}, compile your model with unimp.keras.LossScaleOptimizer:"
            " unimp's loss scaling on every Keras backend; the rest of this backend needs"
            " TensorFlow)"
            if current in ("jax", "torch")
            else ""
        )
        raise ImportError(
            f"unimp's tensorflow backend needs Keras on the TensorFlow backend, but Keras runs on "
            f"{current!r}. Set the environment variable KERAS_BACKEND=tensorflow before Keras is "
            "first imported (e.g. `KERAS_BACKEND=tensorflow python train.py`, or "
            f'"backend": "tensorflow" in ~/.keras/keras.json) and restart Python{other}.'
        )


_check_keras()


def framework_version() -> str:
    """The installed TensorFlow version string (Keras's is in :func:`device_info`)."""
    return str(tf.__version__)


def device_info() -> list[dict[str, Any]]:
    """For ``unimp info``: each visible TensorFlow device with its kind, the half dtypes it
    runs and the recommended recipe, by the core rule :func:`unimp.dtypes.device_support`.

    Returns:
        ``[{"device", "kind", "float16", "bfloat16", "recommended"}, ...]`` (GPUs add
        ``name``).
    """
    out = []
    for dev in tf.config.list_physical_devices():
        kind = {"GPU": "gpu", "TPU": "tpu"}.get(dev.device_type.upper(), "cpu")
        details = tf.config.experimental.get_device_details(dev) or {} if kind == "gpu" else {}
        entry: dict[str, Any] = {"device": dev.name, **device_support(kind, _capability(details))}
        if details.get("device_name"):
            entry["name"] = details["device_name"]
        out.append(entry)
    return out


def _as_device(device: Any) -> str:
    """``"cpu"``, ``"cuda:1"``, ``"gpu"``, ``"/GPU:0"``, a full device name, a
    ``tf.config.LogicalDevice`` or ``tf.DeviceSpec``, as ``"/CPU:N"`` / ``"/GPU:N"``.

    Checked against the physical devices only: listing logical ones would start TensorFlow's
    runtime, after which virtual devices and memory growth can no longer be configured. The
    logical device is checked when the step first runs (:func:`_check_placed`)."""
    if isinstance(device, tf.DeviceSpec):
        device = device.to_string()
    kind, index = parse_device(getattr(device, "name", device))  # the core's reading
    if kind == "tpu":
        raise ValueError(f"device={device!r}: unimp's TensorFlow backend runs on 'cpu' or 'gpu'.")
    kinds = {"cpu": "CPU", "gpu": "GPU"}
    name = f"/{kinds[kind]}:{index or 0}"
    if kind == "gpu" and (index or 0) >= len(tf.config.list_physical_devices("GPU")):
        physical = [d.device_type for d in tf.config.list_physical_devices()]
        have = ", ".join(f"/{t}:{i}" for t in dict.fromkeys(physical) for i in range(physical.count(t)))
        raise ValueError(f"device={device!r}: TensorFlow has no {name} here (it has {have}).")
    return name


_PLACED_OK: set[str] = set()


def _check_placed(name: str) -> None:
    """Once per name, when work is first placed: the logical device exists (TensorFlow would
    otherwise fall back to another device silently, with soft placement)."""
    if name in _PLACED_OK:
        return
    have = [d.name for d in tf.config.list_logical_devices()]
    if "/device:" + name[1:] not in have:
        listed = ", ".join(h.replace("/device:", "/") for h in have)
        raise ValueError(f"device {name}: TensorFlow has no such device here (it has {listed}).")
    _PLACED_OK.add(name)


def _capability(details: dict[str, Any]) -> tuple[int, int] | None:
    """A GPU's compute capability ``(major, minor)`` from ``get_device_details``; None without."""
    cc = details.get("compute_capability")
    return tuple(cc) if cc else None  # type: ignore[return-value]
