"""A range audit in JAX: float32 steps with statistics, read as "what would float16 do".

This is what `unimp audit --to float16` runs: a float32 recipe with a static loss scale equal to
float16's initial scale (2**15), statistics on every step, then `audit_stats` names each layer
whose outputs or gradients would overflow or flush to zero, with the fix. The weights of `l1`
are multiplied by 1e5 (as `--plant l1=1e5` does), so the audit finds an overflow starting at `l1`.

    python examples/guides/audit_jax.py
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
from unimp.compare.audit import audit_stats, initial_scale  # noqa: E402


def dense(rng, n_in: int, n_out: int) -> dict:
    return {"w": jnp.asarray(rng.normal(size=(n_in, n_out)) / np.sqrt(n_in), jnp.float32),
            "b": jnp.zeros(n_out, jnp.float32)}


def batch(rng) -> tuple:
    return rng.normal(size=(16, 8)).astype(np.float32), rng.integers(0, 4, 16).astype(np.int32)


def main() -> list:
    rng = np.random.default_rng(0)
    scale = initial_scale("float16")      # 32768.0
    mp = unimp.mixed_precision("float32", loss_scale=f"static:{scale:g}", backend="jax")

    def loss_fn(params, batch):
        x, y = batch
        h = observe("l1", jax.nn.relu(x @ params["l1"]["w"] + params["l1"]["b"]))
        logits = observe("l2", h @ params["l2"]["w"] + params["l2"]["b"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    params = {"l1": dense(rng, 8, 32), "l2": dense(rng, 32, 4)}
    params["l1"]["w"] = params["l1"]["w"] * 1e5          # the planted fault
    step = mp.train_step(loss_fn, optax.sgd(0.0), params, stats_every=1)
    steps = [step(batch(rng)).stats for _ in range(3)]

    findings = audit_stats(steps, "float16")
    for f in findings:
        print(f"{f.kind:20} {f.layer:4} step {f.step}: {f.fraction:.0%} of {f.tensor}; fix: {f.fix}")
    return findings


if __name__ == "__main__":
    main()
