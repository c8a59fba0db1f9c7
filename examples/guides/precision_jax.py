"""Matmul precision in JAX: the policy's `matmul_precision` is set while the train step traces.

`"mixed_bfloat16,matmul=high"` sets `jax.default_matmul_precision("tensorfloat32")` for the
step: JAX reads it at trace time and it is part of `jax.jit`'s cache key, so the step is
compiled under it (once). `mp.autocast()` sets it for your own code. On a CPU every setting
computes full float32.

    python examples/guides/precision_jax.py
"""

from __future__ import annotations

import argparse

if __name__ == "__main__":  # --help answers before JAX is imported
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import unimp  # noqa: E402
from unimp.backends.jax import current_matmul_precision  # noqa: E402


def main() -> dict:
    mp = unimp.mixed_precision("mixed_bfloat16,matmul=high", backend="jax")
    print(f"policy: {mp.policy}  (matmul_precision={mp.policy.matmul_precision!r})")
    seen = {"before": current_matmul_precision()}
    with mp.autocast():
        seen["in autocast"] = current_matmul_precision()

    def loss_fn(params, x):
        seen["in the step"] = current_matmul_precision()  # read while the step traces
        return jnp.mean(jnp.square(mp.cast_to_compute(x) @ mp.cast_to_compute(params["w"])))

    step = mp.train_step(loss_fn, optax.sgd(0.1), {"w": jnp.ones((8, 4), jnp.float32)})
    step(np.ones((16, 8), np.float32))
    seen["after a step"] = current_matmul_precision()
    for when, setting in seen.items():
        print(f"{when:>12}: {setting}")
    return seen


if __name__ == "__main__":
    main()
