"""Shared pieces of the benchmarks: command line, thread pinning, one worker subprocess per
backend (or per config), interleaved timing, and JSON + Markdown output.

Every benchmark script is run as ``python -m benchmarks.<name> [--quick] [--device D]`` from
the repository root. The parent process imports no framework: it starts one worker process per
backend (``--worker``), so the frameworks never share a process (clean thread pools, clean
peak RSS), and collects each worker's JSON result.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("torch", "tensorflow", "jax")
RECIPES = ("float32", "mixed_float16", "mixed_bfloat16")
#: float32 math with the whole dynamic loss-scale machinery (scale, unscale, finite check,
#: skip guard, scale update): the overhead benchmark's CPU default, where float16 matmuls are
#: emulated and so slow (torch: 5 s a step for the wide model) that they hide everything else
SCALED_FLOAT32 = "float32+dynamic"
RESULT_MARK = "UNIMP_BENCH_RESULT "


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """An MLP: ``inputs -> hidden... (relu, dropout) -> outputs``, trained with batch ``batch``."""

    name: str
    inputs: int
    hidden: tuple[int, ...]
    outputs: int
    batch: int
    dropout: float = 0.0

    @property
    def sizes(self) -> tuple[int, ...]:
        return (self.inputs, *self.hidden, self.outputs)

    def describe(self) -> str:
        arch = "->".join(str(s) for s in self.sizes)
        drop = f", dropout {self.dropout}" if self.dropout else ""
        return f"{arch}, batch {self.batch}{drop}"


#: The seeds' MLP (784 -> 512 relu -> dropout 0.2 -> 10, batch 128) and a wider one.
MODELS = {
    "mlp": ModelSpec("mlp", 784, (512,), 10, 128, 0.2),
    "wide": ModelSpec("wide", 784, (1024,) * 4, 10, 256),
    "tiny": ModelSpec("tiny", 16, (32,), 4, 8, 0.2),
}


def matmul_spec(device: str | None, tiny: bool) -> ModelSpec:
    """The matmul-heavy model of the speedup and memory benchmarks, sized for the device."""
    if tiny:
        return MODELS["tiny"]
    if device is not None and not device.startswith("cpu"):
        return ModelSpec("matmul", 4096, (4096,) * 4, 4096, 2048)
    # a CPU has no float16 matmul units: torch emulates them (about 30x slower than float32)
    return ModelSpec("matmul", 512, (512,) * 4, 512, 128)


def recipe(name: str) -> Any:
    """The unimp Recipe for a benchmark recipe name: a policy name, or ``<policy>+<loss scale
    kind>`` (``float32+dynamic``) to override the loss scale."""
    import unimp

    base, _, kind = name.partition("+")
    return unimp.get_recipe(base, loss_scale=kind) if kind else unimp.get_recipe(base)


# --------------------------------------------------------------------------- command line


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="fewer steps and pairs (a rough figure)")
    p.add_argument(
        "--tiny", action="store_true", help="tiny model and 2 steps: the smoke test's setting"
    )
    p.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N (default: each framework's default device)",
    )
    p.add_argument(
        "--backends", default=",".join(BACKENDS), help="comma-separated subset of " + ", ".join(BACKENDS)
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="host threads per framework (default: 1 on cpu, the framework's own on cuda; 0: "
        "the framework's own)",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="output folder")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    # the smoke test's mode: workers run in this process (no framework import per worker)
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args = p.parse_args(argv)
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in names if b not in BACKENDS]
    if bad or not names:
        p.error(f"--backends: unknown {bad}; choose from {', '.join(BACKENDS)}")
    args.backends = names
    if args.threads is None:
        args.threads = 1 if args.device is None or args.device.startswith("cpu") else 0
    return args


# --------------------------------------------------------------------------- workers


def worker_env(threads: int) -> dict[str, str]:
    """The environment of a worker: quiet frameworks, GPU memory on demand, pinned threads."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("KERAS_BACKEND", "tensorflow")
    env["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"  # peak memory means what was used
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if threads > 0:
        n = str(threads)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = n
        env["TF_NUM_INTRAOP_THREADS"] = n
        env["TF_NUM_INTEROP_THREADS"] = n
        flags = env.get("XLA_FLAGS", "")
        if threads == 1 and "xla_cpu_multi_thread_eigen" not in flags:
            flags += " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        env["XLA_FLAGS"] = flags.strip()
    return env


def run_worker(
    module: str,
    config: dict[str, Any],
    threads: int,
    timeout: float = 900,
    in_process: bool = False,
    env: dict[str, str] | None = None,
) -> dict:
    """Runs ``python -m <module> --worker <config json>`` and returns its result dict.

    A failed worker gives ``{"error": "..."}`` (the last lines of its output) instead of
    raising, so one broken backend does not hide the others' numbers. With ``in_process`` the
    module's ``worker(config)`` runs here instead (the smoke test: no import per worker, no
    thread pinning, RSS figures meaningless). ``env``: variables set for the worker on top of
    :func:`worker_env`'s (e.g. ``KERAS_BACKEND``).
    """
    if in_process:
        import importlib

        result = importlib.import_module(module).worker(config)
        return json.loads(json.dumps(result, default=_jsonable))
    cmd = [sys.executable, "-m", module, "--worker", json.dumps(config)]
    try:
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            env={**worker_env(threads), **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"error": f"worker exited {proc.returncode}: " + "\n".join(tail)}


def run_mode(args: argparse.Namespace) -> str:
    """``tiny``, ``quick`` or ``full``, from ``--tiny`` / ``--quick``."""
    return "tiny" if args.tiny else "quick" if args.quick else "full"


def run_backends(
    script: str,
    args: argparse.Namespace,
    config: dict[str, Any],
    summary: Callable[[dict], str] | None = None,
) -> dict[str, dict]:
    """Runs ``benchmarks.<script>``'s worker once per backend of ``args.backends``.

    Each worker gets ``config`` plus ``backend``, ``device`` and ``threads``; a progress line
    goes to stderr. Returns ``{backend: result}`` (a failed worker's result is ``{"error": ...}``).
    """
    results = {}
    for backend in args.backends:
        cfg = {"backend": backend, "device": args.device, "threads": args.threads, **config}
        res = run_worker(f"benchmarks.{script}", cfg, args.threads, in_process=args.in_process)
        results[backend] = res
        line = summary(res) if summary else ("error" if "error" in res else "done")
        print(f"{script} {backend}: {line}", file=sys.stderr)
    return results


def emit(result: dict) -> None:
    """The worker's last act: its result, on one marked stdout line."""
    print(RESULT_MARK + json.dumps(result, default=_jsonable), flush=True)


def served_as_worker(args: argparse.Namespace, worker: Callable[[dict], dict]) -> bool:
    """Runs ``worker`` on the config a parent process passed (``--worker JSON``) and emits its
    result; True when this process was such a worker (the script's ``main`` returns then)."""
    if not args.worker:
        return False
    emit(worker(json.loads(args.worker)))
    return True


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def pin_framework_threads(backend: str, threads: int) -> None:
    """Pins the framework's own thread pools (the environment does the rest, see worker_env)."""
    if threads <= 0:
        return
    if backend == "torch":
        import torch

        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:  # already set once in this process
            pass
    elif backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)


# --------------------------------------------------------------------------- timing


def timed(run: Callable[[int], None], steps: int) -> float:
    """Wall seconds for ``run(steps)`` (which must end by waiting for the device)."""
    return timed2(run, steps)[0]


def timed2(run: Callable[[int], None], steps: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) for ``run(steps)``."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    run(steps)
    return time.perf_counter() - wall, time.process_time() - cpu


def calibrate(run: Callable[[int], None], target_s: float, warmup: int, min_steps: int = 5) -> int:
    """Steps per trial so that one trial of ``run`` lasts about ``target_s`` seconds, from the
    time of ``warmup`` steps run after a first warm-up (which compiles, allocates, traces)."""
    run(warmup)
    per_step = timed(run, warmup) / warmup
    return max(min_steps, int(round(target_s / max(per_step, 1e-9))))


def _pair_stats(ratios: list[float], diffs: list[float]) -> dict[str, Any]:
    """The per-pair figures: ratios ``t_a / t_b`` and differences ``(t_a - t_b)`` per step in
    microseconds (the fixed cost of A over B per step, which a ratio hides behind a large
    model and a tiny model exposes)."""
    return {
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratios": ratios,
        "diff_us_median": statistics.median(diffs),
        "diffs_us": diffs,
    }


def _stats(ta: list[float], tb: list[float], steps: int) -> dict[str, Any]:
    return {
        **_pair_stats(
            [x / y for x, y in zip(ta, tb, strict=True)],
            [1e6 * (x - y) / steps for x, y in zip(ta, tb, strict=True)],
        ),
        "a_ms_per_step": 1e3 * statistics.median(ta) / steps,
        "b_ms_per_step": 1e3 * statistics.median(tb) / steps,
    }


def interleaved(
    a: Callable[[int], None],
    b: Callable[[int], None],
    *,
    pairs: int,
    warmup: int,
    steps: int | None = None,
    target_s: float = 1.0,
    clock: str = "wall",
) -> dict[str, Any]:
    """Times ``a`` and ``b`` alternately after warming both up: pair i runs A then B for even
    i and B then A for odd i (A B B A A B ...), so neither side always runs first.

    ``steps`` per trial, or (None) as many as make one trial of the slower side last about
    ``target_s`` seconds. Returns, for the wall clock and for the process CPU time, the
    per-pair ratios ``t_a / t_b`` (median, min, max) and each side's median milliseconds per
    step; the top-level figures are those of ``clock`` ("wall" or "cpu": on a CPU device with
    pinned threads, CPU time leaves out the time this process waited for a core that other
    jobs held).
    """
    if steps is None:
        steps = max(calibrate(a, target_s, warmup), calibrate(b, target_s, warmup))
    else:
        a(warmup)
        b(warmup)
    ta, tb = [], []
    for i in range(pairs):
        if i % 2 == 0:
            ta.append(timed2(a, steps))
            tb.append(timed2(b, steps))
        else:
            tb.append(timed2(b, steps))
            ta.append(timed2(a, steps))
    wall = _stats([t[0] for t in ta], [t[0] for t in tb], steps)
    cpu = _stats([t[1] for t in ta], [t[1] for t in tb], steps)
    return {
        "steps_per_trial": steps,
        "pairs": pairs,
        "warmup_steps": warmup,
        "clock": clock,
        **(cpu if clock == "cpu" else wall),
        "wall": wall,
        "cpu": cpu,
    }


def pool(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from several :func:`interleaved` ones (of the same two loops): every pair's
    ratio counts once; milliseconds per step are the medians over all trials."""
    if len(parts) == 1:
        return dict(parts[0])
    out: dict[str, Any] = {
        "steps_per_trial": [p["steps_per_trial"] for p in parts],
        "pairs": sum(p["pairs"] for p in parts),
        "warmup_steps": parts[0]["warmup_steps"],
        "clock": parts[0]["clock"],
    }
    for clock in ("wall", "cpu"):
        out[clock] = {
            **_pair_stats(
                [r for p in parts for r in p[clock]["ratios"]],
                [d for p in parts for d in p[clock]["diffs_us"]],
            ),
            "a_ms_per_step": statistics.median(p[clock]["a_ms_per_step"] for p in parts),
            "b_ms_per_step": statistics.median(p[clock]["b_ms_per_step"] for p in parts),
        }
    out.update(out[out["clock"]])
    return out


def peak_rss_mib() -> float:
    """This process's peak resident set size, MiB (``ru_maxrss``; KiB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def current_rss_mib() -> float | None:
    """This process's resident set size now, MiB (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- output


def machine() -> dict[str, Any]:
    """Where the numbers came from."""
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["processor"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(x: Any) -> str:
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
        return "" if x is None else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def write(out: str, name: str, payload: dict[str, Any], table: str) -> tuple[Path, Path]:
    """Writes ``<out>/<name>.json`` and ``<out>/<name>.md``; returns both paths."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    js, md = folder / f"{name}.json", folder / f"{name}.md"
    js.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    md.write_text(f"## {payload.get('title', name)}\n\n{table}\n\n{notes(payload)}\n")
    return js, md


def notes(payload: dict[str, Any]) -> str:
    m = payload.get("machine", {})
    settings = payload.get("settings", {})
    return (
        f"Machine: {m.get('processor')}, {m.get('cpus')} CPUs, {m.get('platform')}, load "
        f"average at start {m.get('load_average')}; {m.get('time_utc')}. Settings: "
        + ", ".join(f"{k}={v}" for k, v in settings.items())
        + "."
    )


def fmt_ratio(r: dict[str, Any]) -> str:
    return f"{r['ratio_median']:.3f} ({r['ratio_min']:.3f} .. {r['ratio_max']:.3f})"
