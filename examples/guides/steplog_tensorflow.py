"""A step log and `unimp doctor` in Keras (TensorFlow): the run's records, then what went wrong.

`train_step(..., log=path)` writes one JSON Lines record per step (format `unimp.steplog/1`),
kept on the device and written every `log_every` steps and at `step.close()`. The batch of
step 5 holds a NaN; `unimp.doctor.diagnose` (what `unimp doctor run.jsonl` prints) names it.

    python examples/guides/steplog_tensorflow.py
"""

from __future__ import annotations

import argparse

if __name__ == "__main__":  # --help answers before TensorFlow is imported (seconds)
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

import os  # noqa: E402

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tempfile  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

import unimp  # noqa: E402
from unimp.doctor import diagnose  # noqa: E402
from unimp.steplog import read_steplog  # noqa: E402


def main(log: str | None = None) -> dict:
    log = log or os.path.join(tempfile.mkdtemp(), "run.jsonl")
    keras.utils.set_random_seed(0)
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    with mp.autocast():                   # layers built here take the recipe's dtype policy
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu", name="l1"),
                                  keras.layers.Dense(4, name="l2")])
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model, opt = mp.prepare(model, keras.optimizers.SGD(0.1))
    step = mp.train_step(model, opt, lambda m, b: ce(b[1], m(b[0], training=True)),
                         log=log, log_every=4)
    rng = np.random.default_rng(0)
    for i in range(10):
        x = rng.normal(size=(16, 8)).astype("float32")
        if i == 5:
            x[0, 0] = np.nan              # bad data at step 5
        step((x, rng.integers(0, 4, 16)))
    step.close()                          # writes the last records and the end line

    run = read_steplog(log)
    skipped = [s["step"] for s in run.steps if not s["applied"]]
    print(f"{log}: {len(run.steps)} steps, skipped {skipped}")
    diagnosis = diagnose([run])
    print(diagnosis.render())
    return {"log": run, "diagnosis": diagnosis}


if __name__ == "__main__":
    main()
