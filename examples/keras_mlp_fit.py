"""The seeds' Keras MLP trained with model.fit under mixed_float16, through unimp.

    Dense(512, relu, input 784) -> Dropout(0.2) -> Dense(10, softmax)

compiled with adam + sparse_categorical_crossentropy and trained with fit on small random
data (MNIST-shaped), in well under 30 s on a CPU.

What unimp does here, compared with `keras.mixed_precision.set_global_policy("mixed_float16")`:

* `mp.autocast()` sets the global dtype policy only while the model is built and restores the
  previous one afterwards (also on an exception), so nothing leaks into later code.
* The output layer says `dtype=mp.output_dtype_policy`: the softmax runs in float32, as the
  Keras mixed-precision guide advises (a float16 softmax is a known source of NaN and poor
  accuracy). This is the model's choice, written in the model: `mp.prepare` itself only casts
  the model's outputs to the output dtype, as unimp does in torch and JAX, so the same recipe
  is the same computation in every framework.
* The optimizer is wrapped in unimp's LossScaleOptimizer (not Keras's), so `fit` follows the
  same loss-scale rule as unimp's PyTorch and JAX backends.

Run:
    KERAS_BACKEND=tensorflow python examples/keras_mlp_fit.py
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _arguments():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


# the arguments before TensorFlow is imported (about 10 s): --help and a bad option answer at once
ARGS = _arguments() if __name__ == "__main__" else None

import keras  # noqa: E402
import numpy as np  # noqa: E402

import unimp  # noqa: E402


def main(samples: int = 2048, epochs: int = 2, batch_size: int = 128, seed: int = 0) -> dict:
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    x = rng.random((samples, 784), dtype=np.float32)
    y = rng.integers(0, 10, samples)  # integer labels: never cast

    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    with mp.autocast():
        model = keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dropout(0.2),
                keras.layers.Dense(10, activation="softmax", dtype=mp.output_dtype_policy),
            ]
        )
    model, optimizer = mp.prepare(
        model, "adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"]
    )

    start = time.perf_counter()
    history = model.fit(x, y, epochs=epochs, batch_size=batch_size, verbose=0)
    seconds = time.perf_counter() - start
    probs = model.predict(x[:8], verbose=0)

    print(f"recipe      : {mp.recipe.describe()}")
    print(f"optimizer   : {type(optimizer).__module__}.{type(optimizer).__name__}")
    print(
        "layer dtypes: "
        + ", ".join(f"{layer.name}={layer.dtype_policy.name}" for layer in model.layers)
    )
    print(f"output dtype: {probs.dtype}")
    print(f"losses      : {[round(v, 4) for v in history.history['loss']]}")
    print(
        f"loss scale  : {float(optimizer.dynamic_scale.numpy()):g} "
        f"(skipped steps: {int(optimizer.total_skips.numpy())})"
    )
    print(f"fit time    : {seconds:.1f} s")
    return {"history": history.history, "output_dtype": probs.dtype, "optimizer": optimizer}


if __name__ == "__main__":
    main(ARGS.samples, ARGS.epochs, ARGS.batch_size, ARGS.seed)
