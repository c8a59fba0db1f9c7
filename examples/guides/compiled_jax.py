"""A compiled step in JAX: `mp.train_step` is always one `jax.jit` program, compiled once.

The forward and backward, the unscale, the finite check, the update and the loss-scale rule are
one compiled function; applied and skipped steps run it alike (the skip is a select, never a
Python branch), so it compiles once (`step.traces`). Step 3's loss is multiplied by 1e9: its
float16 gradients overflow, the step is skipped and the scale halves, without recompiling.
Pass `donate=True` on a GPU or TPU to update the parameters in place.

    python examples/guides/compiled_jax.py
"""

from __future__ import annotations

import argparse

if __name__ == "__main__":  # --help answers before JAX is imported
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import unimp  # noqa: E402


def dense(rng, n_in: int, n_out: int) -> dict:
    return {"w": jnp.asarray(rng.normal(size=(n_in, n_out)) / np.sqrt(n_in), jnp.float32),
            "b": jnp.zeros(n_out, jnp.float32)}


def main() -> list:
    rng = np.random.default_rng(0)
    mp = unimp.mixed_precision("mixed_float16", backend="jax")

    def loss_fn(params, batch):
        x, y, factor = batch
        p, x = mp.cast_to_compute(params), mp.cast_to_compute(x)
        logits = jax.nn.relu(x @ p["l1"]["w"] + p["l1"]["b"]) @ p["l2"]["w"] + p["l2"]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean() * factor

    params = {"l1": dense(rng, 8, 32), "l2": dense(rng, 32, 4)}
    step = mp.train_step(loss_fn, optax.sgd(0.1), params)
    results = []
    for i in range(6):
        start = time.perf_counter()
        factor = np.float32(1e9 if i == 3 else 1.0)          # an array: no recompilation per value
        r = step((rng.normal(size=(16, 8)).astype(np.float32), rng.integers(0, 4, 16).astype(np.int32), factor))
        print(f"step {i}: applied {bool(r.applied)}, scale {float(r.scale):g}, "
              f"{time.perf_counter() - start:.3f} s, compilations {step.traces}")
        results.append(r)
    return results


if __name__ == "__main__":
    main()
