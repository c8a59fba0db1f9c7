"""A tf.keras 2 custom training loop (the official mixed-precision guide's) on Keras 3.

Keras 3 removed `get_scaled_loss` and `get_unscaled_gradients` from its LossScaleOptimizer,
which broke the guide's custom loop and the scripts ported from it. The loop below is the
tf.keras 2 code unchanged; only the import of `LossScaleOptimizer` differs:

    # tf.keras 2:  from tensorflow.keras import mixed_precision
    #              optimizer = mixed_precision.LossScaleOptimizer(optimizer)
    from unimp.backends.tensorflow import LossScaleOptimizer

`get_unscaled_gradients` returns gradients that `apply_gradients` recognises and does not
divide a second time, so the update is the same as in tf.keras 2.

Run:
    KERAS_BACKEND=tensorflow python examples/tf_keras2_custom_loop.py
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _arguments():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


# the arguments before TensorFlow is imported (about 10 s): --help and a bad option answer at once
ARGS = _arguments() if __name__ == "__main__" else None

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import unimp  # noqa: E402
from unimp.backends.tensorflow import LossScaleOptimizer  # the only changed line  # noqa: E402


def main(samples: int = 1024, epochs: int = 2, batch_size: int = 128, seed: int = 0) -> dict:
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    x_train = rng.random((samples, 784), dtype=np.float32)
    y_train = rng.integers(0, 10, samples)

    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    with mp.autocast():  # the guide: mixed_precision.set_global_policy('mixed_float16')
        inputs = keras.Input(shape=(784,), name="digits")
        x = keras.layers.Dense(512, activation="relu", name="dense_1")(inputs)
        x = keras.layers.Dense(512, activation="relu", name="dense_2")(x)
        x = keras.layers.Dense(10, name="dense_logits")(x)
        outputs = keras.layers.Activation("softmax", dtype="float32", name="predictions")(x)
        model = keras.Model(inputs=inputs, outputs=outputs)

    # ---- from here on: the tf.keras 2 guide's custom training loop, unchanged ----
    optimizer = keras.optimizers.RMSprop()
    optimizer = LossScaleOptimizer(optimizer)
    loss_object = keras.losses.SparseCategoricalCrossentropy()
    train_dataset = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(10000).batch(batch_size)
    )

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            predictions = model(x)
            loss = loss_object(y, predictions)
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_gradients = tape.gradient(scaled_loss, model.trainable_variables)
        gradients = optimizer.get_unscaled_gradients(scaled_gradients)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))  # noqa: B905
        return loss

    losses = []
    for epoch in range(epochs):
        epoch_loss_avg = keras.metrics.Mean()
        for x, y in train_dataset:
            loss = train_step(x, y)
            epoch_loss_avg(loss)
        losses.append(float(epoch_loss_avg.result()))
        print(f"Epoch {epoch}: loss={losses[-1]:.4f}")
    # ---- end of the unchanged loop ----

    print(
        f"loss scale {float(optimizer.loss_scale):g}, optimizer steps {int(optimizer.iterations.numpy())}, "
        f"skipped {int(optimizer.total_skips.numpy())}"
    )
    return {"losses": losses, "optimizer": optimizer, "model": model}


if __name__ == "__main__":
    main(ARGS.samples, ARGS.epochs, ARGS.batch_size, ARGS.seed)
