"""The built-in models of ``unimp compare`` from Keras layers, written against Keras only, so
that Keras on TensorFlow, JAX and torch build the same model with the same weights."""

from __future__ import annotations

from typing import Any

import keras

from unimp.compare.models import LAYER_NORM_EPS, VIT_HEADS
from unimp.compare.run import RunSpec

__all__ = ["keras_model", "keras_optimizer"]


class _PositionEmbedding(keras.layers.Layer):
    """Adds a learned position embedding, one (tokens, D) weight, to its (N, tokens, D) input."""

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.embeddings = self.add_weight(
            shape=tuple(input_shape[1:]), initializer="zeros", name="embeddings"
        )

    def call(self, x: Any) -> Any:
        return x + self.embeddings  # read in the compute dtype (Keras autocasts variables)


def _vit_model(spec: RunSpec, autocast: Any) -> keras.Model:
    """vit of :mod:`unimp.compare.models` from Keras layers, with the NumPy weights loaded.

    Keras's ``MultiHeadAttention`` names its projections ``query``, ``key``, ``value`` and
    ``attention_output`` (q, k, v, o in the other frameworks); its EinsumDense kernels are the
    (D, D) matrices reshaped to (D, heads, head_dim) and (heads, head_dim, D).
    """
    w = spec.weights
    h, wd, c = spec.x_test.shape[1:]
    d = w["pos"].shape[1]
    hd = d // VIT_HEADS
    with autocast:
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


def keras_model(spec: RunSpec, autocast: Any) -> keras.Model:
    """The built-in model ``spec.model`` (mlp, cnn, vit of :mod:`unimp.compare.models`) from
    Keras layers, built inside ``autocast`` (a dtype-policy scope, or a null context where the
    global policy is set), with ``spec.weights`` loaded: the same on every Keras backend."""
    if spec.model == "vit":
        return _vit_model(spec, autocast)
    w = spec.weights
    h, wd, c = spec.x_test.shape[1:]
    hidden = spec.batches[0]["mask"].shape[1]
    with autocast:
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


def keras_optimizer(spec: RunSpec) -> keras.optimizers.Optimizer:
    """The Keras optimizer of ``spec`` (``adam``: eps 1e-8, as every runner's Adam; else SGD),
    unwrapped: the runner wraps it (``prepare`` or ``mp.loss_scale_optimizer``)."""
    if spec.optimizer == "adam":
        return keras.optimizers.Adam(spec.lr, epsilon=1e-8)
    return keras.optimizers.SGD(spec.lr)
