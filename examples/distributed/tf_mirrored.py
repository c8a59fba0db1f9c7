"""Data-parallel mixed precision with tf.distribute.MirroredStrategy: replicas agree on skips.

Run (two logical CPU devices for a try-out; on GPUs MirroredStrategy uses them all):
    python examples/distributed/tf_mirrored.py
Several workers (machines, or processes on one host): set TF_CONFIG on each, e.g.
    TF_CONFIG='{"cluster": {"worker": ["host0:12345", "host1:12345"]}, "task": {"type": "worker", "index": 0}}'
and the same script uses tf.distribute.MultiWorkerMirroredStrategy over every worker's devices.
Every worker draws the same global batch (same seed) and feeds its share of it.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

MULTI_WORKER = "TF_CONFIG" in os.environ
if not MULTI_WORKER and not tf.config.list_physical_devices("GPU"):  # CPU try-out: 2 logical devices
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import unimp  # noqa: E402


def main(steps: int = 3) -> None:
    keras.utils.set_random_seed(0)  # the same weights on every run (and on every replica)
    strategy = tf.distribute.MultiWorkerMirroredStrategy() if MULTI_WORKER else tf.distribute.MirroredStrategy()
    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    with strategy.scope():  # variables, optimizer and loss-scale state mirrored on every replica
        with mp.autocast():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
        model, opt = mp.prepare(model, keras.optimizers.Adam(1e-2))
        step = mp.train_step(model, opt, lambda m, b: tf.reduce_mean(tf.square(tf.cast(m(b[0]), tf.float32) - b[1])), max_grad_norm=1.0)
    n = strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    for i in range(steps):
        x = rng.normal(size=(8 * n, 8)).astype("float32")  # the global batch, split over replicas
        r = step((x, x[:, :1] ** 2))
        print(f"step {i}: loss {r.loss:.4f} scale {r.scale:.0f} applied {r.applied} on {n} replicas")
    # model.fit(...) after mp.prepare(model, opt, loss=...) uses the same replica-safe optimizer


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    main(args.steps)
