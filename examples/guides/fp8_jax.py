"""FP8 in JAX: the `fp8-delayed` recipe puts an emulated float8 matmul into the middle layer.

JAX has no model object to walk, so the layers are declared: `mp.fp8_layers([...])` (dotted
paths in model order) selects them (the first and the last stay out by default), `mp.fp8_states()`
gives their scaling states and `mp.fp8_matmul(states, path, x, w)` is `x @ w` in float8 for a
selected layer. The states after a step are their "gradients", carried by the train step as
`model_state`. (flax linen: `nn.Dense(..., **mp.module_kwargs("l2"))`.) Float8 is emulated
unless `UNIMP_FP8_NATIVE=1` on a GPU with float8 units.

    python examples/guides/fp8_jax.py
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
    mp = unimp.mixed_precision("fp8-delayed", backend="jax")
    print(f"recipe: {mp.recipe.describe()}")
    print(f"float8 layers: {mp.fp8_layers(['l1', 'l2', 'l3'])}")  # ('l2',): l1 and l3 stay bfloat16

    def forward(params, x, states):
        p, h = mp.cast_to_compute(params), mp.cast_to_compute(x)
        for name in ("l1", "l2", "l3"):
            w = params[name]["w"] if name == "l2" else p[name]["w"]  # float8 quantizes the float32 w
            h = mp.fp8_matmul(states, name, h, w) + p[name]["b"]
            h = jax.nn.relu(h) if name != "l3" else h
        return h.astype(jnp.float32)

    def loss_fn(params, states, batch):
        x, y = batch

        def loss(p, st):
            return optax.softmax_cross_entropy_with_integer_labels(forward(p, x, st), y).mean()

        # the states after the step are the gradients with respect to the states
        new_states = jax.grad(loss, argnums=1)(jax.lax.stop_gradient(params), states)
        return loss(params, states), new_states

    params = {"l1": dense(rng, 8, 32), "l2": dense(rng, 32, 32), "l3": dense(rng, 32, 4)}
    step = mp.train_step(loss_fn, optax.adam(1e-3), params, model_state=mp.fp8_states())
    for i in range(3):
        r = step(batch(rng))
        states = step.model_state["l2"]                     # (input, kernel, grad) FP8States
        scales = {t: float(s.scale) for t, s in zip(("input", "kernel", "grad"), states, strict=True)}
        print(f"step {i}: loss {float(r.loss):.4f}, l2's float8 scales {scales}")
    return {"layers": mp.fp8_layers(["l1", "l2", "l3"]), "scales": scales}


if __name__ == "__main__":
    main()
