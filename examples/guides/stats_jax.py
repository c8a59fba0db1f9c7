"""Tensor statistics in JAX: `train_step(..., stats_every=k)` on steps 0, k, 2k, ...

Per parameter gradient (unscaled, named by its pytree path joined with `/`: `l1/w`) and per
layer output that `loss_fn` names with `unimp.backends.jax.observe` (flax linen modules are
observed by path): the largest magnitude, and for float16 and bfloat16 the share that would
overflow or flush to zero and the headroom in bits. A second jitted step takes them; the
other steps run the program they ran without the option.

    python examples/guides/stats_jax.py
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
from unimp.backends.jax import observe  # noqa: E402


def dense(rng, n_in: int, n_out: int) -> dict:
    return {"w": jnp.asarray(rng.normal(size=(n_in, n_out)) / np.sqrt(n_in), jnp.float32),
            "b": jnp.zeros(n_out, jnp.float32)}


def batch(rng) -> tuple:
    return rng.normal(size=(16, 8)).astype(np.float32), rng.integers(0, 4, 16).astype(np.int32)


def main() -> dict:
    rng = np.random.default_rng(0)
    mp = unimp.mixed_precision("mixed_float16", backend="jax")

    def loss_fn(params, batch):
        x, y = batch
        p, x = mp.cast_to_compute(params), mp.cast_to_compute(x)
        h = observe("l1", jax.nn.relu(x @ p["l1"]["w"] + p["l1"]["b"]))
        logits = observe("l2", h @ p["l2"]["w"] + p["l2"]["b"])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

    params = {"l1": dense(rng, 8, 32), "l2": dense(rng, 32, 4)}
    step = mp.train_step(loss_fn, optax.adam(1e-3), params, stats_every=2)
    taken, stats = [], None
    for i in range(4):
        r = step(batch(rng))
        if r.stats is not None:           # steps 0 and 2 (None on the others)
            stats = r.stats
            g, a = stats.gradients["l1/w"], stats.activations["l1"]
            print(f"step {i}: l1/w grad amax {g.amax:.3g}, float16 headroom "
                  f"{g.headroom('float16'):.1f} bits, flushed {g.fraction('float16_flush'):.1%}; "
                  f"l1 output amax {a.amax:.3g}")
            taken.append(i)
    print(f"statistics steps: {taken}; gradients {sorted(stats.gradients)}, "
          f"layer outputs {sorted(stats.activations)}")
    return {"steps": taken, "stats": stats}


if __name__ == "__main__":
    main()
