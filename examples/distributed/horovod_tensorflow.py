"""Seed 004's Horovod snippet, written the TensorFlow 2 way, with unimp's loss scaling.

The seed (TensorFlow 1 pieces in a TensorFlow 2 loop)::

    hvd.init()
    config = tf.compat.v1.ConfigProto(); ...; sess = tf.compat.v1.Session(config=config)
    optimizer = tf.train.AdamOptimizer(learning_rate=0.001 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer)
    with tf.GradientTape() as tape:
        loss = loss_fn(model(inputs), labels)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))

In TensorFlow 2 there is no Session or ConfigProto to make (``tf.config`` sets devices), the
optimizer is Keras's Adam, and under ``mixed_float16`` the loss is scaled. Horovod's own
``hvd.DistributedOptimizer(keras_optimizer)`` does not all-reduce under Keras 3, so the
optimizer line becomes ``uhvd.DistributedOptimizer`` (unimp's LossScaleOptimizer, all-reducing
and agreeing over the ranks on every skip). Build Horovod first (scripts/build_horovod.sh), then:

    horovodrun -np 2 -H localhost:2 --gloo python examples/distributed/horovod_tensorflow.py
    horovodrun -np 2 -H localhost:2 --gloo python examples/distributed/horovod_tensorflow.py --pattern tape
    python examples/distributed/horovod_tensorflow.py --reference   # one process, 2 replicas

Two ranks train a small Dense model (``mixed_float16``) on their own 4 samples, with a loss
scale that starts at 1024 and doubles after 2 finite steps. ``--bad-grad-steps`` makes rank
1's gradients inf at those steps (skipped on both ranks, the scale halves on both),
``--bad-loss-steps`` rank 1's loss (skipped on both, the scale is kept: the forward-overflow
rule); with ``--pattern tape --after-reduce`` rank 1's gradients are made inf after the
all-reduce, so that rank 0's gradients stay finite and only the all-reduced flags skip it. ``--reference`` runs the same steps in one process under MultiWorkerMirroredStrategy
(or ``--reference mirrored``: MirroredStrategy) with two replicas on two logical CPUs, replica
``r`` holding rank ``r``'s data and poison: tests/test_horovod_tensorflow.py checks that every
step's loss, scale and skip agree.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _steps(text: str) -> set[int]:
    return {int(s) for s in text.split(",") if s.strip()}


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--pattern", choices=["optimizer", "tape"], default="optimizer",
                    help="who all-reduces: uhvd.DistributedOptimizer (default) or uhvd.DistributedGradientTape")
    ap.add_argument("--compression", choices=["none", "fp16"], default="none",
                    help="the wire: the mean in float32, or unimp's float16 (divided by scale x world size first)")
    ap.add_argument("--function", action="store_true", help="run the step as a tf.function")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--bad-loss-steps", type=_steps, default=set(), help="e.g. 2,5: rank 1's loss is inf")
    ap.add_argument("--bad-grad-steps", type=_steps, default=set(), help="rank 1's gradients are inf")
    ap.add_argument("--after-reduce", action="store_true",
                    help="--pattern tape: rank 1's gradients are made inf after the all-reduce, so only "
                         "rank 1 sees them (the finite flags' all-reduce must skip rank 0 too)")
    ap.add_argument("--desync", action="store_true",
                    help="rank 1 starts from loss scale 64 (re-synchronized from rank 0, that step skipped)")
    ap.add_argument("--reference", nargs="?", const="multiworker", choices=["multiworker", "mirrored"],
                    help="one process, 2 replicas on 2 logical CPUs: MultiWorkerMirroredStrategy (default) "
                         "or MirroredStrategy")
    ap.add_argument("--out", help="directory for a JSON result per rank (used by the tests)")
    return ap.parse_args()


ARGS = _arguments() if __name__ == "__main__" else None

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if ARGS is not None and ARGS.reference:  # two replicas in one process: before TF makes devices
    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

from unimp.loss_scale import DynamicLossScale  # noqa: E402

RANKS = 2
CONFIG = DynamicLossScale(init_scale=1024.0, growth_interval=2)


def data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(RANKS * 4, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1))).astype("float32")
    return x[rank::RANKS], y[rank::RANKS]


def build_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_dtype_policy("mixed_float16")  # TF2's set_policy
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])


@tf.custom_gradient
def poison(x: tf.Tensor, factor: tf.Tensor):
    """Identity; multiplies the gradient by ``factor`` (inf plants a non-finite gradient)."""

    def grad(dy):
        return dy * tf.cast(factor, dy.dtype), tf.zeros_like(factor)

    return tf.identity(x), grad


def loss_fn(out: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(tf.square(tf.cast(out, tf.float32) - labels))


def factors(rank: int, step: int) -> tuple[float, float]:
    """(loss factor, gradient factor) of ``rank`` at ``step``: inf where rank 1 is poisoned."""
    bad_loss = rank == 1 and step in ARGS.bad_loss_steps
    bad_grad = rank == 1 and step in ARGS.bad_grad_steps
    return (np.inf if bad_loss else 1.0), (np.inf if bad_grad else 1.0)


def record(loss: float, scale_used: float, opt, before: int) -> dict:
    return {
        "loss": loss,
        "scale_used": scale_used,
        "scale_after": float(opt.dynamic_scale.numpy()),
        "applied": int(opt.iterations.numpy()) > before,
        "total_skips": int(opt.total_skips.numpy()),
    }


def horovod() -> tuple[int, list[dict], list[str]]:
    import horovod.tensorflow as hvd

    import unimp.distributed.horovod.tensorflow as uhvd

    hvd.init()
    rank = hvd.rank()
    if ARGS.after_reduce and ARGS.pattern != "tape":
        raise SystemExit("--after-reduce needs --pattern tape (the optimizer all-reduces inside apply)")
    model = build_model()
    x, y = data(rank)
    compression = ARGS.compression  # hvd.Compression.fp16 is refused: the scaled gradients overflow
    optimizer = uhvd.DistributedOptimizer(
        keras.optimizers.Adam(learning_rate=0.001 * hvd.size()), loss_scale=CONFIG,
        compression="none" if ARGS.pattern == "tape" else compression,
    )
    optimizer.build(model.trainable_variables)
    uhvd.broadcast_variables(model.variables, root_rank=0)  # Horovod's fails on Keras 3 variables
    if ARGS.desync and rank == 1:
        optimizer.dynamic_scale.assign(64.0)

    def step(lf, gf):
        with tf.GradientTape() as tape:
            loss = loss_fn(poison(model(x), 1.0 if ARGS.after_reduce else gf), y) * lf
            scaled = optimizer.scale_loss(loss)
        if ARGS.pattern == "tape":
            tape = uhvd.DistributedGradientTape(tape, optimizer, compression=compression)
        gradients = tape.gradient(scaled, model.trainable_variables)
        if ARGS.after_reduce:  # rank 1's copy of the mean, poisoned: rank 0's stays finite
            gradients = [g * tf.cast(gf, g.dtype) for g in gradients]
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    run = tf.function(step) if ARGS.function else step
    steps, caught = [], []
    for i in range(ARGS.steps):
        lf, gf = factors(rank, i)
        scale_used, before = float(optimizer.dynamic_scale.numpy()), int(optimizer.iterations.numpy())
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loss = run(tf.constant(lf), tf.constant(gf))
            steps.append(record(float(loss), scale_used, optimizer, before))
        caught += [f"{w.category.__name__}: {w.message}" for w in seen if "replica" in str(w.message)]
    return rank, steps, caught


def reference() -> list[list[dict]]:
    from unimp.backends import tensorflow as utf

    devices = ["/cpu:0", "/cpu:1"]
    if ARGS.reference == "mirrored":
        strategy = tf.distribute.MirroredStrategy(devices)
    else:  # MultiWorkerMirroredStrategy's collectives over the local devices of one worker
        # (TensorFlow's own constructor for that; the public one puts one replica on a CPU host)
        strategy = tf.distribute.MultiWorkerMirroredStrategy._from_local_devices(devices)
    with strategy.scope():
        model = build_model()
        optimizer = utf.LossScaleOptimizer(keras.optimizers.Adam(learning_rate=0.001 * RANKS), loss_scale=CONFIG)
        optimizer.build(model.trainable_variables)
    per = [data(r) for r in range(RANKS)]

    def value(fn):
        return strategy.experimental_distribute_values_from_function(lambda ctx: fn(ctx.replica_id_in_sync_group))

    @tf.function
    def step(x, y, lf, gf):
        def replica(x, y, lf, gf):
            with tf.GradientTape() as tape:
                loss = loss_fn(poison(model(x), gf), y) * lf
                scaled = optimizer.scale_loss(loss)
            # Keras sums the replicas' gradients: each halved (exact) for their mean, after the
            # float16 backward, which sees the same values as a Horovod rank's
            gradients = [g / RANKS for g in tape.gradient(scaled, model.trainable_variables)]
            optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
            return loss

        return strategy.run(replica, args=(x, y, lf, gf))

    out: list[list[dict]] = [[] for _ in range(RANKS)]
    for i in range(ARGS.steps):
        fs = [factors(r, i) for r in range(RANKS)]
        scale_used, before = float(optimizer.dynamic_scale.numpy()), int(optimizer.iterations.numpy())
        losses = step(
            value(lambda r: tf.constant(per[r][0])), value(lambda r: tf.constant(per[r][1])),
            value(lambda r, fs=fs: tf.constant(fs[r][0])), value(lambda r, fs=fs: tf.constant(fs[r][1])),
        )
        for r, loss in enumerate(strategy.experimental_local_results(losses)):
            out[r].append(record(float(loss), scale_used, optimizer, before))
    return out


def main() -> None:
    if ARGS.reference:
        results = reference()
        for r, steps in enumerate(results):
            print(f"replica {r}:", json.dumps(steps))
        if ARGS.out:
            Path(ARGS.out, "reference.json").write_text(json.dumps(results))
        return
    rank, steps, caught = horovod()
    for i, s in enumerate(steps):
        print(f"rank {rank} step {i}: loss {s['loss']:.6g} scale {s['scale_used']:g} -> "
              f"{s['scale_after']:g} {'applied' if s['applied'] else 'skipped'}")
    if ARGS.out:
        Path(ARGS.out, f"rank{rank}.json").write_text(json.dumps({"steps": steps, "warnings": caught}))


if __name__ == "__main__":
    main()
