"""Per-layer overrides in JAX: the output layer `l2` kept in float32 under mixed_float16.

The recipe string's `;l2:float32` clause is the override. JAX has no model object: the step
casts the parameters per pytree path (`l2.w` is covered by `l2`), and `loss_fn` casts each
layer's input with `mp.cast_to_compute(h, path=layer)`, so `l1` computes in float16 and `l2`
in float32. (flax modules take `nn.Dense(..., **mp.module_kwargs("l2"))` instead.)

    python examples/guides/overrides_jax.py
"""

from __future__ import annotations

import argparse

if __name__ == "__main__":  # --help answers before JAX is imported
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import unimp  # noqa: E402


def dense(rng, n_in: int, n_out: int) -> dict:
    return {"w": jnp.asarray(rng.normal(size=(n_in, n_out)) / np.sqrt(n_in), jnp.float32),
            "b": jnp.zeros(n_out, jnp.float32)}


def batch(rng) -> tuple:
    return rng.normal(size=(16, 8)).astype(np.float32), rng.integers(0, 4, 16).astype(np.int32)


def main() -> dict:
    rng = np.random.default_rng(0)
    mp = unimp.mixed_precision("mixed_float16;l2:float32", backend="jax")
    print(mp.policy)                      # the override is part of the policy: str() parses back
    seen = {}                             # each layer's output dtype, read while the step traces

    def loss_fn(params, batch):
        x, y = batch
        p = mp.cast_to_compute(params)    # per path: l1's float16, l2's float32
        h = jax.nn.relu(mp.cast_to_compute(x, path="l1") @ p["l1"]["w"] + p["l1"]["b"])
        seen["l1"] = str(h.dtype)
        logits = mp.cast_to_compute(h, path="l2") @ p["l2"]["w"] + p["l2"]["b"]
        seen["l2"] = str(logits.dtype)
        logits = mp.cast_to_output(logits).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    params = {"l1": dense(rng, 8, 32), "l2": dense(rng, 32, 4)}
    step = mp.train_step(loss_fn, optax.sgd(0.1), params)
    result = step(batch(rng))
    print(f"l1 outputs {seen['l1']}, l2 outputs {seen['l2']}; loss {float(result.loss):.4f}")
    return seen


if __name__ == "__main__":
    main()
