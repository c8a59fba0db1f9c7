"""Peak memory: float32 vs mixed recipes per backend, unimp's step and the native loop.

Each configuration (backend, recipe, loop) runs in its own process, so the process peak RSS
(``ru_maxrss``) is that configuration's alone. Reported: the framework's own peak where it
keeps one (``torch.cuda.max_memory_allocated``, JAX ``device.memory_stats()
["peak_bytes_in_use"]``, ``tf.config.experimental.get_memory_info(dev)["peak"]``; on a CPU
none of them does), the RSS after building the model and data, and the peak RSS after the
training steps, and the tensors alive after the steps (torch: every tensor the garbage
collector tracks, each storage once; JAX: ``jax.live_arrays()``; TensorFlow keeps no such
list), the figure that allocator caching and compilation do not blur: RSS also holds what
XLA's compiler and the C allocator keep. The model is the speedup benchmark's matmul-heavy MLP.
The last column is what training holds between steps, counted from the tensors themselves:
parameters (and master copies) plus optimizer state, in bytes per model parameter, with Adam
(pure bfloat16 recipes: ``--recipes mixed_bfloat16,bfloat16,bf16-kahan,bf16-stochastic``).

    python -m benchmarks.memory [--quick] [--device cuda]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from benchmarks import _harness as h

STEPS = {"full": 10, "quick": 5, "tiny": 2}


def worker(cfg: dict) -> dict:
    from benchmarks._kits import kit

    backend = cfg["backend"]
    h.pin_framework_threads(backend, cfg["threads"])
    k = kit(backend)
    spec = h.ModelSpec(**cfg["spec"])
    rss_import = h.current_rss_mib()
    try:
        extra = {"optimizer": cfg["optimizer"]} if cfg.get("optimizer") else {}
        t = k.Trainer(cfg["impl"], spec, cfg["recipe"], cfg["device"], **extra)
    except Exception as e:  # a recipe the device cannot run is a result, not a crash
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    k.reset_peak(t.device)
    rss_built = h.current_rss_mib()
    live_built = k.live_mib()
    t.run(cfg["steps"])
    live = k.live_mib()
    held = getattr(t, "state_bytes_per_param", None)
    return {
        "state_bytes_per_param": None if held is None else round(float(held()), 3),
        "live_after_build_mib": live_built,
        "live_after_steps_mib": live,
        "framework": k.framework_version(),
        "framework_peak_mib": k.framework_peak_mib(t.device),
        "rss_after_import_mib": rss_import,
        "rss_after_build_mib": rss_built,
        "peak_rss_mib": h.peak_rss_mib(),
    }


def main(argv: Sequence[str] | None = None) -> dict:
    p = h.parser(__doc__.splitlines()[0])
    p.add_argument("--recipes", default=None, help="comma-separated (default: all three)")
    p.add_argument(
        "--loops", default=None, help="comma-separated: unimp, native (default: both; --quick: unimp)"
    )
    p.add_argument(
        "--optimizers",
        default="adam-fused",
        help="torch only, comma-separated (as benchmarks.overhead): adam-fused (default), adam, "
        "adam-forloop, adamw, sgd-momentum, rmsprop, adagrad; a row per optimizer",
    )
    args = h.parse(p, argv)
    if h.served_as_worker(args, worker):
        return {}
    mode = h.run_mode(args)
    spec = h.matmul_spec(args.device, args.tiny)
    recipes = ("mixed_float16",) if args.tiny else h.RECIPES
    impls = ("unimp",) if args.tiny or args.quick else ("unimp", "native")
    if args.recipes:
        recipes = tuple(x.strip() for x in args.recipes.split(",") if x.strip())
    if args.loops:
        impls = tuple(x.strip() for x in args.loops.split(",") if x.strip())
        if set(impls) - {"unimp", "native"}:
            p.error(f"--loops: choose from unimp, native; got {args.loops!r}")
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    known = ("adam-fused", "adam", "adam-forloop", "adamw", "sgd-momentum", "rmsprop", "adagrad")
    if not optimizers or set(optimizers) - set(known):
        p.error(f"--optimizers: choose from {', '.join(known)}; got {args.optimizers!r}")
    results = []
    for backend, recipe, opt, impl in [
        (b, r, o, i) for b in args.backends for r in recipes
        for o in (optimizers if b == "torch" else [None]) for i in impls
    ]:
        label = recipe if opt in (None, "adam-fused") else f"{recipe} / {opt}"
        cfg = {
            "backend": backend,
            "recipe": recipe,
            "optimizer": opt,
            "impl": impl,
            "device": args.device,
            "threads": args.threads,
            "spec": {**spec.__dict__},
            "steps": STEPS[mode],
        }
        res = h.run_worker("benchmarks.memory", cfg, args.threads, in_process=args.in_process)
        results.append({"backend": backend, "recipe": label, "impl": impl, **res})
        print(f"memory {backend} {label} {impl}: {'error' if 'error' in res else 'done'}", file=sys.stderr)
        # after every configuration: a run stopped by a time limit keeps what it measured
        payload, table = _report(args, spec, mode, results)
    print(table)
    return payload


def _report(args, spec: h.ModelSpec, mode: str, results: list[dict]) -> tuple[dict, str]:
    """Writes memory.json / memory.md of ``results``; returns the payload and the table."""
    payload = {
        "title": "Peak memory per configuration (one process each)",
        "machine": h.machine(),
        "settings": {
            "device": args.device or "framework default",
            "model": spec.describe(),
            "steps": STEPS[mode],
        },
        "results": results,
    }
    rows = []
    above = {  # peak RSS above the built model, per (backend, recipe, loop)
        (r["backend"], r["recipe"], r["impl"]): r["peak_rss_mib"] - r["rss_after_build_mib"]
        for r in results
        if "error" not in r
    }
    for r in results:
        if "error" in r:
            rows.append([r["backend"], r["recipe"], r["impl"], "", "", "", "error: " + r["error"][-200:], "", ""])
            continue
        peak = r["framework_peak_mib"]
        native = above.get((r["backend"], r["recipe"], "native"))
        live = r.get("live_after_steps_mib")
        rows.append(
            [
                r["backend"],
                r["recipe"],
                r["impl"],
                "not reported" if peak is None else f"{peak:.1f}",
                f"{r['rss_after_build_mib']:.0f}",
                f"{r['peak_rss_mib']:.0f}",
                f"{r['peak_rss_mib'] - r['rss_after_build_mib']:.0f}",
                ""
                if r["impl"] != "unimp" or native is None
                else f"{above[(r['backend'], r['recipe'], 'unimp')] - native:+.0f}",
                "not reported"
                if live is None
                else f"{live:.1f} ({live - r['live_after_build_mib']:+.1f})",
                "" if r.get("state_bytes_per_param") is None else f"{r['state_bytes_per_param']:.2f}",
            ]
        )
    table = h.markdown_table(
        [
            "backend",
            "recipe",
            "loop",
            "framework peak MiB",
            "RSS after build MiB",
            "peak RSS MiB",
            "peak - build MiB",
            "unimp - native, peak - build MiB",
            "live tensors after the steps MiB (since build)",
            "params + optimizer state, bytes per parameter",
        ],
        rows,
    )
    h.write(args.out, "memory", payload, table)
    return payload, table


if __name__ == "__main__":
    main()
