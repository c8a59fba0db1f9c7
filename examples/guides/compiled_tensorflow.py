"""A compiled step in Keras (TensorFlow): `train_step(..., jit_compile=True)` compiles the step with XLA.

The step is always a `tf.function` (traced once per batch signature); `jit_compile=True` has
XLA compile it. Applied and skipped steps run the same graph: the skip is a select on the
device, never a Python branch. Step 3's loss is multiplied by 1e9: its float16 gradients
overflow, the step is skipped and the scale halves, without a retrace.

    python examples/guides/compiled_tensorflow.py
"""

from __future__ import annotations

import argparse

if __name__ == "__main__":  # --help answers before TensorFlow is imported (seconds)
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

import os  # noqa: E402

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

import unimp  # noqa: E402


def main() -> list:
    keras.utils.set_random_seed(0)
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    with mp.autocast():                   # layers built here take the recipe's dtype policy
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu", name="l1"),
                                  keras.layers.Dense(4, name="l2")])
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model, opt = mp.prepare(model, keras.optimizers.SGD(0.1))
    step = mp.train_step(model, opt, lambda m, b: ce(b[1], m(b[0], training=True)) * b[2],
                         jit_compile=True)
    rng = np.random.default_rng(0)
    results = []
    for i in range(6):
        start = time.perf_counter()
        factor = np.float32(1e9 if i == 3 else 1.0)          # an array: no retrace per value
        r = step((rng.normal(size=(16, 8)).astype("float32"), rng.integers(0, 4, 16), factor))
        print(f"step {i}: applied {bool(r.applied)}, scale {float(r.scale):g}, "
              f"{time.perf_counter() - start:.2f} s")
        results.append(r)
    return results


if __name__ == "__main__":
    main()
