"""``unimp trace``: the dtype trace of one training step of the compare models, per framework.

The model, weights and first batch are those of ``unimp compare`` (:mod:`unimp.compare.run`);
each framework's runner builds its train step (:func:`build`) and the backend's ``trace``
records it (:meth:`unimp.backends._base.MixedPrecisionBase.trace`): torch runs it under a
dispatch mode and puts the model back, TensorFlow and JAX trace it without running it. A Keras
engine (``keras-tensorflow``, ``keras-jax``, ``keras-torch``) traces unimp's Keras step in a
worker process of its own (:mod:`unimp.compare.keras_step`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from unimp import registry
from unimp.compare.models import hidden_size, init_weights
from unimp.compare.run import (
    CompareConfig,
    RunSpec,
    _runner,
    device_for,
    refuse_user_model,
    trace_diff,
    validate,
)
from unimp.compare.user import KERAS_ENGINES
from unimp.recipe import Recipe, get_recipe
from unimp.trace import Trace

__all__ = ["trace_compare_model", "trace_report"]


def _spec(cfg: CompareConfig, recipe: Recipe, backend: str) -> tuple[RunSpec, Any]:
    from unimp.compare.data import batches, load_dataset

    ds = load_dataset(cfg.data, seed=cfg.seed, num_classes=10 if cfg.data == "digits" else None)
    weights = init_weights(cfg.model, ds.image_shape, ds.num_classes, cfg.seed)
    first = batches(
        ds, batch_size=cfg.batch_size, epochs=1, seed=cfg.seed, dropout=cfg.dropout,
        hidden=hidden_size(cfg.model, ds.image_shape),
    )[:1]  # fmt: skip
    spec = RunSpec(
        recipe, cfg.model, weights, first, ds.x_test, ds.y_test, ds.num_classes,
        cfg.optimizer, cfg.lr, device_for(backend, cfg.device),
    )  # fmt: skip
    return spec, first[0]


def trace_compare_model(cfg: CompareConfig, backend: str, recipe: Recipe | None = None) -> Trace:
    """The trace of one train step of ``cfg.model`` in ``backend`` (the first batch).

    Args:
        cfg: compare options (recipe, model, data, batch size, seed, device, loss scale).
        backend: a backend name.
        recipe: overrides ``cfg``'s recipe (the float32 reference of :func:`trace_report`).

    Raises:
        ValueError, ImportError: bad options, named as ``unimp compare`` names them; on a Keras
            engine, what its worker raised (:func:`unimp.compare.runner_keras.run`: the CLI
            prints the worker's traceback, then one line).
        RuntimeError: a Keras worker died before it wrote its trace.
    """
    rec, _, _ = validate(cfg)
    rec = recipe if recipe is not None else rec
    if backend in KERAS_ENGINES:  # Keras's backend is fixed per process: a worker each
        spec, _ = _spec(cfg, rec, backend)  # its first batch is traced
        return Trace.from_dict(_runner(backend, task="unimp.compare.keras_step:trace_task")(spec)["trace"])
    name = registry.backend_info(backend).name
    runner = importlib.import_module(f"unimp.compare.runner_{name}")
    spec, batch = _spec(cfg, rec, name)
    mp, step, convert = runner.build(spec)
    return mp.trace(step, convert(batch), recipe=rec.describe())


def trace_report(
    cfg: CompareConfig, *, with_float32: bool = False, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Traces every requested backend (and a float32 reference with ``with_float32``).

    Returns:
        ``{"recipe", "model", "traces": {backend: Trace}, "reference": {label: Trace},
        "diff": [DiffRow]}``; the float32 reference (``with_float32``) is labelled
        ``float32 (<backend>)``, traced in the first backend, and shown beside the diff.
    """
    refuse_user_model(cfg.model, "unimp trace")
    recipe, backends, _ = validate(cfg)
    traces: dict[str, Trace] = {}
    for b in backends:
        if progress is not None:
            progress(b)
        traces[b] = trace_compare_model(cfg, b)
    reference: dict[str, Trace] = {}
    if with_float32 and backends:
        reference[f"float32 ({backends[0]})"] = trace_compare_model(
            cfg, backends[0], get_recipe("float32")
        )
    return {
        "recipe": recipe.describe(),
        "model": cfg.model,
        "traces": traces,
        "reference": reference,
        "diff": trace_diff(traces, reference),
    }
