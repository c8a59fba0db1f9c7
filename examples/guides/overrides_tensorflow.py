"""Per-layer overrides in Keras (TensorFlow): the output layer `l2` kept in float32 under mixed_float16.

The recipe string's `;l2:float32` clause is the override; `mp.prepare` gives `l2` a float32
`keras.DTypePolicy` (its variables stay float32, as the model's), while `l1` computes in
float16. `unimp.backends.tensorflow.dtype_policy_map(mp, model)` gives the same as a
`DTypePolicyMap`.

    python examples/guides/overrides_tensorflow.py
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
    print(mp.policy)                      # the override is part of the policy: str() parses back
    with mp.autocast():                   # layers built here take the recipe's dtype policy
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu", name="l1"),
                                  keras.layers.Dense(4, name="l2")])
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model, opt = mp.prepare(model, keras.optimizers.SGD(0.1))
    policies = {layer.name: layer.dtype_policy.name for layer in model.layers}
    print(f"layer policies: {policies}")  # l1 mixed_float16, l2 float32

    step = mp.train_step(model, opt, lambda m, b: ce(b[1], m(b[0], training=True)))
    rng = np.random.default_rng(0)
    result = step((rng.normal(size=(16, 8)).astype("float32"), rng.integers(0, 4, 16)))
    print(f"loss {float(result.loss):.4f}, scale {float(result.scale):g}")
    return policies


if __name__ == "__main__":
    main()
