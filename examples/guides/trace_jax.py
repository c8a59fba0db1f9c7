"""A dtype trace in JAX: which ops of one train step ran in which dtype, per layer.

`mp.trace(step, batch)` reads the step's jaxpr (nothing runs or compiles): `jax.named_scope`
(and flax modules) give the layers, the equations' name stacks the phase. Records use one op
vocabulary in every framework (`unimp.trace.OPS`); `unimp trace RECIPE` does the same from the
command line.

    python examples/guides/trace_jax.py
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

    def loss_fn(params, batch):
        x, y = batch
        p = mp.cast_to_compute(params)
        with jax.named_scope("l1"):
            h = jax.nn.relu(mp.cast_to_compute(x, path="l1") @ p["l1"]["w"] + p["l1"]["b"])
        with jax.named_scope("l2"):
            logits = mp.cast_to_compute(h, path="l2") @ p["l2"]["w"] + p["l2"]["b"]
        logits = mp.cast_to_output(logits).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    params = {"l1": dense(rng, 8, 32), "l2": dense(rng, 32, 4)}
    step = mp.train_step(loss_fn, optax.sgd(0.1), params)
    trace = mp.trace(step, batch(rng))
    print(trace)
    matmuls = {}
    for r in trace.select(op="matmul"):
        matmuls.setdefault((r.layer, r.phase), set()).add(r.compute)
        print(f"  {r.phase:8} {r.layer or '-':4} {r.native:18} computes in {r.compute}")
    print(f"casts: {len(trace.casts())}; by layer: {trace.summary()['by_layer']}")
    return {"trace": trace, "matmuls": matmuls}


if __name__ == "__main__":
    main()
