"""Matmul precision in Keras (TensorFlow): the policy's `matmul_precision` is set for the train step only.

`"mixed_bfloat16,matmul=highest"` turns TensorFlow's TF32 switch
(`tf.config.experimental.enable_tensor_float_32_execution`, on by default) off around each call
of the step and inside `mp.autocast()`, and puts the previous value back. On a CPU every
setting computes full float32.

    python examples/guides/precision_tensorflow.py
"""

from __future__ import annotations

import argparse

if __name__ == "__main__":  # --help answers before TensorFlow is imported (seconds)
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

import os  # noqa: E402

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import unimp  # noqa: E402
from unimp.backends.tensorflow import current_matmul_precision  # noqa: E402


def main() -> dict:
    keras.utils.set_random_seed(0)
    mp = unimp.mixed_precision("mixed_bfloat16,matmul=highest", backend="tensorflow")
    print(f"policy: {mp.policy}  (matmul_precision={mp.policy.matmul_precision!r})")
    with mp.autocast():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model, opt = mp.prepare(model, keras.optimizers.SGD(0.1))

    seen = {"before": current_matmul_precision()}
    with mp.autocast():                   # the same setting as inside the step
        seen["in autocast"] = current_matmul_precision()

    def loss_fn(m, batch):                # runs while the step's tf.function traces (in the call)
        seen["in the step"] = current_matmul_precision()
        return keras.ops.mean(keras.ops.square(m(batch)))

    step = mp.train_step(model, opt, loss_fn)
    step(np.ones((16, 8), "float32"))
    seen["after a step"] = current_matmul_precision()
    for when, setting in seen.items():
        print(f"{when:>12}: {setting}")
    return seen


if __name__ == "__main__":
    main()
