"""Seed 004's TensorFlow snippet as written, with one line changed: TensorFlow 2.1-2.3's
experimental mixed-precision API on Keras 3, through unimp.

    policy = tf.keras.mixed_precision.experimental.Policy('mixed_float16')
    tf.keras.mixed_precision.experimental.set_policy(policy)
    model = tf.keras.Sequential([...])
    model.compile(optimizer='adam', loss='sparse_categorical_crossentropy', metrics=['accuracy'])

With `import tensorflow as tf` this fails on TensorFlow 2.21 / Keras 3 (`module
'keras.mixed_precision' has no attribute 'experimental'`). The one changed line imports `tf` from
`unimp.compat.tf_experimental`: the policy is Keras's mixed_float16, and `compile` wraps the
optimizer in unimp's LossScaleOptimizer with TensorFlow 2.x's dynamic loss scale, as the old
`compile` did. The seed's model is trained with `fit` on small random data (MNIST-shaped).

Run:
    python examples/tf_experimental_policy.py
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
    return parser.parse_args()


# the arguments before TensorFlow is imported (about 10 s): --help and a bad option answer at once
ARGS = _arguments() if __name__ == "__main__" else None

import numpy as np  # noqa: E402

from unimp.compat.tf_experimental import tf  # noqa: E402  (was: import tensorflow as tf)


def main(samples: int = 1024, epochs: int = 2) -> None:
    tf.keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.random((samples, 784), dtype=np.float32)
    y = rng.integers(0, 10, samples)

    # --- seed 004, as written ---
    policy = tf.keras.mixed_precision.experimental.Policy('mixed_float16')
    tf.keras.mixed_precision.experimental.set_policy(policy)

    model = tf.keras.Sequential([
        tf.keras.Input((784,)),
        tf.keras.layers.Dense(512, activation='relu'),
        tf.keras.layers.Dropout(0.2),
        tf.keras.layers.Dense(10, activation='softmax'),
    ])
    model.compile(optimizer='adam', loss='sparse_categorical_crossentropy', metrics=['accuracy'])
    # --- end of the seed's code ---

    history = model.fit(x, y, epochs=epochs, batch_size=128, verbose=0)
    opt = model.optimizer
    print(f"policy      : {tf.keras.mixed_precision.experimental.global_policy().name}")
    print(f"dtypes      : variables {model.layers[0].kernel.dtype}, compute {model.layers[0].compute_dtype}")
    print(f"optimizer   : {type(opt).__module__}.{type(opt).__name__} around {type(opt.inner_optimizer).__name__}")
    print(f"loss scale  : {float(opt.loss_scale):g} ({opt.loss_scale_config.kind}, TensorFlow 2.x's rule)")
    print(f"final loss  : {history.history['loss'][-1]:.4f}")


if __name__ == "__main__":
    main(ARGS.samples, ARGS.epochs)
