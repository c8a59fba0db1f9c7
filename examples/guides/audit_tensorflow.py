"""A range audit in Keras (TensorFlow): float32 steps with statistics, read as "what would float16 do".

This is what `unimp audit --to float16` runs: a float32 recipe with a static loss scale equal to
float16's initial scale (2**15), statistics on every step, then `audit_stats` names each layer
whose outputs or gradients would overflow or flush to zero, with the fix. The kernel of `l1` is
multiplied by 1e5 (as `--plant l1=1e5` does), so the audit finds an overflow starting at `l1`.

    python examples/guides/audit_tensorflow.py
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
from unimp.compare.audit import audit_stats, initial_scale  # noqa: E402


def main() -> list:
    keras.utils.set_random_seed(0)
    scale = initial_scale("float16")      # 32768.0
    mp = unimp.mixed_precision("float32", loss_scale=f"static:{scale:g}", backend="tensorflow")
    with mp.autocast():                   # layers built here take the recipe's dtype policy
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu", name="l1"),
                                  keras.layers.Dense(4, name="l2")])
    l1 = model.get_layer("l1")
    l1.kernel.assign(l1.kernel * 1e5)     # the planted fault
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model, opt = mp.prepare(model, keras.optimizers.SGD(0.0))
    step = mp.train_step(model, opt, lambda m, b: ce(b[1], m(b[0], training=True)), stats_every=1)
    rng = np.random.default_rng(0)
    steps = [step((rng.normal(size=(16, 8)).astype("float32"), rng.integers(0, 4, 16))).stats
             for _ in range(3)]

    findings = audit_stats(steps, "float16")
    for f in findings:
        print(f"{f.kind:20} {f.layer:4} step {f.step}: {f.fraction:.0%} of {f.tensor}; fix: {f.fix}")
    return findings


if __name__ == "__main__":
    main()
