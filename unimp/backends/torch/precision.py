"""torch matmul precision: :data:`unimp.precision.MATMUL_PRECISION_TABLE` translated to torch's
switches, set for a block and restored after it.

torch >= 2.9 sets the precision of float32 ops per backend and operation
(``torch.backends.cuda.matmul.fp32_precision``, ``torch.backends.mkldnn.matmul...``,
``torch.backends.cudnn.conv...``, ``torch.backends.cudnn.rnn...``) and its CUDA notes ask not to
mix that API with the legacy one: 2.9 warns on ``allow_tf32`` and
``set_float32_matmul_precision`` ("will be deprecated after Pytorch 2.9"), and the legacy
getters (``torch.get_float32_matmul_precision()``, ``torch.backends.cuda.matmul.allow_tf32``,
``torch.backends.cudnn.allow_tf32``) raise ``RuntimeError`` when the two disagree. unimp writes
only the new switches where torch has them, so it emits none of those warnings; inside a block
that changes them, torch's legacy getters raise for the same reason as after a user's own
``torch.backends.cuda.matmul.fp32_precision = "tf32"`` (torch's default ``torch.compile`` reads
the new switches; inductor's max-autotune cache keys still call the legacy getter). On torch <
2.9 unimp uses ``set_float32_matmul_precision`` and ``cudnn.allow_tf32``.

All the switches are process-global in torch and read when an op runs, so the setting is in
force for exactly the ops run inside the block (eager and ``torch.compile``d alike); another
thread running ops at the same time sees it too.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

from unimp.precision import MATMUL_PRECISION_TABLE, check_matmul_precision

__all__ = ["current_matmul_precision", "matmul_precision"]

#: The switches unimp sets (``torch.backends.<name>.fp32_precision``), each with the object it
#: inherits from while it is ``"none"`` (``torch.backends.cudnn.fp32_precision`` is torch's
#: ``("cuda", "all")``, the parent of ``cuda.matmul`` too).
_SWITCHES = {"cuda.matmul": "cudnn", "mkldnn.matmul": "mkldnn", "cudnn.conv": "cudnn", "cudnn.rnn": "cudnn"}


def _lookup(path: str) -> Any:
    obj: Any = torch.backends
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


@functools.cache
def _switches() -> tuple[tuple[str, Any, Any], ...]:
    """``(name, switch, parent)`` for torch >= 2.9's switches; ``()`` on older torch.

    Found once (module singletons). A torch whose ``cuda.matmul.fp32_precision`` reads a value
    outside ``"none"``/``"ieee"``/``"tf32"`` (development builds before 2.9 named them
    differently) counts as older.
    """
    if getattr(_lookup("cuda.matmul"), "fp32_precision", None) not in ("none", "ieee", "tf32"):
        return ()
    out = tuple((name, _lookup(name), _lookup(parent)) for name, parent in _SWITCHES.items())
    if any(not hasattr(obj, "fp32_precision") for _, switch, parent in out for obj in (switch, parent)):
        return ()
    return out


def current_matmul_precision() -> dict[str, Any]:
    """torch's current settings, read with the API unimp sets.

    torch >= 2.9: ``{"api": "fp32_precision (torch>=2.9)", "cuda.matmul": ..., "mkldnn.matmul":
    ..., "cudnn.conv": ..., "cudnn.rnn": ...}``, each the value torch reads for that op
    (``"none"`` where nothing up the chain is set: IEEE float32). Older torch: ``{"api": ...,
    "matmul": "highest"|"high"|"medium", "conv_tf32": bool}``.

    torch's defaults are float32 for matmuls and TF32 for cuDNN convolutions (torch's CUDA
    semantics notes, "TensorFloat-32 (TF32) on Ampere (and later) devices"); neither changes
    anything on a CPU.
    """
    switches = _switches()
    if switches:
        return {"api": "fp32_precision (torch>=2.9)", **{name: s.fp32_precision for name, s, _ in switches}}
    return {
        "api": "set_float32_matmul_precision + cudnn.allow_tf32 (torch<2.9)",
        "matmul": torch.get_float32_matmul_precision(),
        "conv_tf32": bool(torch.backends.cudnn.allow_tf32),
    }


#: The settings of the :func:`matmul_precision` blocks this thread has open, innermost last.
#: Per thread: a block of another thread is no reason to skip one here (the switches are
#: process-global, so threads running blocks at the same time still see each other's setting).
_OPEN = threading.local()


def _in_force() -> list[str]:
    stack = getattr(_OPEN, "stack", None)
    if stack is None:
        stack = _OPEN.stack = []
    return stack


def _is_set(name: str) -> bool:
    """Whether torch's switches read as ``name``'s row now (an outer block's, unchanged)."""
    row = MATMUL_PRECISION_TABLE[name]
    switches = _switches()
    if switches:
        return all(s.fp32_precision == row.torch_fp32_precision[n] for n, s, _ in switches)
    return (torch.get_float32_matmul_precision(), bool(torch.backends.cudnn.allow_tf32)) == (
        row.torch_matmul,
        row.torch_cudnn_tf32,
    )


def _set_switches(name: str) -> list[tuple[Any, Any, str]]:
    """torch >= 2.9: sets the row's ``fp32_precision`` switches; returns what
    :func:`_restore_switches` needs to put each back."""
    row = MATMUL_PRECISION_TABLE[name]
    switches = _switches()
    saved = [(switch, parent, switch.fp32_precision) for _, switch, parent in switches]
    for switch_name, switch, _ in switches:
        switch.fp32_precision = row.torch_fp32_precision[switch_name]
    return saved


def _restore_switches(saved: list[tuple[Any, Any, str]]) -> None:
    """Each switch back as it read before the block.

    torch reads a switch through its parents (a ``"none"`` switch answers with its backend's
    value, or the global one) and has no getter of the value as set, so what was there is known
    as the value torch read: a switch that read the same as its parent goes back to ``"none"``
    (it follows its parent again, as it did before, and reads as it did), any other to its
    value. (torch's own ``torch._dynamo`` restores ``cuda.matmul`` after tracing by writing
    back the value it read.)
    """
    for switch, parent, value in saved:
        switch.fp32_precision = "none" if parent.fp32_precision == value else value


def _set_legacy(name: str) -> tuple[str, bool]:
    """torch < 2.9: ``set_float32_matmul_precision`` and ``cudnn.allow_tf32``; returns the old
    values for :func:`_restore_legacy`."""
    row = MATMUL_PRECISION_TABLE[name]
    saved = torch.get_float32_matmul_precision(), bool(torch.backends.cudnn.allow_tf32)
    torch.set_float32_matmul_precision(row.torch_matmul)
    torch.backends.cudnn.allow_tf32 = row.torch_cudnn_tf32
    return saved


def _restore_legacy(saved: tuple[str, bool]) -> None:
    torch.backends.cudnn.allow_tf32 = saved[1]
    torch.set_float32_matmul_precision(saved[0])


@contextlib.contextmanager
def matmul_precision(name: str | None) -> Iterator[None]:
    """Sets torch's float32 matmul and convolution precision for the block.

    Every switch reads after the block as it did before, also when the block raises. Inside a
    function ``torch.compile`` traces it changes nothing: a compiled graph runs under the
    precision in force when it is called, so set it around the compiled call
    (``TrainStep(compile=True)`` does); reading or writing the switches in the graph would break
    it (dynamo cannot trace their getters).

    Args:
        name: ``"highest"``, ``"high"``, ``"medium"`` or ``None`` (change nothing).

    Raises:
        ValueError: an unknown name (before anything is changed).

    Example:
        >>> with matmul_precision("high"):
        ...     current_matmul_precision()["cudnn.conv"]
        'tf32'
    """
    name = check_matmul_precision(name)
    if name is None or torch.compiler.is_compiling():
        # inside a graph torch.compile traces, the switches can be neither read nor written
        # (dynamo breaks the graph on their getters); the graph runs under the precision in
        # force when it is called, which the caller sets (TrainStep(compile=True) does, around
        # the compiled call)
        yield
        return
    in_force = _in_force()
    if in_force and in_force[-1] == name and _is_set(name):
        # nested in a block that set the same (a train step's autocast inside the step): the
        # outer block restores; setting and saving again would cost a step ~20 us of host time
        yield
        return
    if _switches():
        saved: Any = _set_switches(name)
        restore: Any = _restore_switches
    else:
        saved, restore = _set_legacy(name), _restore_legacy
    in_force.append(name)
    try:
        yield
    finally:
        in_force.pop()
        restore(saved)
