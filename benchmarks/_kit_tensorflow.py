"""TensorFlow/Keras side of the benchmarks: the same Keras MLP trained by unimp's ``train_step``
or by the best hand-written Keras 3 loop (``keras.optimizers.LossScaleOptimizer`` applied in a
``tf.function`` with a ``GradientTape``)."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import unimp  # noqa: E402
from benchmarks._harness import ModelSpec  # noqa: E402
from benchmarks._harness import recipe as get_recipe  # noqa: E402

LR = 1e-3
N_BATCHES = 4
#: graph ops that call back into Python or print: each one is a host round trip per step
HOST_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc", "PrintV2", "Print"})


def device_of(device: str | None) -> str | None:
    """``cpu`` -> ``/CPU:0``, ``cuda[:N]`` -> ``/GPU:N``, None -> TensorFlow's own placement."""
    if device is None:
        return None
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return f"/CPU:{index or 0}"
    if kind in ("cuda", "gpu"):
        return f"/GPU:{index or 0}"
    raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}.")


def make_model(spec: ModelSpec, policy: str | None, output_policy: str | None) -> keras.Model:
    """The MLP; ``policy=None`` takes the global dtype policy (what ``mp.autocast()`` sets)."""
    layers: list = [keras.Input((spec.inputs,))]
    for width in spec.hidden:
        layers.append(keras.layers.Dense(width, activation="relu", dtype=policy))
        if spec.dropout:
            layers.append(keras.layers.Dropout(spec.dropout, dtype=policy))
    layers.append(keras.layers.Dense(spec.outputs, dtype=output_policy))
    return keras.Sequential(layers)


def loss_fn(model: keras.Model, batch: tuple) -> tf.Tensor:
    logits = tf.cast(model(batch[0], training=True), tf.float32)
    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=batch[1], logits=logits)
    )


class Trainer:
    """``run(n)``: n training steps, then waits for the device. ``one()``: one step, no wait."""

    def __init__(self, impl: str, spec: ModelSpec, recipe: str, device: str | None, seed: int = 0,
                 compile: bool = False):
        # compile: both loops XLA-compiled (unimp's train_step(jit_compile=True), the native
        # step's tf.function(jit_compile=True)), the compiled anchor of benchmarks.overhead
        self.impl = impl
        self.device = device_of(device)
        self.i = 0
        self.last = None
        with self._placed():
            keras.utils.set_random_seed(seed)
            rng = np.random.default_rng(seed + 1)
            self.batches = [
                (
                    tf.constant(rng.standard_normal((spec.batch, spec.inputs), dtype=np.float32)),
                    tf.constant(rng.integers(0, spec.outputs, spec.batch, dtype=np.int32)),
                )
                for _ in range(N_BATCHES)
            ]
            rec = get_recipe(recipe)
            if impl == "unimp":
                mp = unimp.mixed_precision(rec, backend="tensorflow")
                with mp.autocast():
                    # the output layer computes in float32, as in the native loop (the Keras
                    # guide's); prepare() alone casts the outputs of a float16 output layer
                    model = make_model(spec, None, mp.output_dtype_policy)
                model = mp.prepare(model)
                self.step = mp.train_step(model, keras.optimizers.Adam(LR), loss_fn, jit_compile=compile)
                self.function = self.step.function
                self._one = self._unimp_one
            elif impl == "native":
                policy = keras.DTypePolicy(recipe.partition("+")[0])
                # the output layer in float32, as the Keras mixed-precision guide says
                model = make_model(spec, policy, "float32")
                optimizer = keras.optimizers.Adam(LR)
                if rec.loss_scale.kind == "dynamic":
                    optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
                optimizer.build(model.trainable_variables)
                self.optimizer = optimizer
                self.function = tf.function(self._native_step(model, optimizer), jit_compile=compile)
                self._one = self._native_one
            else:
                raise ValueError(f"impl must be 'unimp' or 'native', got {impl!r}.")
        self.model = model

    def state_bytes_per_param(self) -> float:
        """Bytes per model parameter of what training holds between steps: the model's
        variables and the optimizer's (moments, a compensation buffer, its counters)."""
        opt = self.step.optimizer if self.impl == "unimp" else self.optimizer
        seen = {id(v): v for v in [*self.model.variables, *opt.variables]}
        nbytes = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in seen.values())
        return nbytes / sum(int(np.prod(v.shape)) for v in self.model.trainable_variables)

    @staticmethod
    def _native_step(model: keras.Model, optimizer: keras.optimizers.Optimizer):
        variables = model.trainable_variables
        scaling = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

        def step(batch: tuple) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = loss_fn(model, batch)
                scaled = optimizer.scale_loss(loss) if scaling else loss
            grads = tape.gradient(scaled, variables)
            optimizer.apply(grads, variables)  # LossScaleOptimizer: unscale, skip or apply
            return loss

        return step

    def _placed(self):
        return tf.device(self.device) if self.device else _Null()

    def _unimp_one(self) -> None:
        self.last = self.step(self.batches[self.i % N_BATCHES]).raw["loss"]
        self.i += 1

    def _native_one(self) -> None:
        self.last = self.function(self.batches[self.i % N_BATCHES])
        self.i += 1

    def one(self) -> None:
        with self._placed():
            self._one()

    def sync(self) -> float:
        return float(self.last.numpy()) if self.last is not None else float("nan")

    def run(self, n: int) -> None:
        one = self._one
        with self._placed():
            for _ in range(n):
                one()
        self.sync()

    def tracing_count(self) -> int:
        return int(self.function.experimental_get_tracing_count())

    def host_ops(self) -> list[str]:
        """Graph ops of the traced step that run Python or print (host round trips)."""
        graph = self.function.get_concrete_function(self.batches[0]).graph
        return sorted(op.type for op in _all_ops(graph) if op.type in HOST_OPS)


def _all_ops(graph):
    """Ops of ``graph`` and of the function bodies it calls (tf.cond branches, ...)."""
    yield from graph.get_operations()
    for fn in graph._functions.values():  # noqa: SLF001 - the traced body of cond/while branches
        body = getattr(fn, "graph", None)
        if body is not None:
            yield from _all_ops(body)


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def framework_version() -> str:
    return f"tensorflow {tf.__version__}, keras {keras.__version__}"


def _memory_device(device: str | None) -> str:
    if device is None:
        return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    return device.lstrip("/")


def reset_peak(device: str | None) -> None:
    try:
        tf.config.experimental.reset_memory_stats(_memory_device(device))
    except (ValueError, RuntimeError):
        pass


def live_mib() -> None:
    """TensorFlow has no list of the tensors alive: not reported."""
    return None


def framework_peak_mib(device: str | None) -> float | None:
    """``tf.config.experimental.get_memory_info(dev)["peak"]`` in MiB; None where TF reports
    nothing (its CPU allocator keeps no statistics)."""
    try:
        info = tf.config.experimental.get_memory_info(_memory_device(device))
    except (ValueError, RuntimeError):
        return None
    return info["peak"] / 2**20
