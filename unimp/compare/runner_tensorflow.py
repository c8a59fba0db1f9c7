"""``unimp compare`` in TensorFlow/Keras 3 through unimp's tensorflow backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from unimp.backends import tensorflow as backend
from unimp.backends.tensorflow.fp8 import fp8_model_layers
from unimp.compare.fp8_scales import TENSORS, capture_first, scales_record
from unimp.compare.keras_models import keras_model, keras_optimizer
from unimp.compare.run import RunSpec, test_metrics, train_loop
from unimp.compare.user import user_model


def _fp8_scales(mp: Any, model: keras.Model) -> dict[str, dict[str, float]]:
    """``{layer: {tensor: scale}}`` of the Dense layers ``prepare`` gave the float8 matmul
    (none without an FP8 recipe: a block-scaled recipe's layers keep no scales)."""
    if mp.recipe.fp8 is None:
        return {}
    layers = {path: layer for path, _, layer in fp8_model_layers(model)}
    return {p: {t: float(getattr(layers[p], f"{t}_scale").numpy()) for t in TENSORS}
            for p in mp.fp8_layers(model)}


def probe(model: keras.Model, x: np.ndarray, seed: int) -> np.ndarray:
    """The user's model's outputs for ``x`` in float32, in inference mode (the shape check of
    ``--model FILE.py:FUNCTION``, before any training)."""
    return np.asarray(tf.cast(model(tf.constant(x), training=False), tf.float32))


def _forward(model: keras.Model, b: dict[str, Any], user: bool, training: bool) -> Any:
    out = model(b["x"], training=training) if user else model([b["x"], b["mask"]], training=training)
    return tf.cast(out, tf.float32)


def loss_of(out: Any, y: Any, loss: str) -> Any:
    """The mean loss of a batch, in float32: softmax cross-entropy of logits and class indices,
    or the mean squared error."""
    if loss == "mse":
        return tf.reduce_mean(tf.square(out - tf.cast(y, tf.float32)))
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=out))


def _device(spec: RunSpec) -> str:
    return "/GPU:0" if spec.device == "cuda" else "/CPU:0"


def build(spec: RunSpec) -> tuple[Any, Any, Callable[[dict], Any]]:
    """The bound recipe, the train step and the batch conversion, as :func:`run` uses them.

    Returns:
        ``(mp, step, convert)``.
    """
    with tf.device(_device(spec)):
        mp = backend.MixedPrecision(spec.recipe)
        if spec.user_model:  # built under the recipe's policy, as prepare wants it
            with mp.autocast():
                model, _ = user_model(spec.model, spec.seed)
        else:
            model = keras_model(spec, mp.autocast())
        model, opt = mp.prepare(model, keras_optimizer(spec))

        def loss_fn(model: keras.Model, b: dict[str, tf.Tensor]) -> tf.Tensor:
            return loss_of(_forward(model, b, spec.user_model, True), b["y"], spec.loss)

        step = mp.train_step(model, opt, loss_fn, **spec.step_options())
    return mp, step, lambda b: b


def run(spec: RunSpec) -> dict[str, Any]:
    device = _device(spec)
    mp, step, convert = build(spec)
    model = step.model
    with tf.device(device):
        # the step's own trace: training reuses it (tracing here costs no second trace)
        trace = mp.trace(step, convert(spec.batches[0])) if spec.trace else None
        first = capture_first(spec, lambda: _fp8_scales(mp, model))
        out = train_loop(step, spec, convert)
        fp8 = scales_record(first, _fp8_scales(mp, model)) if spec.recipe.fp8 is not None else None
        ones = np.ones((len(spec.x_test), spec.batches[0]["mask"].shape[1]), np.float32)
        held_out = {"x": tf.constant(spec.x_test), "mask": tf.constant(ones)}
        test = test_metrics(np.asarray(_forward(model, held_out, spec.user_model, False)), spec.y_test, spec.loss)
    peak = None
    if spec.device == "cuda":
        peak = int(tf.config.experimental.get_memory_info("GPU:0")["peak"])
    return {
        "framework": "tensorflow",
        "version": backend.framework_version(),
        "device": device.strip("/").lower(),
        **out,
        **test,
        "peak_memory_bytes": peak,
        "trace": None if trace is None else trace.to_dict(),
        "fp8_scales": fp8,
        "block_layers": list(mp.fp8_layers(model)) if spec.recipe.block is not None else None,
    }
