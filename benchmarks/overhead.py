"""Overhead: unimp's ``train_step`` against the best hand-written native loop, per backend.

For each backend and model (the seeds' MLP 784->512->10 with batch 128, 4 layers of 1024
with batch 256, and a tiny 16->32->4 MLP whose step is almost all fixed cost), two trainers of the same model from the same init are built in one worker
process: A = unimp's ``train_step``, B = the native loop (torch.autocast + torch.amp.GradScaler
with fused Adam, or with each optimizer of ``--optimizers``; Keras LossScaleOptimizer in a tf.function GradientTape step; a jitted JAX step
with jmp-style casts and an inline dynamic scale). After a warm-up they run interleaved,
A B A B ..., the same number of steps per trial; the figure is the median of the per-pair ratio
``time(A) / time(B)`` with its min and max, and the median per-pair difference in
microseconds per step (unimp's fixed cost per step: what the ratio becomes for a step of any
length). The steps per trial are calibrated after the warm-up so that a trial
lasts about 0.5 s (``--quick``: 0.25 s), whatever the model and device; pairs alternate which
loop runs first, and each loop has two instances built in both orders (see README). On a CPU
device the headline ratio uses process CPU time and the recipe defaults to ``float32+dynamic``
(float32 math, the whole loss-scale machinery): emulated float16 matmuls would hide everything.
Target: <= 1.02.

    python -m benchmarks.overhead [--quick] [--device cuda] [--recipe mixed_float16]
        [--optimizers adam-fused,adam,sgd-momentum] [--compiled]
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks import _harness as h

SETTINGS = {  # (seconds per trial (None: fixed 2 steps), pairs, warm-up steps)
    "full": (0.5, 15, 10),
    "quick": (0.25, 7, 5),
    "tiny": (None, 1, 1),
}


def worker(cfg: dict) -> dict:
    from benchmarks._kits import kit

    backend = cfg["backend"]
    h.pin_framework_threads(backend, cfg["threads"])
    k = kit(backend)
    target, pairs, warmup = cfg["schedule"]
    rows = []
    optimizers = (cfg.get("optimizers") or ["adam-fused"]) if backend == "torch" else [None]
    compiled = bool(cfg.get("compiled")) and backend in ("torch", "tensorflow")
    for name, opt_name in [(m, o) for m in cfg["models"] for o in optimizers]:
        spec = h.MODELS[name]
        extra = {} if opt_name is None else {"optimizer": opt_name}
        if compiled:
            extra["compile"] = True
        # two instances of each side, built in both orders (unimp first, then native first),
        # with half the pairs each: where a tensor lands in memory can make one instance a few
        # percent faster than another, whichever loop it runs
        parts = []
        for first in ("unimp", "native"):
            built = {first: k.Trainer(first, spec, cfg["recipe"], cfg["device"], **extra)}
            other = "native" if first == "unimp" else "unimp"
            built[other] = k.Trainer(other, spec, cfg["recipe"], cfg["device"], **extra)
            parts.append(
                h.interleaved(
                    built["unimp"].run,
                    built["native"].run,
                    pairs=max(1, (pairs + 1) // 2) if target is not None else pairs,
                    warmup=warmup,
                    steps=2 if target is None else None,
                    target_s=target or 0.0,
                    clock=cfg["clock"],
                )
            )
            if backend == "torch":
                fused = built["unimp"].fused and built["native"].fused
            if target is None:
                break
        r = h.pool(parts)
        r.update(model=name, model_desc=spec.describe())
        if backend == "torch":
            r["fused_optimizer"] = fused
            r["optimizer"] = opt_name
        if backend in ("torch", "tensorflow"):
            r["compiled"] = compiled
        rows.append(r)
    return {"backend": backend, "framework": k.framework_version(), "rows": rows}


def main(argv: Sequence[str] | None = None) -> dict:
    p = h.parser(__doc__.splitlines()[0])
    p.add_argument(
        "--recipe",
        default=None,
        choices=[*h.RECIPES, h.SCALED_FLOAT32],
        help=f"default: mixed_float16 on an accelerator, {h.SCALED_FLOAT32} on cpu",
    )
    p.add_argument(
        "--models",
        default="mlp,wide,tiny",
        help="comma-separated: mlp, wide, tiny (16->32->4: the fixed cost per step)",
    )
    p.add_argument(
        "--optimizers",
        default="adam-fused",
        help="torch only, comma-separated: adam-fused (default), adam (foreach, torch's default), "
        "adam-forloop, adamw, sgd-momentum, rmsprop, adagrad; both loops run the same one "
        "(unimp's GradScaler against torch.amp's)",
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="both loops compiled: torch, unimp's train_step(compile=True) against the native "
        "step under torch.compile (dynamo's defaults; torch's GradScaler runs eagerly at its "
        "breaks); TensorFlow, train_step(jit_compile=True) against the native tf.function("
        "jit_compile=True) with Keras's LossScaleOptimizer (XLA); JAX is always compiled",
    )
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default=None,
        help="the headline ratio's clock (default: cpu time on a cpu device, else wall time); "
        "both are recorded",
    )
    args = h.parse(p, argv)
    if args.clock is None:
        args.clock = "cpu" if args.device is None or args.device.startswith("cpu") else "wall"
    if args.recipe is None:
        on_cpu = args.device is None or args.device.startswith("cpu")
        args.recipe = h.SCALED_FLOAT32 if on_cpu else "mixed_float16"
    if h.served_as_worker(args, worker):
        return {}
    mode = h.run_mode(args)
    models = ["tiny"] if args.tiny else [m.strip() for m in args.models.split(",") if m.strip()]
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    known = ("adam-fused", "adam", "adam-forloop", "adamw", "sgd-momentum", "rmsprop", "adagrad")
    if not optimizers or set(optimizers) - set(known):
        p.error(f"--optimizers: choose from {', '.join(known)}; got {args.optimizers!r}")
    config = {"recipe": args.recipe, "models": models, "clock": args.clock, "schedule": SETTINGS[mode],
              "optimizers": optimizers, "compiled": args.compiled}
    results = h.run_backends("overhead", args, config, summary=_summary)
    target, pairs, warmup = SETTINGS[mode]
    payload = {
        "title": f"Overhead: unimp train_step / native loop ({args.recipe})",
        "machine": h.machine(),
        "settings": {
            "device": args.device or "framework default",
            "threads": args.threads or "framework default",
            "recipe": args.recipe,
            "clock": args.clock,
            "seconds_per_trial": target or "2 steps",
            # half the pairs on each of the two build orders (see worker)
            "pairs": pairs if target is None else 2 * max(1, (pairs + 1) // 2),
            "warmup_steps": warmup,
        },
        "results": results,
    }
    rows = []
    for backend, res in results.items():
        if "error" in res:
            rows.append([backend, res.get("framework"), "", "error: " + res["error"][-200:], "", "", "", "", ""])
            continue
        for r in res["rows"]:
            rows.append(
                [
                    backend,
                    res["framework"],
                    r["model_desc"] + (f", {r['optimizer']}" if r.get("optimizer") else "")
                    + (", compiled" if r.get("compiled") else ""),
                    h.fmt_ratio(r),
                    h.fmt_ratio(r["wall" if r["clock"] == "cpu" else "cpu"]),
                    f"{r['diff_us_median']:+.0f}",
                    f"{r['pairs']} x {r['steps_per_trial']}",
                    f"{r['a_ms_per_step']:.3f}",
                    f"{r['b_ms_per_step']:.3f}",
                ]
            )
    table = h.markdown_table(
        [
            "backend",
            "framework",
            "model",
            f"unimp / native, {args.clock} time: median (min .. max)",
            f"same, {'wall' if args.clock == 'cpu' else 'cpu'} time",
            f"unimp - native, {args.clock} us/step: median",
            "pairs x steps",
            "unimp ms/step",
            "native ms/step",
        ],
        rows,
    )
    h.write(args.out, "overhead", payload, table)
    print(table)
    return payload


def _summary(res: dict) -> str:
    if "error" in res:
        return "ERROR " + res["error"]
    return ", ".join(f"{r['model']} {h.fmt_ratio(r)}" for r in res["rows"])


if __name__ == "__main__":
    main()
