"""One Keras script under mixed_float16 on any Keras backend: KERAS_BACKEND=tensorflow, jax or
torch, the same unimp calls, the same loss-scale rule.

    mp = unimp.mixed_precision("mixed_float16;head:float32", backend="keras")

`backend="keras"` is Keras on the engine this process runs (TensorFlow: unimp's tensorflow
backend; JAX or torch: unimp.keras). The model is built under `mp.autocast()`, `mp.prepare`
applies the per-layer override (the `head` layer computes in float32) and casts the outputs,
and `mp.train_step` is a custom loop's step: the scaled loss, the engine's own backward,
unscale, clipping, the guarded update and the loss-scale rule, with two micro-batches per
step. Batch 5's loss is multiplied by 3e4, which overflows the float16 backward: that step is
skipped and the loss scale halved, on every engine alike.

Run:
    KERAS_BACKEND=jax python examples/keras_any_backend.py
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(steps: int = 12) -> float:
    import keras
    import numpy as np

    import unimp

    mp = unimp.mixed_precision("mixed_float16;head:float32", backend="keras")
    keras.utils.set_random_seed(0)
    with mp.autocast():
        model = keras.Sequential(
            [
                keras.Input((20,)),
                keras.layers.Dense(64, activation="relu", name="fc1"),
                keras.layers.BatchNormalization(name="bn"),
                keras.layers.Dense(3, name="head"),
            ]
        )
    mp.prepare(model)
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss_fn(model, batch):
        x, y, weight = batch
        return ce(y, model(x, training=True)) * weight

    step = mp.train_step(model, keras.optimizers.Adam(1e-3), loss_fn, grad_accum_steps=2, max_grad_norm=1.0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * 64, 20)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)
    print(f"Keras {keras.__version__} on {keras.backend.backend()}: {type(mp).__module__}")
    loss = float("nan")
    for i in range(steps):
        weight = np.float32(3e4 if i == 5 else 1.0)
        micro = [(x[j : j + 32], y[j : j + 32], weight) for j in (64 * i, 64 * i + 32)]
        r = step(micro)
        print(f"step {i:2d}  loss {r.loss:9.4f}  scale {r.scale:8.0f}  applied {r.applied}")
        if r.applied:
            loss = r.loss
    print(f"final loss {loss:.4f}, skipped steps {r.total_skips}")
    return loss


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    main(parser.parse_args().steps)
