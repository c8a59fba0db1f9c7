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
from unimp.compare.models import LAYER_NORM_EPS, VIT_HEADS
from unimp.compare.run import RunSpec, test_metrics, train_loop
from unimp.compare.user import user_model


class _PositionEmbedding(keras.layers.Layer):
    """Adds a learned position embedding, one (tokens, D) weight, to its (N, tokens, D) input."""

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.embeddings = self.add_weight(
            shape=tuple(input_shape[1:]), initializer="zeros", name="embeddings"
        )

    def call(self, x: Any) -> Any:
        return x + self.embeddings  # read in the compute dtype (Keras autocasts variables)


def _vit_model(spec: RunSpec, mp: Any) -> keras.Model:
    """vit of :mod:`unimp.compare.models` from Keras layers, with the NumPy weights loaded.

    Keras's ``MultiHeadAttention`` names its projections ``query``, ``key``, ``value`` and
    ``attention_output`` (q, k, v, o in the other frameworks); its EinsumDense kernels are the
    (D, D) matrices reshaped to (D, heads, head_dim) and (heads, head_dim, D).
    """
    w = spec.weights
    h, wd, c = spec.x_test.shape[1:]
    d = w["pos"].shape[1]
    hd = d // VIT_HEADS
    with mp.autocast():
        x_in = keras.Input((h, wd, c), name="x")
        m_in = keras.Input((d,), name="mask")
        z = keras.layers.Dense(d, name="emb")(keras.layers.Reshape((h, wd * c))(x_in))
        z = _PositionEmbedding(name="pos")(z)
        y = keras.layers.LayerNormalization(epsilon=LAYER_NORM_EPS, name="ln1")(z)
        attn = keras.layers.MultiHeadAttention(num_heads=VIT_HEADS, key_dim=hd, name="attn")
        z = keras.layers.Add()([z, attn(y, y)])
        y = keras.layers.LayerNormalization(epsilon=LAYER_NORM_EPS, name="ln2")(z)
        mlp = keras.Sequential(
            [
                keras.layers.Dense(w["mlp_fc1_w"].shape[1], name="fc1"),
                keras.layers.ReLU(name="relu"),
                keras.layers.Dense(d, name="fc2"),
            ],
            name="mlp",
        )
        z = keras.layers.Add()([z, mlp(y)])
        z = keras.layers.LayerNormalization(epsilon=LAYER_NORM_EPS, name="lnf")(z)
        pooled = keras.layers.GlobalAveragePooling1D()(z)
        dropped = keras.layers.Multiply()([pooled, m_in])
        logits = keras.layers.Dense(w["w2"].shape[1], name="l2")(dropped)
        model = keras.Model([x_in, m_in], logits)
    model.get_layer("emb").set_weights([w["emb_w"], w["emb_b"]])
    model.get_layer("pos").set_weights([w["pos"]])
    for ln in ("ln1", "ln2", "lnf"):
        model.get_layer(ln).set_weights([w[f"{ln}_g"], w[f"{ln}_b"]])
    for n, sub in (("q", attn.query_dense), ("k", attn.key_dense), ("v", attn.value_dense)):
        sub.set_weights(
            [w[f"attn_{n}_w"].reshape(d, VIT_HEADS, hd), w[f"attn_{n}_b"].reshape(VIT_HEADS, hd)]
        )
    attn.output_dense.set_weights([w["attn_o_w"].reshape(VIT_HEADS, hd, d), w["attn_o_b"]])
    mlp.get_layer("fc1").set_weights([w["mlp_fc1_w"], w["mlp_fc1_b"]])
    mlp.get_layer("fc2").set_weights([w["mlp_fc2_w"], w["mlp_fc2_b"]])
    model.get_layer("l2").set_weights([w["w2"], w["b2"]])
    return model


def _model(spec: RunSpec, mp: Any) -> keras.Model:
    if spec.model == "vit":
        return _vit_model(spec, mp)
    w = spec.weights
    h, wd, c = spec.x_test.shape[1:]
    hidden = spec.batches[0]["mask"].shape[1]
    with mp.autocast():
        x_in = keras.Input((h, wd, c), name="x")
        m_in = keras.Input((hidden,), name="mask")
        # the ReLU is a layer of its own, so that l1's (conv's) output is taken before it, the
        # point torch's module hook and JAX's observe see (Dense(activation="relu") gave the
        # audit 0.21 % overflowing where torch and JAX said 0.41 %)
        if spec.model == "mlp":
            l1 = keras.layers.Dense(w["w1"].shape[1], name="l1")
            feat = keras.layers.ReLU(name="relu")(l1(keras.layers.Flatten()(x_in)))
        else:
            conv = keras.layers.Conv2D(w["k"].shape[3], w["k"].shape[:2], padding="same", name="conv")
            feat = keras.layers.Flatten()(keras.layers.ReLU(name="relu")(conv(x_in)))
        dropped = keras.layers.Multiply()([feat, m_in])
        logits = keras.layers.Dense(w["w2"].shape[1], name="l2")(dropped)
        model = keras.Model([x_in, m_in], logits)
    if spec.model == "mlp":
        model.get_layer("l1").set_weights([w["w1"], w["b1"]])
    else:
        model.get_layer("conv").set_weights([w["k"], w["bk"]])
    model.get_layer("l2").set_weights([w["w2"], w["b2"]])
    return model


def _fp8_scales(mp: Any, model: keras.Model) -> dict[str, dict[str, float]]:
    """``{layer: {tensor: scale}}`` of the Dense layers ``prepare`` gave the float8 matmul."""
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
            model = _model(spec, mp)
        if spec.optimizer == "adam":
            inner = keras.optimizers.Adam(spec.lr, epsilon=1e-8)
        else:
            inner = keras.optimizers.SGD(spec.lr)
        model, opt = mp.prepare(model, inner)

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
    }
