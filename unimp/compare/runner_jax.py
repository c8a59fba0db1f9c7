"""``unimp compare`` in JAX: the shared model as jmp-style functions, optax, unimp's jax backend."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from unimp.backends import jax as backend
from unimp.backends.jax import observe
from unimp.compare.models import LAYER_NORM_EPS, VIT_HEADS, weight_layer
from unimp.compare.run import RunSpec, train_loop

#: ``cast(layer, x)``: an activation entering a layer, in that layer's compute dtype
#: (``mp.cast_to_compute(x, path=layer)``: the recipe's, or a per-layer override's).
Cast = Callable[[str, jax.Array], jax.Array]


def _dense(p: dict, name: str, x: jax.Array, cast: Cast) -> jax.Array:
    # the layer's output is observed (tensor statistics) under the name torch and Keras give it
    x = cast(weight_layer(f"{name}_w"), x)
    return observe(name.replace("_", "/"), x @ p[f"{name}_w"] + p[f"{name}_b"])


def _layer_norm(p: dict, name: str, x: jax.Array, cast: Cast) -> jax.Array:
    """LayerNorm over the last axis, mean and variance in ``x``'s dtype (as jmp users write it)."""
    x = cast(name, x)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + LAYER_NORM_EPS) * p[f"{name}_g"] + p[f"{name}_b"]
    return observe(name, y)


def _attention(p: dict, x: jax.Array, heads: int, cast: Cast) -> jax.Array:
    """Multi-head self-attention: ``softmax(q k^T / sqrt(head_dim)) v``, then ``o``."""
    n, t, d = x.shape
    hd = d // heads

    def proj(name: str, y: jax.Array) -> jax.Array:
        with jax.named_scope(name):
            return _dense(p, f"attn_{name}", y, cast)

    def split(y: jax.Array) -> jax.Array:  # (N, T, D) -> (N, heads, T, hd)
        return y.reshape(n, t, heads, hd).transpose(0, 2, 1, 3)

    q, k, v = (split(proj(name, x)) for name in "qkv")
    att = jax.nn.softmax(q @ k.swapaxes(-1, -2) / math.sqrt(hd), axis=-1)
    return proj("o", (att @ v).transpose(0, 2, 1, 3).reshape(n, t, d))


def _vit(p: dict, x: jax.Array, cast: Cast) -> jax.Array:
    """vit of :mod:`unimp.compare.models` up to the pooled (N, D) features, in ``x``'s dtype."""
    n, h, w, c = x.shape
    with jax.named_scope("emb"):
        z = _dense(p, "emb", x.reshape(n, h, w * c), cast)
    with jax.named_scope("pos"):
        z = z + p["pos"]
    with jax.named_scope("ln1"):
        y = _layer_norm(p, "ln1", z, cast)
    with jax.named_scope("attn"):
        z = z + _attention(p, y, VIT_HEADS, cast)
    with jax.named_scope("ln2"):
        y = _layer_norm(p, "ln2", z, cast)
    with jax.named_scope("mlp"):
        with jax.named_scope("fc1"):
            y = jax.nn.relu(_dense(p, "mlp_fc1", y, cast))
        with jax.named_scope("fc2"):
            z = z + _dense(p, "mlp_fc2", y, cast)
    with jax.named_scope("lnf"):
        z = _layer_norm(p, "lnf", z, cast)
    return z.mean(1)


def _forward(mp: Any, kind: str):
    def forward(params: dict, x: jax.Array, mask: jax.Array) -> jax.Array:
        # params are {layer: {weight: array}} (gradient names "l1/w1" line up with the other
        # frameworks' "l1.weight" and "l1/kernel"); the maths reads the flat weight names
        p = {k: v for layer in mp.cast_to_compute(params).values() for k, v in layer.items()}
        x = mp.cast_to_compute(x)

        def cast(layer: str, y: jax.Array) -> jax.Array:  # a no-op without overrides
            return mp.cast_to_compute(y, path=layer)

        if kind == "vit":
            h = _vit(p, x, cast)
        elif kind == "mlp":
            with jax.named_scope("l1"):
                x1 = cast("l1", x.reshape(x.shape[0], -1))
                h = jax.nn.relu(observe("l1", x1 @ p["w1"] + p["b1"]))
        else:
            with jax.named_scope("conv"):
                y = jax.lax.conv_general_dilated(
                    cast("conv", x), p["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
                )
                h = jax.nn.relu(observe("conv", y + p["bk"])).reshape(x.shape[0], -1)
        h = h * mask.astype(h.dtype)
        with jax.named_scope("l2"):
            h = cast("l2", h)
            logits = observe("l2", h @ p["w2"] + p["b2"])
        return mp.cast_to_output(logits)

    return forward


def _device(spec: RunSpec) -> Any:
    return jax.devices("gpu" if spec.device == "cuda" else "cpu")[0]


def build(spec: RunSpec) -> tuple[Any, Any, Callable[[dict], Any]]:
    """The bound recipe, the train step and the batch conversion, as :func:`run` uses them.

    Returns:
        ``(mp, step, convert)``.
    """
    with jax.default_device(_device(spec)):
        mp = backend.MixedPrecision(spec.recipe)
        forward = _forward(mp, spec.model)

        def loss_fn(params: dict, b: dict) -> jax.Array:
            logits = forward(params, b["x"], b["mask"]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

        # the learning rate as a hyperparameter in the state: the step log reads it from there
        if spec.optimizer == "adam":
            opt = optax.inject_hyperparams(optax.adam)(learning_rate=spec.lr, eps=1e-8)
        else:
            opt = optax.inject_hyperparams(optax.sgd)(learning_rate=spec.lr)
        params: dict[str, dict[str, jax.Array]] = {}
        for k, v in spec.weights.items():
            params.setdefault(weight_layer(k), {})[k] = jnp.asarray(v)
        step = mp.train_step(loss_fn, opt, params, **spec.step_options())
    step.forward = forward  # for the test accuracy
    return mp, step, lambda b: {k: jnp.asarray(v) for k, v in b.items()}


def run(spec: RunSpec) -> dict[str, Any]:
    device = _device(spec)
    mp, step, convert = build(spec)
    with jax.default_device(device):
        trace = mp.trace(step, convert(spec.batches[0])) if spec.trace else None
        out = train_loop(step, spec, convert)
        ones = jnp.ones((len(spec.x_test), spec.batches[0]["mask"].shape[1]), jnp.float32)
        logits = jax.jit(step.forward)(step.params, jnp.asarray(spec.x_test), ones)
        pred = np.asarray(jnp.argmax(logits.astype(jnp.float32), axis=1))
    stats = device.memory_stats() if spec.device == "cuda" else None
    return {
        "framework": "jax",
        "version": backend.framework_version(),
        "device": str(device),
        **out,
        "test_accuracy": float((pred == spec.y_test).mean()),
        "peak_memory_bytes": None if not stats else int(stats.get("peak_bytes_in_use", 0)) or None,
        "trace": None if trace is None else trace.to_dict(),
    }
