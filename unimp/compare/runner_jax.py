"""``unimp compare`` in JAX: the shared model as jmp-style functions, optax, unimp's jax backend."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from unimp.backends import jax as backend
from unimp.compare.run import RunSpec, train_loop


def _forward(mp: Any, kind: str):
    def forward(params: dict, x: jax.Array, mask: jax.Array) -> jax.Array:
        p = mp.cast_to_compute(params)
        x = mp.cast_to_compute(x)
        if kind == "mlp":
            h = jax.nn.relu(x.reshape(x.shape[0], -1) @ p["w1"] + p["b1"])
        else:
            y = jax.lax.conv_general_dilated(
                x, p["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            h = jax.nn.relu(y + p["bk"]).reshape(x.shape[0], -1)
        h = h * mask.astype(h.dtype)
        return mp.cast_to_output(h @ p["w2"] + p["b2"])

    return forward


def run(spec: RunSpec) -> dict[str, Any]:
    platform = "gpu" if spec.device == "cuda" else "cpu"
    device = jax.devices(platform)[0]
    with jax.default_device(device):
        mp = backend.MixedPrecision(spec.recipe)
        forward = _forward(mp, spec.model)

        def loss_fn(params: dict, b: dict) -> jax.Array:
            logits = forward(params, b["x"], b["mask"]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

        opt = optax.adam(spec.lr, eps=1e-8) if spec.optimizer == "adam" else optax.sgd(spec.lr)
        params = {k: jnp.asarray(v) for k, v in spec.weights.items()}
        step = mp.train_step(loss_fn, opt, params)
        out = train_loop(step, spec, lambda b: {k: jnp.asarray(v) for k, v in b.items()})
        ones = jnp.ones((len(spec.x_test), spec.batches[0]["mask"].shape[1]), jnp.float32)
        logits = jax.jit(forward)(step.params, jnp.asarray(spec.x_test), ones)
        pred = np.asarray(jnp.argmax(logits.astype(jnp.float32), axis=1))
    stats = device.memory_stats() if platform == "gpu" else None
    return {
        "framework": "jax",
        "version": backend.framework_version(),
        "device": str(device),
        **out,
        "test_accuracy": float((pred == spec.y_test).mean()),
        "peak_memory_bytes": None if not stats else int(stats.get("peak_bytes_in_use", 0)) or None,
    }
