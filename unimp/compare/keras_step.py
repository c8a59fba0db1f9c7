"""unimp's Keras train step in compare's Keras workers: what ``unimp trace`` and ``unimp audit``
record on Keras's engines (``keras-tensorflow``, ``keras-jax``, ``keras-torch``), and the dtype
trace of ``unimp compare``'s keras-* runs.

Keras's backend is fixed per process, so each engine runs in a Keras worker of its own:
:func:`unimp.compare.runner_keras.run` given ``task="unimp.compare.keras_step:trace_task"``
(or ``stats_task``) calls that function there. The compare model is built from Keras layers
with the same weights (:func:`unimp.compare.keras_models.keras_model`), prepared by the recipe
bound to Keras on that engine (``unimp.mixed_precision(recipe, backend="keras")``:
:class:`unimp.keras.MixedPrecision` on JAX and torch, the TensorFlow backend's on TensorFlow)
and stepped by unimp's custom-loop train step (``mp.train_step``): that step is what
``mp.trace`` records and what takes statistics (Keras's own trainer, which compare's keras-*
runs train with, does neither). The same model definition on three engines: where their traces
differ, the engines' kernels differ.

The functions here run in a worker, where ``KERAS_BACKEND`` is set; they import Keras there.
"""

from __future__ import annotations

from typing import Any

from unimp.compare.keras_models import keras_optimizer
from unimp.compare.keras_trace import engine_trace
from unimp.compare.run import RunSpec, train_loop
from unimp.trace import Trace

__all__ = ["stats_task", "step_stats", "step_trace", "trace_task"]


def _loss_fn(spec: RunSpec) -> Any:
    """``loss_fn(model, batch)``: the mean loss of Keras's trainer in compare (sparse softmax
    cross-entropy of the logits, or the mean squared error), in float32, on ``keras.ops``."""
    import keras
    from keras import ops

    def loss_fn(model: Any, b: dict[str, Any]) -> Any:
        out = model(b["x"] if spec.user_model else [b["x"], b["mask"]], training=True)
        out = ops.cast(out, "float32")
        if spec.loss == "mse":
            return ops.mean(ops.square(out - ops.cast(b["y"], "float32")))
        return ops.mean(keras.losses.sparse_categorical_crossentropy(b["y"], out, from_logits=True))

    return loss_fn


def _build(spec: RunSpec) -> tuple[Any, Any]:
    """In the worker: the recipe bound to Keras on this engine and the built-in model
    ``spec.model`` with ``spec.weights`` prepared by it, as the TensorFlow runner builds it."""
    import unimp
    from unimp.compare.keras_models import keras_model

    mp = unimp.mixed_precision(spec.recipe, backend="keras")
    return mp, mp.prepare(keras_model(spec, mp.autocast()))


def step_trace(spec: RunSpec, mp: Any, model: Any) -> Trace:
    """In a Keras worker: the trace of unimp's train step of ``model`` (prepared by ``mp``) on
    ``spec.batches[0]``, with an optimizer of its own, so that nothing the caller trains with
    changes (the trace runs nothing on TensorFlow and JAX, and puts the step back on torch):
    compare's keras-* runs, which train with Keras's trainer, are traced so.

    Returns:
        The :class:`unimp.trace.Trace`, named ``keras-<engine>``.
    """
    import keras

    step = mp.train_step(model, keras_optimizer(spec), _loss_fn(spec))
    return engine_trace(mp.trace(step, spec.batches[0]), f"keras-{keras.backend.backend()}")


def step_stats(spec: RunSpec, mp: Any, model: Any) -> Any:
    """In a Keras worker: ``stats(batch) -> StepStats dict``, the tensor statistics of one step
    of unimp's train step of ``model`` (prepared by ``mp``) on ``batch``, with an optimizer of
    its own and the model's weights put back after it, so that nothing the caller trains with
    changes: compare's keras-* runs, which train with Keras's trainer (it takes no
    statistics), get their first and last step's statistics so. The step starts at the
    recipe's initial loss scale.
    """
    step = mp.train_step(model, keras_optimizer(spec), _loss_fn(spec), stats_every=1)

    def stats(batch: dict[str, Any]) -> dict[str, Any]:
        weights = model.get_weights()
        try:
            return step(batch).stats.to_dict()
        finally:
            model.set_weights(weights)

    return stats


def trace_task(spec: RunSpec) -> dict[str, Any]:
    """In a Keras worker (``unimp trace``): ``{"trace": Trace dict}``, one train step of the
    built-in model on ``spec.batches[0]`` (:func:`step_trace`), named ``keras-<engine>``."""
    return {"trace": step_trace(spec, *_build(spec)).to_dict()}


def stats_task(spec: RunSpec) -> dict[str, Any]:
    """In a Keras worker (``unimp audit``): ``spec``'s steps through unimp's train step, with
    statistics every ``spec.stats_every`` steps and the step log ``spec.log``.

    Returns:
        What :func:`unimp.compare.run.train_loop` returns (``"stats"``: ``{step: StepStats
        dict}``), with ``"framework"``: the engine.
    """
    import keras

    mp, model = _build(spec)
    step = mp.train_step(model, keras_optimizer(spec), _loss_fn(spec), **spec.step_options())
    spec.progress = lambda i: print(f"step {i}", flush=True)  # read by the parent
    return {"framework": f"keras-{keras.backend.backend()}", **train_loop(step, spec, lambda b: b)}
