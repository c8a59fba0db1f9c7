"""Ops per training step: unimp's ``train_step`` against the native loop, per backend.

What each framework launches per step, counted (not timed), so the figures hold on any
machine, loaded or not:

* torch: aten ops of one step (forward, backward, optimizer, loss-scale update) under a
  ``TorchDispatchMode`` that counts every op it sees. On a GPU each one is (at least) a kernel
  launch; the fused Adam step and GradScaler's ``_amp_update_scale_`` are one op each.
* TensorFlow: ops of the traced step graph (``tf.function``'s concrete function), the bodies of
  the functions it calls (``tf.cond`` branches, ...) included; ``Const``, ``Identity``,
  ``NoOp``, ``ReadVariableOp`` and the placeholders are counted apart as plumbing
  (``graph_ops`` counts everything).
* JAX: the compiled step's HLO, entry computation: its fusions and its kernels (every
  instruction but ``parameter``, ``constant``, ``tuple``, ``get-tuple-element`` and ``bitcast``),
  the buffers XLA plans for it (``Compiled.memory_analysis()``: temporaries, outputs,
  outputs aliased to donated inputs), and the XLA executions one step dispatches (the C++ fast
  path of ``jax.jit`` turned off in this worker, so every execution passes through
  ``ExecuteReplicated``: eager ops count as well as the jitted step).

Each count is of one warm step (after two warm-up steps), for the seeds' MLP (784->512->10,
batch 128) and the wide model (4 x 1024, batch 256), each recipe of ``--recipes``.

``--compiled``: both loops compiled (torch: unimp's ``train_step(compile=True)`` against the
native step under ``torch.compile``, torch's GradScaler in it; TensorFlow: ``jit_compile=True``
on both; JAX is always compiled), and three more columns, counted over the warm-up and
:data:`COMPILED_STEPS` more steps: the compiled graphs (torch: dynamo's unique graphs;
TensorFlow and JAX: the traced or compiled functions), the graph breaks (torch: dynamo's
count; an XLA function compiles whole or fails, so 0), and the recompilations after the first
warm step (torch: graphs added; TensorFlow: retraces; JAX: jit cache entries added). A
compiled torch step's aten ops are not counted: dynamo does not run under the counting
``TorchDispatchMode`` (the step would run eagerly).

    python -m benchmarks.opcount [--recipes float32+dynamic,mixed_float16] [--models mlp,wide]
        [--compiled]
"""

from __future__ import annotations

import collections
import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import Any

from benchmarks import _harness as h

WARMUP = 2
#: steps after the warm-up over which ``--compiled`` counts recompilations
COMPILED_STEPS = 8
TF_PLUMBING = frozenset(
    {"Const", "Identity", "NoOp", "ReadVariableOp", "Placeholder", "_Arg", "_Retval"}
)
HLO_PLUMBING = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast"})


# --------------------------------------------------------------------------- torch


def _torch(k: Any, t: Any) -> dict[str, Any]:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.ops[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    counter = Count()
    with counter:
        t.one()
    t.sync()
    return {"aten_ops": sum(counter.ops.values()), "ops_by_name": dict(sorted(counter.ops.items()))}


# --------------------------------------------------------------------------- TensorFlow


def _tensorflow(k: Any, t: Any) -> dict[str, Any]:
    graph = t.function.get_concrete_function(t.batches[0]).graph
    types = collections.Counter(op.type for op in k._all_ops(graph))  # noqa: SLF001
    plumbing = sum(n for op, n in types.items() if op in TF_PLUMBING)
    return {
        "graph_ops": sum(types.values()),
        "compute_ops": sum(types.values()) - plumbing,
        "top_level_ops": len(graph.get_operations()),
        "ops_by_type": dict(sorted(types.items())),
    }


# --------------------------------------------------------------------------- JAX

_EXECUTIONS = {"n": 0}


@contextlib.contextmanager
def counting_jax_executions() -> Iterator[None]:
    """Routes every XLA execution through Python and counts it in ``_EXECUTIONS``.

    ``jax.jit``'s C++ fast path (which runs a cached executable without Python) is off while
    inside, for the functions first called inside; ``jax.clear_caches()`` on the way out drops
    their slow-path cache entries.
    """
    import jax
    from jax._src import pjit
    from jax._src.interpreters import pxla

    fastpath, call = pjit._get_fastpath_data, pxla.ExecuteReplicated.__call__  # noqa: SLF001

    def counted(self, *args):  # noqa: ANN001, ANN202
        _EXECUTIONS["n"] += 1
        return call(self, *args)

    pjit._get_fastpath_data = lambda *a, **kw: None  # noqa: SLF001
    pxla.ExecuteReplicated.__call__ = counted
    try:
        yield
    finally:
        pjit._get_fastpath_data, pxla.ExecuteReplicated.__call__ = fastpath, call  # noqa: SLF001
        jax.clear_caches()


def hlo_entry_ops(hlo: str) -> collections.Counter[str]:
    """Opcodes of the instructions of an HLO module's ENTRY computation (text form)."""
    entry = hlo[hlo.index("\nENTRY ") :]
    body = entry[entry.index("{") + 1 : entry.index("\n}")]
    ops: collections.Counter[str] = collections.Counter()
    for line in body.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+ = .*?\s([a-z][a-z0-9\-]*)\(", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def _jax(k: Any, t: Any) -> dict[str, Any]:
    compiled = t.jitted.lower(*t.args()).compile()
    ops = hlo_entry_ops(compiled.as_text())
    mem = compiled.memory_analysis()
    n0 = _EXECUTIONS["n"]
    t.one()
    t.sync()
    return {
        "dispatches": _EXECUTIONS["n"] - n0,
        "fusions": ops.get("fusion", 0),
        "kernels": sum(n for op, n in ops.items() if op not in HLO_PLUMBING),
        "ops_by_name": dict(sorted(ops.items())),
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
    }


# --------------------------------------------------------------------------- worker, table


def worker(cfg: dict) -> dict:
    from benchmarks._kits import kit

    backend = cfg["backend"]
    h.pin_framework_threads(backend, cfg["threads"])
    k = kit(backend)
    with counting_jax_executions() if backend == "jax" else contextlib.nullcontext():
        rows = _rows(k, backend, cfg)
    return {"backend": backend, "framework": k.framework_version(), "rows": rows}


def _rows(k: Any, backend: str, cfg: dict) -> list[dict]:
    count = {"torch": _torch, "tensorflow": _tensorflow, "jax": _jax}[backend]
    compiled = bool(cfg.get("compiled"))
    rows = []
    for model in cfg["models"]:
        spec = h.MODELS[model]
        for rec in cfg["recipes"]:
            for impl in ("unimp", "native"):
                row = {"model": model, "model_desc": spec.describe(), "recipe": rec, "impl": impl,
                       "compiled": compiled}
                if compiled:
                    t, counts = _compiled_counts(k, backend, impl, spec, rec, cfg["device"])
                    # a TorchDispatchMode turns dynamo off (the step runs eagerly under it), so a
                    # compiled torch step's aten ops are not counted: its graphs and breaks are
                    rows.append({**row, **(count(k, t) if backend != "torch" else {"aten_ops": None}), **counts})
                    continue
                t = k.Trainer(impl, spec, rec, cfg["device"])
                for _ in range(WARMUP):
                    t.one()
                t.sync()
                rows.append({**row, **count(k, t)})
    return rows


def _compiled_counts(k: Any, backend: str, impl: str, spec: Any, rec: str, device: Any) -> tuple[Any, dict]:
    """A compiled trainer after the warm-up and :data:`COMPILED_STEPS` more steps, and its
    ``{"graphs", "graph_breaks", "recompiles"}`` (see the module's ``--compiled``)."""
    if backend == "torch":
        import torch._dynamo as dynamo
        from torch._dynamo.utils import counters

        dynamo.reset()
        counters.clear()

        def graphs(t: Any) -> tuple[int, int]:
            return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))
    elif backend == "tensorflow":
        def graphs(t: Any) -> tuple[int, int]:
            return t.tracing_count(), 0  # an XLA function compiles whole or fails
    else:
        def graphs(t: Any) -> tuple[int, int]:
            return int(t.jitted._cache_size()), 0  # noqa: SLF001 - the native loop's jax.jit too

    t = k.Trainer(impl, spec, rec, device, **({} if backend == "jax" else {"compile": True}))
    for _ in range(WARMUP):
        t.one()
    t.sync()
    after_warmup, _ = graphs(t)
    for _ in range(COMPILED_STEPS):
        t.one()
    t.sync()
    n, breaks = graphs(t)
    return t, {"graphs": n, "graph_breaks": breaks, "recompiles": n - after_warmup}


#: backend -> (the count in the table, its name)
HEADLINE = {
    "torch": ("aten_ops", "aten ops"),
    "tensorflow": ("compute_ops", "graph ops (no plumbing)"),
    "jax": ("kernels", "HLO kernels"),
}


def _detail(backend: str, r: dict) -> str:
    if backend == "torch":
        return ""
    if backend == "tensorflow":
        return f"{r['graph_ops']} with plumbing, {r['top_level_ops']} top level"
    return (
        f"{r['fusions']} fusions, {r['dispatches']} dispatch(es)/step, XLA temp "
        f"{r['temp_bytes'] / 2**20:.2f} MiB, out {r['output_bytes'] / 2**20:.2f} MiB, aliased "
        f"{r['alias_bytes'] / 2**20:.2f} MiB"
    )


def table_rows(results: dict[str, dict]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for backend, res in results.items():
        if "error" in res:
            rows.append([backend, "", "", "error: " + res["error"][-200:], "", "", "", "", ""])
            continue
        key, what = HEADLINE[backend]
        by = {(r["model"], r["recipe"], r["impl"]): r for r in res["rows"]}
        for (model, rec, impl), r in by.items():
            if impl != "unimp":
                continue
            n = by[(model, rec, "native")]
            compiled = [f"{r[c]} / {n[c]}" for c in COMPILED_COLUMNS] if r.get("compiled") else []
            rows.append(
                [
                    backend,
                    r["model_desc"],
                    rec,
                    what,
                    "-" if r[key] is None else r[key],
                    "-" if n[key] is None else n[key],
                    "-" if r[key] is None or n[key] is None else f"{r[key] - n[key]:+d}",
                    *compiled,
                    _detail(backend, r),
                    _detail(backend, n),
                ]
            )
    return rows


#: the columns ``--compiled`` adds, each ``unimp / native``
COMPILED_COLUMNS = ("graphs", "graph_breaks", "recompiles")


def main(argv: Sequence[str] | None = None) -> dict:
    p = h.parser(__doc__.splitlines()[0])
    p.add_argument(
        "--recipes",
        default=f"{h.SCALED_FLOAT32},mixed_float16",
        help="comma-separated recipe names (a policy, or <policy>+<loss scale kind>)",
    )
    p.add_argument("--models", default="mlp,wide", help="comma-separated: mlp, wide, tiny")
    p.add_argument(
        "--compiled",
        action="store_true",
        help="both loops compiled (torch.compile; TensorFlow jit_compile=True; JAX always), "
        "with the compiled graphs, graph breaks and recompilations as columns",
    )
    args = h.parse(p, argv)
    if h.served_as_worker(args, worker):
        return {}
    models = ["tiny"] if args.tiny else [m.strip() for m in args.models.split(",") if m.strip()]
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if args.tiny:
        recipes = recipes[:1]
    config = {"models": models, "recipes": recipes, "compiled": args.compiled}
    results = h.run_backends("opcount", args, config)
    payload = {
        "title": "Ops per training step: unimp train_step against the native loop",
        "machine": h.machine(),
        "settings": {
            "device": args.device or "framework default",
            "recipes": ",".join(recipes),
            "warmup_steps": WARMUP,
            "compiled": args.compiled,
            "counts": "one warm step; deterministic (not timed)",
        },
        "results": results,
    }
    compiled = [f"{c.replace('_', ' ')} (unimp / native)" for c in COMPILED_COLUMNS] if args.compiled else []
    header = ["backend", "model", "recipe", "count", "unimp", "native", "unimp - native", *compiled,
              "unimp: detail", "native: detail"]
    table = h.markdown_table(header, table_rows(results))
    h.write(args.out, "opcount", payload, table)
    print(table)
    return payload


if __name__ == "__main__":
    main()
