"""Speedup of mixed precision: float32 vs mixed_float16 vs mixed_bfloat16, per backend.

A matmul-heavy MLP (CPU: 4 hidden layers of 512, 512 in and out, batch 128; an accelerator:
4 layers of 4096, 4096 in and out, batch 2048) is trained by unimp's ``train_step`` under each recipe. The
recipes run in rounds (float32, mixed_float16, mixed_bfloat16, float32, ...) after a warm-up;
the speedup of a recipe is ``time(float32) / time(recipe)`` per round, reported as the median
with min and max. On a CPU without half-precision units the figures are what they are (often
below 1); the same script runs unchanged on a GPU with ``--device cuda``.

    python -m benchmarks.speedup [--quick] [--device cuda]
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from benchmarks import _harness as h

SETTINGS = {  # (steps per trial, rounds, warm-up steps)
    "full": (10, 5, 3),
    "quick": (4, 3, 2),
    "tiny": (2, 1, 1),
}


def worker(cfg: dict) -> dict:
    from benchmarks._kits import kit

    backend = cfg["backend"]
    h.pin_framework_threads(backend, cfg["threads"])
    k = kit(backend)
    spec = h.ModelSpec(**cfg["spec"])
    steps, rounds, warmup = cfg["schedule"]
    trainers, errors = {}, {}
    for recipe in h.RECIPES:
        try:
            t = k.Trainer("unimp", spec, recipe, cfg["device"])
            t.run(warmup)
            trainers[recipe] = t
        except Exception as e:  # a recipe the device cannot run is a result, not a crash
            errors[recipe] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    # on a CPU (threads pinned) the process CPU time, which leaves out waits for a core that
    # other jobs held; on an accelerator the wall time
    on_cpu = cfg["device"] is None or cfg["device"].startswith("cpu")
    times: dict[str, list[float]] = {r: [] for r in trainers}
    for _ in range(rounds):
        for recipe, t in trainers.items():
            wall, cpu = h.timed2(t.run, steps)
            times[recipe].append(cpu if on_cpu else wall)
    rows = []
    for recipe in h.RECIPES:
        if recipe in errors:
            rows.append({"recipe": recipe, "error": errors[recipe]})
            continue
        row = {"recipe": recipe, "ms_per_step": 1e3 * statistics.median(times[recipe]) / steps}
        if "float32" in times:
            speed = [f / t for f, t in zip(times["float32"], times[recipe], strict=True)]
            row.update(
                speedup_median=statistics.median(speed), speedup_min=min(speed), speedup_max=max(speed)
            )
        rows.append(row)
    return {
        "backend": backend,
        "framework": k.framework_version(),
        "clock": "cpu" if on_cpu else "wall",
        "rows": rows,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    p = h.parser(__doc__.splitlines()[0])
    args = h.parse(p, argv)
    if h.served_as_worker(args, worker):
        return {}
    mode = h.run_mode(args)
    spec = h.matmul_spec(args.device, args.tiny)
    results = h.run_backends("speedup", args, {"spec": {**spec.__dict__}, "schedule": SETTINGS[mode]})
    steps, rounds, warmup = SETTINGS[mode]
    payload = {
        "title": "Speedup over float32 (unimp train_step)",
        "machine": h.machine(),
        "settings": {
            "device": args.device or "framework default",
            "threads": args.threads or "framework default",
            "model": spec.describe(),
            "steps_per_trial": steps,
            "rounds": rounds,
            "warmup_steps": warmup,
        },
        "results": results,
    }
    rows = []
    for backend, res in results.items():
        if "error" in res:
            rows.append([backend, "", "", "error: " + res["error"][-200:]])
            continue
        for r in res["rows"]:
            if "error" in r:
                rows.append([backend, r["recipe"], "", "cannot run: " + r["error"]])
            else:
                rows.append(
                    [
                        backend,
                        r["recipe"],
                        f"{r['ms_per_step']:.2f}",
                        f"{r['speedup_median']:.2f} ({r['speedup_min']:.2f} .. {r['speedup_max']:.2f})"
                        if "speedup_median" in r
                        else "",
                    ]
                )
    table = h.markdown_table(["backend", "recipe", "ms/step", "speedup vs float32: median (min .. max)"], rows)
    h.write(args.out, "speedup", payload, table)
    print(table)
    return payload


if __name__ == "__main__":
    main()
