"""One training script, three frameworks: the recipe, the loss-scale rule, the train step and its
StepResult are the same in each; only the model definition is written per framework.

    python examples/port_any_backend.py --backend torch
    python examples/port_any_backend.py --backend tensorflow --recipe mixed_bfloat16
    python examples/port_any_backend.py --backend jax --steps 50

Porting a script between frameworks means rewriting `build_*` below and nothing else.
"""

from __future__ import annotations

import argparse

import numpy as np

import unimp


def build_torch(mp, w):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    with torch.no_grad():
        for layer, (k, b) in zip((model[0], model[2]), (("w1", "b1"), ("w2", "b2")), strict=True):
            layer.weight.copy_(torch.from_numpy(w[k].T.copy()))
            layer.bias.copy_(torch.from_numpy(w[b]))
    model, opt = mp.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))

    def loss_fn(model, batch):
        logits = model(batch["x"])
        return torch.nn.functional.cross_entropy(logits.float(), batch["y"].long())

    step = mp.train_step(model, opt, loss_fn)
    return lambda b: step({k: torch.from_numpy(v) for k, v in b.items()})


def build_tensorflow(mp, w):
    import keras
    import tensorflow as tf

    with mp.autocast():  # layers built here use the recipe's dtype policy
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)]
        )
    model.layers[0].set_weights([w["w1"], w["b1"]])
    model.layers[1].set_weights([w["w2"], w["b2"]])
    model, opt = mp.prepare(model, keras.optimizers.Adam(1e-3))

    def loss_fn(model, batch):
        logits = tf.cast(model(batch["x"]), tf.float32)
        return tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=batch["y"], logits=logits)
        )

    return mp.train_step(model, opt, loss_fn)


def build_jax(mp, w):
    import jax
    import jax.numpy as jnp
    import optax

    def loss_fn(params, batch):
        p, x = mp.cast_to_compute(params), mp.cast_to_compute(batch["x"])
        logits = mp.cast_to_output(jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["y"]
        ).mean()

    return mp.train_step(loss_fn, optax.adam(1e-3), {k: jnp.asarray(v) for k, v in w.items()})


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--backend", required=True, choices=["torch", "tensorflow", "jax"])
    parser.add_argument("--recipe", default="mixed_float16")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)

    # the same data and initial weights whatever the framework
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 64)).astype(np.float32)
    y = (x[:, :10].argmax(1)).astype(np.int32)  # a learnable rule
    w = {
        "w1": (rng.normal(size=(64, 128)) * 0.1).astype(np.float32),
        "b1": np.zeros(128, np.float32),
        "w2": (rng.normal(size=(128, 10)) * 0.1).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }

    mp = unimp.mixed_precision(args.recipe, backend=args.backend)
    step = {"torch": build_torch, "tensorflow": build_tensorflow, "jax": build_jax}[args.backend](
        mp, w
    )
    losses = []
    for i in range(args.steps):
        idx = rng.integers(0, len(x), 64)
        result = step({"x": x[idx], "y": y[idx]})  # no host sync here...
        losses.append(result.loss)  # ...reading a field may sync
        if i % 25 == 0 or i == args.steps - 1:
            print(
                f"{args.backend} step {i:3d}: loss {result.loss:.4f}  scale {result.scale:g}  applied {result.applied}"
            )
    print(
        f"{args.backend}: {args.recipe}, {result.total_skips} skipped steps, final loss {losses[-1]:.4f}"
    )
    return losses


if __name__ == "__main__":
    main()
