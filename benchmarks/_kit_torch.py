"""torch side of the benchmarks: the same MLP trained by unimp's ``train_step`` or by the best
hand-written torch.amp loop (``torch.autocast`` + ``torch.amp.GradScaler``, fused Adam)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

import unimp
from benchmarks._harness import ModelSpec
from benchmarks._harness import recipe as get_recipe
from unimp.backends.torch import to_dtype

LR = 1e-3
N_BATCHES = 4


def device_of(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def make_model(spec: ModelSpec) -> nn.Module:
    layers: list[nn.Module] = []
    sizes = spec.sizes
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
            if spec.dropout:
                layers.append(nn.Dropout(spec.dropout))
    return nn.Sequential(*layers)


def _fused_adam(params: Any, device: torch.device) -> torch.optim.Optimizer:
    """Adam with torch's fused kernel where this torch has one for the device."""
    try:
        return torch.optim.Adam(params, lr=LR, fused=True)
    except RuntimeError:
        return torch.optim.Adam(params, lr=LR, foreach=True)


#: The optimizers the overhead and memory benchmarks can run the torch loops with: torch's
#: fused Adam (the native amp path, no copy and no sync in either scaler) and the forms people
#: construct by default, where unimp's GradScaler skips as torch.amp's does (issue 35).
OPTIMIZERS: dict[str, Any] = {
    "adam-fused": lambda ps, dev: _fused_adam(ps, dev),
    "adam": lambda ps, dev: torch.optim.Adam(ps, lr=LR),  # foreach, torch's default
    "adam-forloop": lambda ps, dev: torch.optim.Adam(ps, lr=LR, foreach=False),
    "adamw": lambda ps, dev: torch.optim.AdamW(ps, lr=LR),
    "sgd-momentum": lambda ps, dev: torch.optim.SGD(ps, lr=LR, momentum=0.9),
    "rmsprop": lambda ps, dev: torch.optim.RMSprop(ps, lr=LR),
    "adagrad": lambda ps, dev: torch.optim.Adagrad(ps, lr=LR),
}


class Trainer:
    """``run(n)``: n training steps, then waits for the device. ``one()``: one step, no wait.
    ``optimizer``: a name of :data:`OPTIMIZERS`; ``skip``: unimp's skip mode (GradScaler);
    ``compile``: unimp's ``train_step(compile=True)``, or the native step under
    ``torch.compile`` as a user writes it (dynamo's defaults; torch's GradScaler breaks it)."""

    def __init__(self, impl: str, spec: ModelSpec, recipe: str, device: str | None, seed: int = 0,
                 optimizer: str = "adam-fused", skip: str = "auto", compile: bool = False):
        dev = device_of(device)
        self.impl, self.device = impl, dev
        torch.manual_seed(seed)
        model = make_model(spec).to(dev)
        optimizer = OPTIMIZERS[optimizer](model.parameters(), dev)
        self.fused = bool(optimizer.defaults.get("fused"))
        g = torch.Generator(device="cpu").manual_seed(seed + 1)
        self.batches = [
            (
                torch.randn(spec.batch, spec.inputs, generator=g).to(dev),
                torch.randint(0, spec.outputs, (spec.batch,), generator=g).to(dev),
            )
            for _ in range(N_BATCHES)
        ]
        criterion = nn.CrossEntropyLoss()
        self.i = 0
        self.last: torch.Tensor | None = None
        rec = get_recipe(recipe)
        if impl == "unimp":
            mp = unimp.mixed_precision(rec, backend="torch", device=dev)
            model, optimizer = mp.prepare(model, optimizer)
            self.step = mp.train_step(
                model, optimizer, lambda m, b: criterion(m(b[0]), b[1]), skip=skip, compile=compile
            )
            self._one = self._unimp_one
        elif impl == "native":
            self.dtype = to_dtype(rec.policy.compute_dtype)
            self.autocast = rec.policy.compute_dtype != "float32"
            scaling = rec.loss_scale.kind != "none"
            # torch's own defaults (init 2**16, interval 2000): the native loop as people write it
            self.scaler = torch.amp.GradScaler(dev.type, enabled=scaling)
            self.model, self.optimizer, self.criterion = model, optimizer, criterion
            self._native_step = torch.compile(self._native_body) if compile else self._native_body
            self._one = self._native_one
        else:
            raise ValueError(f"impl must be 'unimp' or 'native', got {impl!r}.")
        self.model = model

    def _unimp_one(self) -> None:
        self.last = self.step(self.batches[self.i % N_BATCHES]).raw["loss"]
        self.i += 1

    def _native_one(self) -> None:
        x, y = self.batches[self.i % N_BATCHES]
        self.i += 1
        self.last = self._native_step(x, y)

    def _native_body(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt = self.optimizer
        opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.autocast):
            loss = self.criterion(self.model(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.step(opt)
        self.scaler.update()
        return loss.detach()

    def one(self) -> None:
        self._one()

    def state_bytes_per_param(self) -> float:
        """Bytes per model parameter of what training holds between steps: the model's
        parameters, float32 master copies the optimizer holds, and the optimizer state
        (moments, a compensation buffer), each storage counted once."""
        seen: dict[int, int] = {}

        def add(t: torch.Tensor) -> None:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()

        opt = self.step.optimizer if self.impl == "unimp" else self.optimizer
        for p in self.model.parameters():
            add(p)
        for g in opt.param_groups:
            for p in g["params"]:
                add(p)
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    add(v)
        return sum(seen.values()) / sum(p.numel() for p in self.model.parameters())

    def sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return float(self.last) if self.last is not None else float("nan")

    def run(self, n: int) -> None:
        one = self._one
        for _ in range(n):
            one()
        self.sync()


def framework_version() -> str:
    return torch.__version__


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def live_mib() -> float:
    """MiB of the tensors alive now (every ``torch.Tensor`` the garbage collector tracks, each
    storage counted once): parameters, gradients, optimizer and loss-scale state."""
    import gc

    storages: dict[tuple[int, int], int] = {}
    for obj in gc.get_objects():
        # type(), not isinstance: isinstance reads __class__, which some lazy module objects
        # answer with a deprecation warning
        if issubclass(type(obj), torch.Tensor) and not obj.is_sparse and obj.device.type != "meta":
            st = obj.untyped_storage()
            try:
                ptr = st.data_ptr()
            except RuntimeError:  # a FakeTensor / FunctionalTensor of a torch.compile trace: no memory
                continue
            storages[(ptr, obj.device.index or 0)] = st.nbytes()
    return sum(storages.values()) / 2**20


def framework_peak_mib(device: torch.device) -> float | None:
    """``torch.cuda.max_memory_allocated`` in MiB; None where torch reports nothing (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return None


# --------------------------------------------------------------------------- host reads

#: Tensor methods that read device values on the host (each is a device sync on an accelerator).
HOST_READS = (
    "item",
    "tolist",
    "numpy",
    "cpu",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__array__",
    "nonzero",
)


@contextlib.contextmanager
def count_host_reads() -> Iterator[dict[str, int]]:
    """Counts calls of :data:`HOST_READS` on any tensor while inside (patched on the class).

    ``.cpu()`` and ``.to()`` of a CPU tensor are not a sync, but they are counted as well
    (``.cpu`` by name), so a count of zero on the CPU means zero on any device.
    """
    counts: dict[str, int] = {}
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return fn(self, *a, **k)

        return wrapper

    for name, fn in saved.items():
        setattr(torch.Tensor, name, counting(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def sync_debug(device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.cuda.set_sync_debug_mode("error")`` while inside, on CUDA; a no-op elsewhere."""
    if device.type != "cuda":
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def mode() -> Iterator[None]:
        old = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(old)

    return mode()
