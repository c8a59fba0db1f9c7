"""The cost of looking inside a run: a dtype trace, and a statistics step, per backend.

On the ``unimp compare`` models (the seeds' MLP and the ViT, the digits, batch 32), through the
compare runners' ``build``:

* ``trace / step``: the wall time of ``mp.trace(step, batch)`` over one warm step's median
  (target: under 5x). torch runs the step under a dispatch mode (and puts the state back);
  JAX retraces the step to a jaxpr; TensorFlow reads the graph of the step it already traced.
* ``stats step / step``: the median of a step that computes tensor statistics
  (``train_step(stats_every=1)``, read back every step) over a plain step's. The plain step of a
  ``stats_every=k`` train step is the plain step: nothing is added to it (the smoke and stats
  tests check its op count).

    python -m benchmarks.observe [--quick] [--device cuda]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence

from benchmarks import _harness as h

STEPS = {"full": 30, "quick": 10, "tiny": 2}


def _median_step(step, batches, convert, stats: bool) -> float:
    times = []
    for b in batches:
        x = convert(b)
        t0 = time.perf_counter()
        r = step(x)
        _ = r.loss  # the step has finished on the device
        if stats:
            _ = r.stats  # and its statistics are read back
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(cfg: dict) -> dict:
    import importlib

    from unimp.compare.run import CompareConfig
    from unimp.compare.trace import _spec

    backend = cfg["backend"]
    h.pin_framework_threads(backend, cfg["threads"])
    runner = importlib.import_module(f"unimp.compare.runner_{backend}")
    compare = CompareConfig(recipe=cfg["recipe"], model=cfg["model"], backends=(backend,))
    from unimp.recipe import get_recipe

    spec, _ = _spec(compare, get_recipe(cfg["recipe"]), backend)
    from unimp.compare.data import batches, load_dataset
    from unimp.compare.models import hidden_size

    ds = load_dataset("digits", seed=0, num_classes=10)
    data = batches(ds, batch_size=32, epochs=1, seed=0, dropout=0.2, hidden=hidden_size(cfg["model"], ds.image_shape))
    n = cfg["steps"]
    out: dict = {}
    mp, step, convert = runner.build(spec)
    _median_step(step, data[:2], convert, False)  # warm-up: compilation, optimizer state
    out["step_ms"] = _median_step(step, data[2 : 2 + n], convert, False) * 1e3
    t0 = time.perf_counter()
    trace = mp.trace(step, convert(data[0]))
    out["trace_ms"] = (time.perf_counter() - t0) * 1e3
    out["trace_ops"] = len(trace)
    out["trace_per_step"] = out["trace_ms"] / out["step_ms"]
    spec.stats_every = 1
    try:
        mp2, step2, convert2 = runner.build(spec)
    except TypeError as e:  # a backend without the option yet
        out["stats_error"] = str(e)
        return out
    _median_step(step2, data[:2], convert2, True)
    out["stats_step_ms"] = _median_step(step2, data[2 : 2 + n], convert2, True) * 1e3
    out["stats_per_step"] = out["stats_step_ms"] / out["step_ms"]
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    p = h.parser(__doc__.splitlines()[0])
    args = h.parse(p, argv)
    if h.served_as_worker(args, worker):
        return {}
    mode = h.run_mode(args)
    models = ("mlp",) if args.tiny else ("mlp", "vit")
    results = []
    for backend in args.backends:
        for model in models:
            cfg = {
                "backend": backend,
                "device": args.device,
                "threads": args.threads,
                "model": model,
                "recipe": "mixed_float16",
                "steps": STEPS[mode],
            }
            res = h.run_worker("benchmarks.observe", cfg, args.threads, in_process=args.in_process)
            results.append({"backend": backend, "model": model, **res})
            print(f"observe {backend} {model}: {'error' if 'error' in res else 'done'}", file=sys.stderr)
    payload = {
        "title": "The cost of a dtype trace and of a statistics step (mixed_float16)",
        "machine": h.machine(),
        "settings": {"device": args.device or "framework default", "steps": STEPS[mode]},
        "results": results,
    }
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["backend"], r["model"], "", "", "", "", "", "error: " + r["error"][-200:]])
            continue
        rows.append(
            [
                r["backend"],
                r["model"],
                r["step_ms"],
                r["trace_ms"],
                r["trace_per_step"],
                r.get("stats_step_ms"),
                r.get("stats_per_step"),
                r.get("trace_ops"),
            ]
        )
    table = h.markdown_table(
        ["backend", "model", "step ms", "trace ms", "trace / step", "stats step ms", "stats / step", "ops traced"],
        rows,
    )
    h.write(args.out, "observe", payload, table)
    print(table)
    return payload


if __name__ == "__main__":
    main()
