"""Tensor statistics in Keras (TensorFlow): `train_step(..., stats_every=k)` on steps 0, k, 2k, ...

Per variable gradient (unscaled, named by `variable.path` from the model down: `l1/kernel`)
and per leaf layer output: the largest magnitude, and for float16 and bfloat16 the share that
would overflow or flush to zero and the headroom in bits. A second `tf.function` takes them;
the other steps run the graph they ran without the option.

    python examples/guides/stats_tensorflow.py
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
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    with mp.autocast():                   # layers built here take the recipe's dtype policy
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu", name="l1"),
                                  keras.layers.Dense(4, name="l2")])
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model, opt = mp.prepare(model, keras.optimizers.Adam(1e-3))
    step = mp.train_step(model, opt, lambda m, b: ce(b[1], m(b[0], training=True)), stats_every=2)
    rng = np.random.default_rng(0)
    taken, stats = [], None
    for i in range(4):
        r = step((rng.normal(size=(16, 8)).astype("float32"), rng.integers(0, 4, 16)))
        if r.stats is not None:           # steps 0 and 2 (None on the others)
            stats = r.stats
            g, a = stats.gradients["l1/kernel"], stats.activations["l1"]
            print(f"step {i}: l1/kernel grad amax {g.amax:.3g}, float16 headroom "
                  f"{g.headroom('float16'):.1f} bits, flushed {g.fraction('float16_flush'):.1%}; "
                  f"l1 output amax {a.amax:.3g}")
            taken.append(i)
    print(f"statistics steps: {taken}; gradients {sorted(stats.gradients)}, "
          f"layer outputs {sorted(stats.activations)}")
    return {"steps": taken, "stats": stats}


if __name__ == "__main__":
    main()
