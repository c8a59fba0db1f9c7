"""Host-device syncs per training step: unimp's ``train_step`` should need none.

Per backend, for unimp's step and (for contrast) the native loop, after two warm-up steps:

* torch: host reads of tensors inside the step, counted by patching ``Tensor.item``,
  ``tolist``, ``numpy``, ``cpu``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``,
  ``__array__`` and ``nonzero``; on CUDA the steps also run under
  ``torch.cuda.set_sync_debug_mode("error")``.
* JAX: backend compilations (``jax.monitoring``'s backend-compile event) on the first call and
  on every later one (target: 1, then 0), host-callback primitives in the step's jaxpr
  (target: none), and the steps run under ``jax.transfer_guard("disallow")``.
* TensorFlow: ``tf.function`` tracings after all steps (target: 1) and graph ops that run
  Python or print (PyFunc, EagerPyFunc, PrintV2; target: none).
* Keras on torch (``keras-torch``, run with torch): host reads inside Keras's own
  ``train_step`` (what ``fit`` runs per batch), with :class:`unimp.keras.LossScaleOptimizer`
  and with Keras's own ``LossScaleOptimizer`` (whose ``ops.cond`` is a Python ``if`` on
  torch), counted as torch's.

    python -m benchmarks.syncs [--quick] [--device cuda]
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks import _harness as h

STEPS = {"full": 50, "quick": 10, "tiny": 3}


def _torch(k, spec, cfg, steps: int) -> list[dict]:
    rows = []
    for impl in ("unimp", "native"):
        t = k.Trainer(impl, spec, cfg["recipe"], cfg["device"])
        with k.count_host_reads() as first:
            t.one()
        t.one()
        t.sync()
        with k.count_host_reads() as counts:
            for _ in range(steps):
                t.one()
        debug = "not CUDA"
        if t.device.type == "cuda":
            try:
                with k.sync_debug(t.device):
                    for _ in range(steps):
                        t.one()
                debug = "no sync"
            except RuntimeError as e:
                debug = f"sync: {str(e).splitlines()[0][:120]}"
        t.sync()
        rows.append(
            {
                "impl": impl,
                "host_reads_per_step": sum(counts.values()) / steps,
                "host_reads_by_name": counts,
                "host_reads_first_step": sum(first.values()),
                "first_step_by_name": first,
                "cuda_sync_debug": debug,
                "fused_optimizer": t.fused,
            }
        )
    return rows


def _jax(k, spec, cfg, steps: int) -> list[dict]:
    import jax
    from jax._src import dispatch

    compiles = {"n": 0}

    def listen(event: str, duration: float, **kw) -> None:
        if event == dispatch.BACKEND_COMPILE_EVENT:
            compiles["n"] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    rows = []
    for impl in ("unimp", "native"):
        t = k.Trainer(impl, spec, cfg["recipe"], cfg["device"])
        c0 = compiles["n"]
        t.one()
        t.sync()
        c1 = compiles["n"]
        guard = "no transfer"
        try:
            with jax.transfer_guard("disallow"):
                for _ in range(steps):
                    t.one()
        except Exception as e:  # jax raises a plain Exception subclass for a guarded transfer
            guard = f"transfer: {str(e).splitlines()[0][:120]}"
        t.sync()
        c2 = compiles["n"]
        row = {
            "impl": impl,
            "compilations_first_call": c1 - c0,
            "compilations_later_calls": c2 - c1,
            "transfer_guard": guard,
        }
        if impl == "unimp":
            row["traces"] = t.step.traces
        row["host_primitives"] = t.host_primitives()
        rows.append(row)
    return rows


def _tensorflow(k, spec, cfg, steps: int) -> list[dict]:
    rows = []
    for impl in ("unimp", "native"):
        t = k.Trainer(impl, spec, cfg["recipe"], cfg["device"])
        t.run(steps)
        rows.append(
            {
                "impl": impl,
                "tracings_after_steps": t.tracing_count(),
                "steps": steps,
                "host_ops": t.host_ops(),
            }
        )
    return rows


def _keras_torch(spec, cfg, steps: int) -> list[dict]:
    import keras
    import numpy as np
    import torch

    from benchmarks._kit_torch import count_host_reads
    from unimp.dtypes import keras_policy_name
    from unimp.keras import LossScaleOptimizer
    from unimp.recipe import get_recipe

    p = get_recipe(cfg["recipe"]).policy
    keras.config.set_dtype_policy(keras_policy_name(p.param_dtype, p.compute_dtype))
    rng = np.random.default_rng(0)
    x = torch.as_tensor(rng.normal(size=(spec.batch, spec.inputs)).astype(np.float32))
    y = torch.as_tensor(rng.integers(0, spec.outputs, spec.batch))
    rows = []
    for impl, wrap in (("unimp", LossScaleOptimizer), ("keras", keras.optimizers.LossScaleOptimizer)):
        layers = [keras.Input((spec.inputs,))]
        layers += [keras.layers.Dense(n, activation="relu") for n in spec.hidden]
        layers += [keras.layers.Dense(spec.outputs, dtype="float32")]
        model = keras.Sequential(layers)
        model.compile(
            optimizer=wrap(keras.optimizers.Adam(1e-3)),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.train_on_batch(x, y)  # builds
        model.train_step((x, y))
        with count_host_reads() as counts:
            for _ in range(steps):
                model.train_step((x, y))
        rows.append(
            {
                "impl": f"{impl} LossScaleOptimizer in Keras's train_step",
                "host_reads_per_step": sum(counts.values()) / steps,
                "host_reads_by_name": counts,
            }
        )
    return rows


def worker(cfg: dict) -> dict:
    from benchmarks._kits import kit

    backend = cfg["backend"]
    h.pin_framework_threads(backend, cfg["threads"])
    spec = h.MODELS[cfg["model"]]
    if backend == "keras-torch":
        import keras

        return {"backend": backend, "framework": f"keras {keras.__version__}",
                "rows": _keras_torch(spec, cfg, cfg["steps"])}
    k = kit(backend)
    rows = {"torch": _torch, "jax": _jax, "tensorflow": _tensorflow}[backend](
        k, spec, cfg, cfg["steps"]
    )
    return {"backend": backend, "framework": k.framework_version(), "rows": rows}


def verdict(backend: str, row: dict) -> tuple[str, bool]:
    """(what was seen, whether it meets the target) for one row."""
    if backend == "keras-torch":  # the target is unimp's: Keras's own row is the contrast
        ok = row["host_reads_per_step"] == 0 or not row["impl"].startswith("unimp")
        seen = f"{row['host_reads_per_step']:g} host reads/step {row['host_reads_by_name'] or ''}"
    elif backend == "torch":
        ok = row["host_reads_per_step"] == 0 and row["cuda_sync_debug"] in ("no sync", "not CUDA")
        seen = (
            f"{row['host_reads_per_step']:g} host reads/step {row['host_reads_by_name'] or ''} "
            f"(first step {row['host_reads_first_step']}); CUDA sync debug: {row['cuda_sync_debug']}"
        )
    elif backend == "jax":
        ok = (
            row["compilations_first_call"] <= 1
            and row["compilations_later_calls"] == 0
            and not row["host_primitives"]
            and row["transfer_guard"] == "no transfer"
        )
        seen = (
            f"compilations {row['compilations_first_call']} then {row['compilations_later_calls']}; "
            f"host callbacks {row['host_primitives'] or 'none'}; {row['transfer_guard']}"
        )
    else:
        ok = row["tracings_after_steps"] == 1 and not row["host_ops"]
        seen = (
            f"{row['tracings_after_steps']} tracing(s) after {row['steps']} steps; host ops "
            f"{row['host_ops'] or 'none'}"
        )
    return seen, ok


def main(argv: Sequence[str] | None = None) -> dict:
    p = h.parser(__doc__.splitlines()[0])
    p.add_argument("--recipe", default="mixed_float16", choices=h.RECIPES)
    args = h.parse(p, argv)
    if h.served_as_worker(args, worker):
        return {}
    mode = h.run_mode(args)
    config = {"recipe": args.recipe, "model": "tiny" if args.tiny else "mlp", "steps": STEPS[mode]}
    results = h.run_backends("syncs", args, config)
    if "torch" in args.backends and not args.in_process:  # Keras's backend is fixed per process
        cfg = {"backend": "keras-torch", "device": args.device, "threads": args.threads, **config}
        results["keras-torch"] = h.run_worker(
            "benchmarks.syncs", cfg, args.threads, env={"KERAS_BACKEND": "torch"}
        )
    rows = []
    for backend, res in results.items():
        if "error" in res:
            rows.append([backend, "", "error: " + res["error"][-200:], "no"])
            continue
        for r in res["rows"]:
            seen, ok = verdict(backend, r)
            r["meets_target"] = ok
            rows.append([backend, r["impl"], seen, "yes" if ok else "no"])
    payload = {
        "title": "Host-device syncs per training step",
        "machine": h.machine(),
        "settings": {
            "device": args.device or "framework default",
            "recipe": args.recipe,
            "model": "tiny" if args.tiny else h.MODELS["mlp"].describe(),
            "steps": STEPS[mode],
        },
        "results": results,
    }
    table = h.markdown_table(["backend", "loop", "seen", "no sync"], rows)
    h.write(args.out, "syncs", payload, table)
    print(table)
    return payload


if __name__ == "__main__":
    main()
