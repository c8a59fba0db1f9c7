"""``unimp compare`` on Keras's own trainer, on each Keras backend: ``keras-tensorflow``,
``keras-jax``, ``keras-torch``.

Keras's backend is fixed per process, so each run is a worker process of its own
(``python -m unimp.compare.runner_keras``, ``KERAS_BACKEND`` set): the spec goes in as a
pickle, the progress comes back as lines, the run as a pickle. In the worker the model is built
under the recipe's Keras dtype policy and prepared by the recipe bound to Keras on that engine
(``unimp.mixed_precision(recipe, backend="keras")``: per-layer overrides, the output cast),
compiled with :class:`unimp.keras.LossScaleOptimizer`
(unimp's rule on ``keras.ops``) and trained by ``model.train_on_batch``: Keras's own compiled
step (``tf.function``, ``jax.jit``, eager torch). The same model definition on three engines, so
what differs between them is the engines' kernels, not the model's code.

The built-in models load ``spec.weights``; the user's Keras model (``--model FILE.py:FUNCTION``)
is built by its function in the first Keras worker, and its initial weights go to the others,
so every Keras engine starts from the same weights.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import subprocess
import sys
import tempfile
import traceback
import warnings
from dataclasses import fields, replace
from typing import Any

from unimp.compare.run import RunSpec, keras_refusal
from unimp.compare.user import KERAS_ENGINES, UserFileError

__all__ = ["run"]

#: a user model's initial weights, from the first Keras worker that built it (per model, seed)
_initial: dict[tuple[str, int], list[Any]] = {}


def run(spec: RunSpec, engine: str, task: str | None = None) -> dict[str, Any]:
    """Runs ``spec`` on Keras's ``engine`` in a worker process.

    Args:
        spec: the run.
        engine: a key of :data:`unimp.compare.user.KERAS_ENGINES`.
        task: ``"module:function"`` the worker calls with ``spec`` instead of training with
            Keras's trainer (``unimp trace`` and ``unimp audit``: :mod:`unimp.compare.keras_step`);
            its dict is returned.

    Returns:
        The run's dict, as the other runners return it.

    Raises:
        ValueError: a recipe Keras's trainer cannot run (:func:`unimp.compare.run.keras_refusal`).
        UserFileError: the run raised in the worker (a ``ValueError``: the CLI prints the
            worker's traceback, then the exception in one line).
        RuntimeError: the worker died before it wrote its run (the exit code or signal, and
            its last lines of output).
    """
    why = keras_refusal(spec.recipe)
    if why:
        raise ValueError(f"{engine}: {why}.")
    key = (spec.model, spec.seed)
    if spec.user_model and key in _initial:
        spec = replace(spec, weights={str(i): w for i, w in enumerate(_initial[key])})
    payload = {f.name: getattr(spec, f.name) for f in fields(spec) if f.name != "progress"}
    if task is None:  # Keras's trainer has no step log: the run has none (its statistics are
        payload.update(log=None)  # unimp's step's, taken beside it: _train)
    with tempfile.TemporaryDirectory(prefix="unimp-keras-") as tmp:
        src, dst = os.path.join(tmp, "spec.pkl"), os.path.join(tmp, "run.pkl")
        with open(src, "wb") as f:
            pickle.dump(payload, f)
        env = {**os.environ, "KERAS_BACKEND": KERAS_ENGINES[engine]}
        # stderr to a file: a pipe nobody drains fills at 64 KB and stalls the worker for good
        with open(os.path.join(tmp, "stderr.txt"), "w+") as err, subprocess.Popen(
            [sys.executable, "-m", "unimp.compare.runner_keras", src, dst, *([task] if task else [])],
            env=env, stdout=subprocess.PIPE, stderr=err, text=True,
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("step "):
                    spec.progress(int(line.split()[1]))
            proc.wait()
            err.seek(0)
            tail = [ln for ln in err.read().strip().splitlines() if ln.strip()][-3:]
        if not os.path.exists(dst):
            how = (
                f"was killed by signal {-proc.returncode}"
                if proc.returncode < 0
                else f"exited with code {proc.returncode}"
            )
            raise RuntimeError(
                f"{engine}: the Keras worker {how} before it wrote its run; its last lines:\n"
                + "\n".join(tail)
            )
        with open(dst, "rb") as f:
            out = pickle.load(f)
    for category, message in out.pop("warnings", ()):
        warnings.warn(message, _category(category), stacklevel=2)
    if "error" in out:
        e = out["error"]
        said = e["message"] if e["type"] == "UserFileError" else f"{e['type']}: {e['message']}"
        raise UserFileError(f"{engine}: {said}", e["details"])
    initial = out.pop("initial_weights", None)
    if spec.user_model and key not in _initial and initial is not None:
        _initial[key] = initial
    return out


def _work(spec: RunSpec, task: str | None = None) -> dict[str, Any]:  # in the worker process
    from unimp.compare.threads import threads

    engine = os.environ["KERAS_BACKEND"]
    module, _, name = (task or "").partition(":")
    work = _train if task is None else getattr(importlib.import_module(module), name)
    with (
        contextlib.nullcontext({}) if spec.threads is None else threads([engine], spec.threads)
    ) as info:  # first: TensorFlow takes its pools' sizes only before it starts
        return {**work(spec), "threads_set": info}  # what threads() set (torch's read back)


def _train(spec: RunSpec) -> dict[str, Any]:
    import keras
    import numpy as np

    import unimp
    from unimp.compare.fp8_scales import capture_first, scales_record
    from unimp.compare.keras_models import keras_model, keras_optimizer
    from unimp.compare.keras_step import step_stats, step_trace
    from unimp.compare.run import test_metrics, train_loop
    from unimp.compare.user import user_model
    from unimp.loss_scale import LossScaleState, NoLossScale
    from unimp.step import StepResult, warn_half_optimizer_state

    p = spec.recipe.policy
    # the recipe bound to Keras on this engine: its dtype policy while the model is built, then
    # prepare's per-layer overrides and output cast (the in-process runners' calls)
    mp = unimp.mixed_precision(spec.recipe, backend="keras")
    if spec.user_model:
        with mp.autocast():
            model, _ = user_model(spec.model, spec.seed)
        initial = model.get_weights()
        if spec.weights:
            model.set_weights([spec.weights[str(i)] for i in range(len(spec.weights))])
            initial = None
    else:
        model, initial = keras_model(spec, mp.autocast()), None
    mp.prepare(model)
    inner = keras_optimizer(spec)
    if p.param_dtype == "float16" and spec.optimizer == "adam":  # as the other runners warn
        warn_half_optimizer_state("Adam", 1e-8)
    config = spec.recipe.loss_scale
    scaled = config is not None and not isinstance(config, NoLossScale)
    # unimp's optimizer with or without a loss scale: it applies the policy's update rule and
    # takes half variables' updates in float32 (Keras's own computes Adam in bfloat16, where
    # beta_2 = 0.999 is 1.0 and a pure-bfloat16 model learns nothing)
    opt = mp.loss_scale_optimizer(inner)
    loss = (
        keras.losses.MeanSquaredError()
        if spec.loss == "mse"
        else keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model.compile(optimizer=opt, loss=loss)
    # Keras's trainer records no dtype trace: unimp's step on this model and first batch does
    # (with an optimizer of its own; nothing here changes), its forward pass the model's
    trace = step_trace(spec, mp, model) if spec.trace else None

    def inputs(b: dict[str, Any]) -> Any:
        return b["x"] if spec.user_model else [b["x"], b["mask"]]

    def state() -> LossScaleState:  # before Keras builds the optimizer (first step): the start
        if not scaled:
            return LossScaleState(1.0, 0, 0, 0)
        return opt.state() if opt.built else config.initial_state()

    def step(b: dict[str, Any]) -> StepResult:
        before = state()
        loss = float(np.asarray(model.train_on_batch(inputs(b), b["y"])))
        after = state()
        applied = int(after.total_skips) == int(before.total_skips) if scaled else bool(np.isfinite(loss))
        # Keras's trainer reports no finite flags: a skip with a finite loss was the gradients'
        raw = {"loss": loss, "scale": before.scale, "applied": applied,
               "loss_finite": bool(np.isfinite(loss)), "grads_finite": applied, "grad_norm": None,
               "consecutive_skips": after.consecutive_skips, "total_skips": after.total_skips}
        return StepResult(raw, config=config if scaled else None)

    spec.progress = lambda i: print(f"step {i}", flush=True)
    # Keras's trainer takes no statistics: unimp's step, with an optimizer of its own and the
    # weights put back, on the first batch before training and on the last one before its step
    stats: dict[str, Any] = {}
    if spec.stats_every is not None:
        stats_of, last, printed = step_stats(spec, mp, model), len(spec.batches) - 1, spec.progress
        stats["0"] = stats_of(spec.batches[0])

        def progress(i: int) -> None:
            if i == last - 1:
                stats[str(last)] = stats_of(spec.batches[last])
            printed(i)

        spec.progress = progress
    fp8_on = spec.recipe.fp8 is not None
    first = capture_first(spec, lambda: _fp8_scales(mp, model)) if fp8_on else {}
    out = train_loop(step, spec, lambda b: b)
    if stats:
        out["stats"] = stats
    ones = np.ones((len(spec.x_test), spec.batches[0]["mask"].shape[1]), np.float32)
    held_out = {"x": spec.x_test, "mask": ones}
    # one batch of every held-out row, as every runner evaluates: NVFP4's global scale is the
    # batch's amax, so the outputs depend on how the rows are batched
    predicted = np.asarray(model.predict(inputs(held_out), batch_size=len(spec.x_test), verbose=0), np.float32)
    engine = keras.backend.backend()  # Keras's backend is named as its framework's module
    return {
        "framework": f"keras-{engine}",
        "version": f"keras {keras.__version__}, {engine} {importlib.import_module(engine).__version__}",
        "device": spec.device,
        **out,
        **test_metrics(predicted, spec.y_test, spec.loss),
        "peak_memory_bytes": None,
        "trace": None if trace is None else trace.to_dict(),
        "fp8_scales": scales_record(first, _fp8_scales(mp, model)) if fp8_on else None,
        "block_layers": list(mp.fp8_layers(model)) if spec.recipe.block is not None else None,
        "initial_weights": initial,
    }


def _fp8_scales(mp: Any, model: Any) -> dict[str, dict[str, float]]:
    """``{layer: {tensor: scale}}`` of the Dense layers ``prepare`` gave the float8 matmul (one
    host read per scale)."""
    import numpy as np
    from keras import ops

    from unimp.compare.fp8_scales import TENSORS
    from unimp.keras.fp8 import fp8_model_layers

    layers = {path: layer for path, _, layer in fp8_model_layers(model, mp._fp8_dense)}
    return {
        p: {t: float(np.asarray(ops.convert_to_numpy(getattr(layers[p], f"{t}_scale")))) for t in TENSORS}
        for p in mp.fp8_layers(model)
    }


def _category(name: str) -> type[Warning]:
    """The warning class ``module:qualname`` names, where it is a Warning; else UserWarning."""
    module, _, qualname = name.partition(":")
    try:
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return UserWarning
    return found if isinstance(found, type) and issubclass(found, Warning) else UserWarning


def _main(src: str, dst: str, task: str | None = None) -> None:  # the worker process
    with open(src, "rb") as f:
        spec = RunSpec(**pickle.load(f))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            result = _work(spec, task)
        except Exception as e:  # the parent raises it as one line, with this traceback
            result = {
                "error": {
                    "type": type(e).__name__,
                    "message": str(e).strip().splitlines()[0] if str(e).strip() else "",
                    "details": getattr(e, "details", "")
                    or "".join(traceback.format_exception(type(e), e, e.__traceback__)),
                }
            }
    # the parent shows the worker's warnings as the in-process runners' (unimp's own by class)
    result["warnings"] = [
        (f"{w.category.__module__}:{w.category.__qualname__}", str(w.message))
        for w in seen
        if w.category.__module__.split(".")[0] == "unimp"
    ]
    with open(dst, "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    _main(*sys.argv[1:])
