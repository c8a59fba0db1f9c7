"""A dtype trace in Keras (TensorFlow): which ops of one train step ran in which dtype, per layer.

`mp.trace(step, batch)` reads the graph of the step's `tf.function` (nothing runs): Keras's
name scopes give the layers, `gradient_tape/` the backward pass. Records use one op vocabulary
in every framework (`unimp.trace.OPS`); `unimp trace RECIPE` does the same from the command line.

    python examples/guides/trace_tensorflow.py
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


def main() -> dict:
    keras.utils.set_random_seed(0)
    mp = unimp.mixed_precision("mixed_float16;l2:float32", backend="tensorflow")
    with mp.autocast():                   # layers built here take the recipe's dtype policy
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu", name="l1"),
                                  keras.layers.Dense(4, name="l2")])
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model, opt = mp.prepare(model, keras.optimizers.SGD(0.1))
    step = mp.train_step(model, opt, lambda m, b: ce(b[1], m(b[0], training=True)))

    rng = np.random.default_rng(0)
    trace = mp.trace(step, (rng.normal(size=(16, 8)).astype("float32"), rng.integers(0, 4, 16)))
    print(trace)
    matmuls = {}
    for r in trace.select(op="matmul"):
        matmuls.setdefault((r.layer, r.phase), set()).add(r.compute)
        print(f"  {r.phase:8} {r.layer or '-':4} {r.native:18} computes in {r.compute}")
    print(f"casts: {len(trace.casts())}; by layer: {trace.summary()['by_layer']}")
    return {"trace": trace, "matmuls": matmuls}


if __name__ == "__main__":
    main()
