"""Run by tests/test_distributed_tensorflow.py in a fresh process: two logical CPU devices
must be configured before TensorFlow initializes its devices. Prints one JSON line."""

import json
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["KERAS_BACKEND"] = "tensorflow"
sys.path.insert(0, os.environ.get("UNIMP_WORKTREE", "."))

import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import unimp  # noqa: E402
from unimp.backends import tensorflow as utf  # noqa: E402
from unimp.loss_scale import DynamicLossScale  # noqa: E402

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
CONFIG = DynamicLossScale(init_scale=65536.0)
mp = unimp.mixed_precision(unimp.Recipe("mixed_float16", loss_scale=CONFIG), backend="tensorflow")
out = {"replicas": strategy.num_replicas_in_sync}


@tf.custom_gradient
def poison(x, factor):
    """Identity; multiplies the gradient by ``factor`` (inf on one replica only)."""

    def grad(dy):
        return dy * factor, tf.zeros_like(factor)

    return tf.identity(x), grad


class Vec(keras.layers.Layer):
    def build(self, input_shape):
        self.w = self.add_weight(shape=(2,), initializer="zeros", name="w")

    def call(self, x):
        return self.w


def per_replica(v):
    return [c.numpy().tolist() for c in v.value.values]


def loss_fn(model, batch):
    return tf.reduce_sum(poison(model(batch["x"]), batch["f"][0]) * tf.reduce_mean(batch["x"], 0))


def batch(bad):
    return {
        "x": np.array([[1.0, 2.0], [3.0, 4.0]], "float32"),  # replica 0: [1, 2]; replica 1: [3, 4]
        "f": np.array([1.0, np.inf if bad else 1.0], "float32"),  # inf on replica 1 only
    }


# 1. mp.train_step under MirroredStrategy
with strategy.scope():
    model = keras.Sequential([keras.Input((2,)), Vec()])
    step = mp.train_step(model, keras.optimizers.SGD(1.0), loss_fn)
opt = step.optimizer
w = model.trainable_variables[0]
for name, bad in (("bad", True), ("clean", False)):
    r = step(batch(bad))
    out[f"step_{name}"] = {
        "applied": bool(r.applied),
        "grads_finite": bool(r.grads_finite),
        "scale_used": float(r.scale),
        "scale_next": per_replica(opt.dynamic_scale),
        "w": per_replica(w),
        "iterations": per_replica(opt.iterations),
    }

# 2. clipping under the strategy: the norm of the all-reduced (mean) gradient [2, 3]
with strategy.scope():
    model2 = keras.Sequential([keras.Input((2,)), Vec()])
    clip = mp.train_step(model2, keras.optimizers.SGD(1.0), loss_fn, max_grad_norm=1.0)
r = clip(batch(False))
out["clip"] = {"grad_norm": float(r.grad_norm), "w": per_replica(model2.trainable_variables[0])}

# 2b. gradient accumulation under the strategy: a list of 2 global micro-batches per call
with strategy.scope():
    model3 = keras.Sequential([keras.Input((2,)), Vec()])
    accum = mp.train_step(model3, keras.optimizers.SGD(1.0), loss_fn, grad_accum_steps=2)
later = {"x": np.array([[5.0, 6.0], [7.0, 8.0]], "float32"), "f": np.ones(2, "float32")}
r_bad = accum([batch(True), later])
bad_applied = bool(r_bad.applied)
r = accum([batch(False), later])
out["accum"] = {
    "bad_applied": bad_applied,
    "applied": bool(r.applied),
    "w": per_replica(model3.trainable_variables[0]),
}

# 3. unimp's LossScaleOptimizer in a custom loop (strategy.run + apply), and Keras's own
def custom_loop(make):
    with strategy.scope():
        v = keras.Variable(np.zeros(2, "float32"))
        o = make()
        o.build([v])

    def replica_fn():
        ctx = tf.distribute.get_replica_context()
        factor = tf.where(tf.equal(ctx.replica_id_in_sync_group, 1), np.inf, 1.0)
        with tf.GradientTape() as tape:
            loss = o.scale_loss(tf.reduce_sum(poison(v.value, factor) * [1.0, 2.0]))
        o.apply(tape.gradient(loss, [v.value]), [v])

    tf.function(lambda: strategy.run(replica_fn))()
    return {"w": per_replica(v), "scale_next": per_replica(o.dynamic_scale)}


out["lso"] = custom_loop(lambda: utf.LossScaleOptimizer(keras.optimizers.SGD(1.0), CONFIG))
out["keras_lso"] = custom_loop(
    lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=65536.0)
)

# 4. replicas that start with different scales: re-synced from replica 0, with a warning
opt.dynamic_scale.value.values[1].assign(1024.0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    r = step(batch(False))
    r.applied  # noqa: B018 - runs the step to completion
out["desync"] = {
    "warned": sorted({type(c.message).__name__ for c in caught}),
    "applied": bool(r.applied),
    "scale_next": per_replica(opt.dynamic_scale),
    "w_equal": per_replica(w)[0] == per_replica(w)[1],
}
# 5. bad input: a global batch that does not split evenly, jit_compile under a strategy
errors = {}
before = per_replica(w)
try:
    step({"x": np.ones((3, 2), "float32"), "f": np.ones(3, "float32")})
except ValueError as e:
    errors["uneven"] = str(e)
errors["unchanged"] = per_replica(w) == before
try:
    with strategy.scope():
        mp.train_step(model, opt, loss_fn, jit_compile=True)
except ValueError as e:
    errors["jit"] = str(e)
# 8. reduce_dtype (issue 17): a Dense(1) regression on per-replica data, one SGD(1.0) step, the
#    gradients all-reduced in float32 / float16 / bfloat16 (None: Keras's own sum); and a
#    float16 reduce whose sum overflows (2 replicas x 2**20 x gradient) skips on both replicas.
rrng = np.random.default_rng(17)
rx = rrng.normal(0, 1, (8, 5)).astype("float32")
ry = rrng.normal(0, 1, (8, 1)).astype("float32")


def mse(model, b):
    return tf.reduce_mean(tf.square(model(b["x"]) - b["y"]))


def reduce_run(reduce_dtype):
    rmp = unimp.mixed_precision(unimp.Recipe(unimp.Policy(reduce_dtype=reduce_dtype)), backend="tensorflow")
    with strategy.scope():
        m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1, kernel_initializer="zeros")])
        st = rmp.train_step(m, keras.optimizers.SGD(1.0), mse)
    st({"x": rx, "y": ry})
    return [per_replica(v) for v in m.trainable_variables]


out["reduce"] = {"data": {"x": rx.tolist(), "y": ry.tolist()},
                 **{str(d): reduce_run(d) for d in (None, "float32", "float16", "bfloat16")}}
omp = unimp.mixed_precision(unimp.Recipe("p=f32,c=f16,o=f32,reduce=f16", loss_scale=DynamicLossScale(
    init_scale=2.0**20)), backend="tensorflow")
with strategy.scope():
    om = keras.Sequential([keras.Input((2,)), Vec()])
    ost = omp.train_step(om, keras.optimizers.SGD(1.0), loss_fn)
r = ost({"x": np.full((2, 2), 0.1, "float32"), "f": np.ones(2, "float32")})  # share 2**20 * 0.05
out["reduce_overflow"] = {"applied": bool(r.applied), "grads_finite": bool(r.grads_finite),
                          "scale_next": per_replica(ost.optimizer.dynamic_scale),
                          "w": per_replica(om.trainable_variables[0])}

# 9. pure bfloat16 (issue 32): Adam's update of a half variable runs on a float32 view, which
#    must still find the replica's slots (Keras keys them by the distributed container)
bmp = unimp.mixed_precision("bfloat16", backend="tensorflow")
with strategy.scope():
    with bmp.autocast():
        bm = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1, kernel_initializer="ones")])
    bm, _ = bmp.prepare(bm, keras.optimizers.Adam(0.1), loss="mse")
hist = bm.fit(rx, ry, epochs=2, batch_size=8, verbose=0)
out["bfloat16_fit"] = {"loss": hist.history["loss"], "dtype": bm.weights[0].dtype,
                       "w": per_replica(bm.trainable_variables[0])}

out["errors"] = errors
print(json.dumps(out))
