"""Mixed precision in JAX with unimp: a flax MLP (linen and nnx) trained with optax.

The model is the classic 784 -> 512 (relu) -> dropout(0.2) -> 10 classifier, run with the
``mixed_float16`` recipe: float32 parameters, float16 compute, float32 outputs, dynamic loss
scaling. It trains a few steps on random data through ``mp.train_step`` (one jitted function
holding params, optimizer state and loss scale) and then shows the optax-only route
(``mp.prepare`` + ``get_loss_scale``) for people who keep their own training loop.

Run:  python examples/jax_flax_optax.py   (a few seconds on a CPU; any JAX device works)
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import unimp
from unimp.backends.jax import get_loss_scale

STEPS, BATCH = 10, 32


class LinenMLP(nn.Module):
    """784 -> 512 relu -> dropout -> 10, with the recipe's dtypes passed explicitly."""

    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        x = nn.relu(nn.Dense(512, **kw)(x))
        x = nn.Dropout(0.2, deterministic=not train)(x)
        return nn.Dense(10, **kw)(x)


class NnxMLP(nnx.Module):
    """The same model in flax nnx."""

    def __init__(self, *, rngs: nnx.Rngs, **kw):
        self.hidden = nnx.Linear(784, 512, rngs=rngs, **kw)
        self.dropout = nnx.Dropout(0.2)
        self.out = nnx.Linear(512, 10, rngs=rngs, **kw)

    def __call__(self, x: jax.Array, key: jax.Array) -> jax.Array:
        return self.out(self.dropout(nnx.relu(self.hidden(x)), rngs=key))


def batches(key: jax.Array, steps: int = STEPS):
    """Random images and labels, plus a dropout key per step."""
    for i in range(steps):
        kx, ky, kd = jax.random.split(jax.random.fold_in(key, i), 3)
        yield {
            "x": jax.random.normal(kx, (BATCH, 784)),
            "y": jax.random.randint(ky, (BATCH,), 0, 10),
            "rng": kd,
        }


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train(name: str, step, steps: int) -> None:
    start = time.perf_counter()
    for batch in batches(jax.random.key(1), steps):
        result = step(batch)  # no host sync here; reading a field below syncs
    print(
        f"{name:6s} loss {result.loss:.4f}  scale {result.scale:g}  applied {result.applied}  "
        f"skips {result.total_skips}  grad_norm {result.grad_norm:.3f}  "
        f"compilations {step.traces}  {time.perf_counter() - start:.1f}s"
    )
    dtypes = {str(p.dtype) for p in jax.tree_util.tree_leaves(step.params)}
    print(f"       params stay {dtypes}; loss-scale state {step.state_dict()['state']}")


def main(steps: int = STEPS) -> None:
    mp = unimp.mixed_precision("mixed_float16", backend="jax")
    print(mp)  # policy params=float32,compute=float16,output=float32; dynamic loss scale

    # --- flax linen -----------------------------------------------------------------------
    model = LinenMLP(**mp.module_kwargs())  # dtype=float16, param_dtype=float32
    params = model.init(jax.random.key(0), jnp.zeros((1, 784)), train=False)["params"]

    seen = {}

    def linen_loss(params, batch):
        logits = model.apply(
            {"params": params}, batch["x"], train=True, rngs={"dropout": batch["rng"]}
        )
        seen["logits"] = logits.dtype  # recorded while tracing: the model computes in float16
        return cross_entropy(mp.cast_to_output(logits), batch["y"])  # the loss in float32

    train("linen", mp.train_step(linen_loss, optax.adam(1e-3), params, max_grad_norm=1.0), steps)
    print(f"       logits computed in {seen['logits']}, returned as {mp.output_dtype}")

    # --- flax nnx -------------------------------------------------------------------------
    nnx_model = NnxMLP(rngs=nnx.Rngs(0), **mp.module_kwargs())
    graphdef, nnx_params, rest = nnx.split(nnx_model, nnx.Param, ...)

    def nnx_loss(params, batch):
        m = nnx.merge(graphdef, params, rest, copy=True)
        return cross_entropy(mp.cast_to_output(m(batch["x"], batch["rng"])), batch["y"])

    train("nnx", mp.train_step(nnx_loss, optax.adam(1e-3), nnx_params, max_grad_norm=1.0), steps)

    # --- your own loop: the loss scale lives in the optax state -----------------------------
    params, optimizer = mp.prepare(params, optax.adam(1e-3))
    opt_state = optimizer.init(params)

    @jax.jit
    def own_step(params, opt_state, batch):
        loss_scale = get_loss_scale(opt_state)

        def scaled_loss(p):
            loss = linen_loss(p, batch)
            return loss_scale.scale(loss), loss

        scaled_grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        updates, opt_state = optimizer.update(scaled_grads, opt_state, params, value=loss)
        return optax.apply_updates(params, updates), opt_state, loss

    for batch in batches(jax.random.key(2), steps):
        params, opt_state, loss = own_step(params, opt_state, batch)
    ls = get_loss_scale(opt_state)
    print(
        f"optax  loss {float(loss):.4f}  scale {float(ls.loss_scale):g}  skips {int(ls.state.total_skips)}"
    )


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    main(args.steps)
