"""A step log and `unimp doctor` in JAX: the run's records, then what went wrong.

`train_step(..., log=path)` writes one JSON Lines record per step (format `unimp.steplog/1`),
kept on the device and written every `log_every` steps and at `step.close()`. The batch of
step 5 holds a NaN; `unimp.doctor.diagnose` (what `unimp doctor run.jsonl` prints) names it.

    python examples/guides/steplog_jax.py
"""

from __future__ import annotations

import argparse

if __name__ == "__main__":  # --help answers before JAX is imported
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

import os  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import unimp  # noqa: E402
from unimp.doctor import diagnose  # noqa: E402
from unimp.steplog import read_steplog  # noqa: E402


def dense(rng, n_in: int, n_out: int) -> dict:
    return {"w": jnp.asarray(rng.normal(size=(n_in, n_out)) / np.sqrt(n_in), jnp.float32),
            "b": jnp.zeros(n_out, jnp.float32)}


def main(log: str | None = None) -> dict:
    log = log or os.path.join(tempfile.mkdtemp(), "run.jsonl")
    rng = np.random.default_rng(0)
    mp = unimp.mixed_precision("mixed_float16", backend="jax")

    def loss_fn(params, batch):
        x, y = batch
        p, x = mp.cast_to_compute(params), mp.cast_to_compute(x)
        logits = jax.nn.relu(x @ p["l1"]["w"] + p["l1"]["b"]) @ p["l2"]["w"] + p["l2"]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

    params = {"l1": dense(rng, 8, 32), "l2": dense(rng, 32, 4)}
    step = mp.train_step(loss_fn, optax.sgd(0.1), params, log=log, log_every=4)
    for i in range(10):
        x = rng.normal(size=(16, 8)).astype(np.float32)
        if i == 5:
            x[0, 0] = np.nan              # bad data at step 5
        step((x, rng.integers(0, 4, 16).astype(np.int32)))
    step.close()                          # writes the last records and the end line

    run = read_steplog(log)
    skipped = [s["step"] for s in run.steps if not s["applied"]]
    print(f"{log}: {len(run.steps)} steps, skipped {skipped}")
    diagnosis = diagnose([run])
    print(diagnosis.render())
    return {"log": run, "diagnosis": diagnosis}


if __name__ == "__main__":
    main()
