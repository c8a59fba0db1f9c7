"""GEMM-bound probe: unimp's ``train_step`` on 4 x Dense(8192) at batch 8192, per backend and
precision, in achieved TFLOP/s and as a fraction of the device's dense peak.

Precisions: ``float32`` (TF32 off: torch ``fp32_precision = "ieee"`` (torch < 2.9:
``set_float32_matmul_precision("highest")``), TensorFlow
``enable_tensor_float_32_execution(False)``, JAX ``jax_default_matmul_precision="highest"``),
``tf32`` (the float32 recipe with TF32 matmuls on: the same three switches the other way,
JAX ``"tensorfloat32"``), ``bfloat16`` (``mixed_bfloat16``), ``float16``
(``mixed_float16``) and ``float8`` (``fp8-delayed``, first and last layers in bfloat16, on
each framework's native float8 GEMM: ``UNIMP_FP8_NATIVE=1`` while the step is built; its row
adds ``vs_bfloat16``, the bfloat16 step time over its own; JAX's float8 step is a jitted step
of its own around unimp's float8 ``dot_general`` (benchmarks._kit_jax), so its reference is
the same step with no float8 layer, ``bfloat16_same_step_ms``). The steps are timed under the frameworks' own no-sync checks: torch inside
``torch.cuda.set_sync_debug_mode("error")`` (on CUDA), JAX inside
``jax.transfer_guard("disallow")``; the device is waited for after leaving them.

FLOPs per step: ``6 * batch * sum(fan_in * fan_out)`` over the Dense layers (2 for the
forward matmul, 4 for the two backward ones; the first layer's input gradient is counted
though a framework may skip it, the bias, activation, loss and optimizer FLOPs are not), the
usual model-FLOPs convention (PaLM, Chowdhery et al. 2022, appendix B). The peak is the
datasheet's dense figure for the device (:data:`PEAK_TFLOPS`); a device not in the table
(every CPU) gets none.

Each worker has a time budget (``--budget-s``, default 40 s, counted from the framework's import): a precision not reached in time
is reported as skipped, so ``gpu.sh`` stays within its limit. ``--tiny`` runs the same code on
a 32-wide model (the smoke test), ``--size`` / ``--layers`` / ``--batch`` change the probe.

    python -m benchmarks.gemm --device cuda [--budget-s 40]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

from benchmarks import _harness as h

#: precision -> (unimp recipe, TF32 matmuls on; None: the framework's default, for half
#: matmuls, which TF32 does not concern)
PRECISIONS: dict[str, tuple[str, bool | None]] = {
    "float32": ("float32", False),
    "tf32": ("float32", True),
    "bfloat16": ("mixed_bfloat16", None),
    "float16": ("mixed_float16", None),
    # the fp8-delayed recipe (first and last layer out) on each framework's native float8 GEMM
    # (UNIMP_FP8_NATIVE=1): torch FP8Dense's torch._scaled_mm, Keras FP8Dense's XLA-compiled
    # GEMMs of float8 tensors, JAX fp8_dot_general's float8 dot_general operands (XLA's
    # cuBLASLt float8 rewrite on sm89+; emulated on a CPU)
    "float8": ("fp8-delayed", None),
}

#: Backends with a native float8 GEMM path (any other's float8 row says it is skipped and why).
FLOAT8_NATIVE = ("torch", "tensorflow", "jax")

#: Dense (no sparsity) peak TFLOP/s by device and precision, from NVIDIA's datasheets, which
#: list the tensor-core figures with 2:4 sparsity ("Specifications 1/2 lower without
#: sparsity"): H100 SXM5 / PCIe and H200 SXM / NVL: the H100 datasheet
#: (nvidia.com/en-us/data-center/h100, "H100 Tensor Core GPU Datasheet") and the H200 one
#: (nvidia.com/en-us/data-center/h200): FP32 67 / 51 / 67 / 60, TF32 989 / 756 / 989 / 835,
#: BF16 and FP16 1979 / 1513 / 1979 / 1671 with sparsity. A100 (SXM and PCIe, 40 and 80 GB):
#: the A100 datasheet (nvidia.com/en-us/data-center/a100): FP32 19.5, TF32 156, BF16 and
#: FP16 312 dense (no float8 units). FP8 (E4M3/E5M2), the same datasheets with sparsity: 3958 /
#: 3026 / 3958 / 3341. Matched against the device name in order: the first key contained in it.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200 NVL": {"float32": 60.0, "tf32": 417.5, "bfloat16": 835.5, "float16": 835.5, "float8": 1670.5},
    "H200": {"float32": 67.0, "tf32": 494.5, "bfloat16": 989.5, "float16": 989.5, "float8": 1979.0},
    "H100 PCIe": {"float32": 51.0, "tf32": 378.0, "bfloat16": 756.5, "float16": 756.5, "float8": 1513.0},
    "H100": {"float32": 67.0, "tf32": 494.5, "bfloat16": 989.5, "float16": 989.5, "float8": 1979.0},
    "A100": {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0},
}


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense peak of :data:`PEAK_TFLOPS` for ``device_name`` (e.g. ``"NVIDIA H100 80GB
    HBM3"``), or None for a device not in the table."""
    name = device_name.upper()
    for key, peaks in PEAK_TFLOPS.items():
        if key.upper() in name:
            return peaks.get(precision)
    return None


def probe_spec(size: int, layers: int, batch: int) -> h.ModelSpec:
    """``layers`` Dense layers of ``size`` x ``size`` (ReLU between), batch ``batch``."""
    return h.ModelSpec("gemm", size, (size,) * (layers - 1), size, batch)


def step_flops(spec: h.ModelSpec) -> float:
    """``6 * batch * sum(fan_in * fan_out)``: the model FLOPs of one training step."""
    sizes = spec.sizes
    return 6.0 * spec.batch * sum(a * b for a, b in zip(sizes[:-1], sizes[1:], strict=True))


# --------------------------------------------------------------------------- per framework


def set_tf32(backend: str, on: bool | None) -> None:
    """TF32 matmuls on or off (None: off in torch and TensorFlow, JAX's default precision),
    the framework's own switch, set before the step is built and traced."""
    if backend == "torch":
        import torch

        if getattr(torch.backends.cuda.matmul, "fp32_precision", None) in ("none", "ieee", "tf32"):
            # torch >= 2.9: its per-backend switches (torch 2.9 warns on the legacy calls below,
            # and mixing the two makes torch's legacy getters raise); the values torch's own
            # set_float32_matmul_precision("high" / "highest") and cudnn.allow_tf32 write
            value = "tf32" if on else "ieee"
            for switch in (
                torch.backends.cuda.matmul,
                torch.backends.mkldnn.matmul,
                torch.backends.cudnn.conv,
                torch.backends.cudnn.rnn,
            ):
                switch.fp32_precision = value
        else:
            # the one call that sets the CUDA and oneDNN matmul switches together
            torch.set_float32_matmul_precision("high" if on else "highest")
            torch.backends.cudnn.allow_tf32 = bool(on)
    elif backend == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(bool(on))
    else:
        import jax

        precision = None if on is None else "tensorfloat32" if on else "highest"
        jax.config.update("jax_default_matmul_precision", precision)


def _tf32_now(backend: str) -> Any:
    """The switches :func:`set_tf32` writes, as they are now (to put back)."""
    if backend == "torch":
        import torch

        if getattr(torch.backends.cuda.matmul, "fp32_precision", None) in ("none", "ieee", "tf32"):
            return tuple(s.fp32_precision for s in (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul,
                                                    torch.backends.cudnn.conv, torch.backends.cudnn.rnn))
        return torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.config.experimental.tensor_float_32_execution_enabled()
    import jax

    return jax.config.jax_default_matmul_precision


def _put_back_tf32(backend: str, before: Any) -> None:
    if backend == "torch":
        import torch

        if isinstance(before[0], str) and len(before) == 4:
            for switch, value in zip((torch.backends.cuda.matmul, torch.backends.mkldnn.matmul,
                                      torch.backends.cudnn.conv, torch.backends.cudnn.rnn), before, strict=True):
                switch.fp32_precision = value
        else:
            torch.set_float32_matmul_precision(before[0])
            torch.backends.cudnn.allow_tf32 = before[1]
    elif backend == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(before)
    else:
        import jax

        jax.config.update("jax_default_matmul_precision", before)


@contextlib.contextmanager
def tf32(backend: str, on: bool | None) -> Iterator[None]:
    """:func:`set_tf32` for the block, the framework's previous switches put back after it (the
    benchmark runs in the caller's process: tests/test_benchmarks_smoke.py ran later tests with
    TensorFlow's TF32 left off)."""
    before = _tf32_now(backend)
    set_tf32(backend, on)
    try:
        yield
    finally:
        _put_back_tf32(backend, before)


def device_name(backend: str, t: Any) -> str:
    """The name of the device the trainer runs on (``"cpu"`` for a host CPU)."""
    if backend == "torch":
        import torch

        return torch.cuda.get_device_name(t.device) if t.device.type == "cuda" else "cpu"
    if backend == "jax":
        return t.device.device_kind if t.device.platform != "cpu" else "cpu"
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus or (t.device or "").upper().startswith("/CPU"):
        return "cpu"
    index = int((t.device or "/GPU:0").rpartition(":")[2] or 0)
    return tf.config.experimental.get_device_details(gpus[index]).get("device_name", "GPU")


@contextlib.contextmanager
def no_sync_guard(backend: str, t: Any) -> Iterator[str]:
    """The framework's check that the steps neither sync nor transfer; yields its name."""
    if backend == "torch":
        from benchmarks._kit_torch import sync_debug

        on_cuda = t.device.type == "cuda"
        with sync_debug(t.device):
            yield 'torch.cuda.set_sync_debug_mode("error")' if on_cuda else "none (not CUDA)"
    elif backend == "jax":
        import jax

        with jax.transfer_guard("disallow"):
            yield 'jax.transfer_guard("disallow")'
    else:
        yield "none (TensorFlow has no such mode; see benchmarks.syncs)"


def _release(backend: str) -> None:
    gc.collect()
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    elif backend == "tensorflow":
        import keras

        keras.backend.clear_session()


def _time(k: Any, backend: str, t: Any, cfg: dict) -> tuple[float, int, str]:
    """Warms ``t`` up (compiles), then times ``steps`` steps under the no-sync guard:
    ``(seconds per step, steps, guard)``."""
    t.run(cfg["warmup"])
    steps = 2
    if cfg["target_s"]:  # one timed step sizes the trial: about target_s, 2 to max_steps steps
        t0 = time.perf_counter()
        t.run(1)
        one = time.perf_counter() - t0
        steps = int(min(cfg["max_steps"], max(2, cfg["target_s"] / max(one, 1e-9))))
    with no_sync_guard(backend, t) as guard:
        t0 = time.perf_counter()
        for _ in range(steps):
            t.one()
    t.sync()  # outside the guard: the wait for the device is this benchmark's, not the step's
    return (time.perf_counter() - t0) / steps, steps, guard


def measure(k: Any, backend: str, spec: h.ModelSpec, precision: str, cfg: dict) -> dict:
    """One precision: build, warm up (compile), time ``steps`` steps under the guard."""
    recipe, tf32_on = PRECISIONS[precision]
    if precision == "float8" and backend not in FLOAT8_NATIVE:
        return {"precision": precision, "skipped": f"no native float8 GEMM in {backend} (emulated only)"}
    with tf32(backend, tf32_on):
        return _measure(k, backend, spec, precision, cfg, recipe, tf32_on)


def _measure(k: Any, backend: str, spec: h.ModelSpec, precision: str, cfg: dict, recipe: str,
             tf32_on: bool | None) -> dict:
    native = os.environ.get("UNIMP_FP8_NATIVE")
    os.environ["UNIMP_FP8_NATIVE"] = "1"  # read when FP8Dense layers are built (prepare)
    try:
        t = k.Trainer("unimp", spec, recipe, cfg["device"])
    finally:
        if native is None:
            os.environ.pop("UNIMP_FP8_NATIVE")
        else:
            os.environ["UNIMP_FP8_NATIVE"] = native
    seconds, steps, guard = _time(k, backend, t, cfg)
    name = device_name(backend, t)
    tflops = step_flops(spec) / seconds / 1e12
    peak = peak_tflops(name, precision)
    del t
    _release(backend)
    extra = {}
    if precision == "float8" and backend == "jax":
        # JAX's float8 step is its own jitted step (benchmarks._kit_jax): its bfloat16 twin
        # (the same step, no layer in float8) is the like-for-like reference
        twin = k.Trainer("fp8-off", spec, recipe, cfg["device"])
        extra["bfloat16_same_step_ms"] = 1e3 * _time(k, backend, twin, cfg)[0]
        del twin
        _release(backend)
    return {
        **extra,
        "precision": precision,
        "recipe": recipe,
        "tf32": tf32_on,
        "device_name": name,
        "ms_per_step": 1e3 * seconds,
        "steps": steps,
        "tflops": tflops,
        "peak_tflops": peak,
        "fraction_of_peak": None if peak is None else tflops / peak,
        "guard": guard,
    }


def worker(cfg: dict) -> dict:
    from benchmarks._kits import kit

    backend = cfg["backend"]
    h.pin_framework_threads(backend, cfg["threads"])
    k = kit(backend)
    start = time.perf_counter()  # after the framework's import: the budget is for measuring
    k.N_BATCHES = 1  # one batch, reused: the probe measures compute, not data (8192^2 randoms)
    spec = h.ModelSpec(**cfg["spec"])
    rows = []
    for precision in cfg["precisions"]:
        if time.perf_counter() - start > cfg["budget_s"]:
            rows.append({"precision": precision, "skipped": f"time budget {cfg['budget_s']} s spent"})
            continue
        try:
            rows.append(measure(k, backend, spec, precision, cfg))
        except Exception as e:  # a precision the device cannot run is a result, not a crash
            rows.append({"precision": precision, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            _release(backend)
    by = {r["precision"]: r for r in rows if "ms_per_step" in r}
    if "float8" in by and ("bfloat16" in by or "bfloat16_same_step_ms" in by["float8"]):
        # > 1: float8 faster than bfloat16 (JAX: against its float8 step's bfloat16 twin)
        ref = by["float8"].get("bfloat16_same_step_ms") or by["bfloat16"]["ms_per_step"]
        by["float8"]["vs_bfloat16"] = ref / by["float8"]["ms_per_step"]
    return {"backend": backend, "framework": k.framework_version(), "rows": rows}


def main(argv: Sequence[str] | None = None) -> dict:
    p = h.parser(__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=8192, help="Dense width (default 8192)")
    p.add_argument("--layers", type=int, default=4, help="Dense layers (default 4)")
    p.add_argument("--batch", type=int, default=8192, help="batch (default 8192)")
    p.add_argument(
        "--precisions", default=",".join(PRECISIONS), help="comma-separated: " + ", ".join(PRECISIONS)
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="per backend: no new precision after this many seconds (default 40; --tiny: none)",
    )
    args = h.parse(p, argv)
    if h.served_as_worker(args, worker):
        return {}
    precisions = [x.strip() for x in args.precisions.split(",") if x.strip()]
    bad = [x for x in precisions if x not in PRECISIONS]
    if bad:
        p.error(f"--precisions: unknown {bad}; choose from {', '.join(PRECISIONS)}")
    # tiny: 3 layers, so the float8 row has a middle layer (fp8-delayed leaves the first and
    # last out) running the native float8 path
    spec = probe_spec(32, 3, 16) if args.tiny else probe_spec(args.size, args.layers, args.batch)
    if args.budget_s is None:
        args.budget_s = float("inf") if args.tiny else 40.0
    config = {
        "spec": {**spec.__dict__},
        "precisions": precisions,
        "budget_s": args.budget_s,
        "warmup": 1 if args.tiny else 2,
        "target_s": 0.0 if args.tiny else 1.5,
        "max_steps": 2 if args.tiny else 20,
    }
    results: dict[str, dict] = {}
    for backend in args.backends:  # the table is written after each backend: a run cut short
        one = argparse.Namespace(**{**vars(args), "backends": [backend]})  # keeps the rest
        results.update(h.run_backends("gemm", one, config))
        payload, table = _report(args, spec, results)
    print(table)
    return payload


def _report(args: argparse.Namespace, spec: h.ModelSpec, results: dict) -> tuple[dict, str]:
    """Writes gemm.json / gemm.md of ``results``; returns the payload and the table."""
    payload = {
        "title": "GEMM-bound probe: achieved TFLOP/s of unimp's train_step",
        "machine": h.machine(),
        "settings": {
            "device": args.device or "framework default",
            "model": f"{args.layers if not args.tiny else 3} x Dense, {spec.describe()}",
            "flops_per_step": step_flops(spec),
            "budget_s": args.budget_s,
        },
        "results": results,
    }
    rows = []
    for backend, res in results.items():
        if "error" in res:
            rows.append([backend, "", "", "error: " + res["error"][-200:], "", "", "", "", "", ""])
            continue
        for r in res["rows"]:
            if "tflops" not in r:
                rows.append([backend, r["precision"], "", r.get("skipped") or r.get("error"), "", "", "", "", "", ""])
                continue
            frac = r["fraction_of_peak"]
            rows.append(
                [
                    backend,
                    r["precision"],
                    r["device_name"],
                    f"{r['ms_per_step']:.2f}",
                    r["steps"],
                    f"{r['tflops']:.3g}",
                    "unknown" if r["peak_tflops"] is None else f"{r['peak_tflops']:g}",
                    "" if frac is None else f"{frac:.1%}",
                    f"{r['vs_bfloat16']:.2f}x" if "vs_bfloat16" in r else "",
                    r["guard"],
                ]
            )
    header = ["backend", "precision", "device", "ms/step", "steps", "TFLOP/s",
              "dense peak TFLOP/s", "of peak", "bf16 ms / this ms", "timed under"]
    table = h.markdown_table(header, rows)
    h.write(args.out, "gemm", payload, table)
    return payload, table


if __name__ == "__main__":
    main()
