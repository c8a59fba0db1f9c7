"""JAX side of the benchmarks: the same MLP (a pure function of its params) trained by unimp's
``train_step`` or by the best hand-written loop: one jitted step with jmp-style casting (params
and inputs to the compute dtype, logits back to float32) and an inline dynamic loss scale
(jmp.DynamicLossScale's rule: halve on overflow, double after 2000 finite steps), params and
optimizer state kept on an overflow with ``jnp.where``, buffers donated on accelerators."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import unimp
from benchmarks._harness import ModelSpec
from benchmarks._harness import recipe as get_recipe

LR = 1e-3
N_BATCHES = 4
PERIOD = 2000  # jmp.DynamicLossScale's default period
HOST_PRIMITIVES = ("callback", "outfeed", "infeed")


def device_of(device: str | None) -> jax.Device:
    if device is None:
        return jax.devices()[0]
    kind, _, index = device.partition(":")
    platform = {"cpu": "cpu", "cuda": "gpu", "gpu": "gpu", "tpu": "tpu"}.get(kind)
    if platform is None:
        raise ValueError(f"device must be cpu, cuda[:N] or tpu[:N], got {device!r}.")
    return jax.devices(platform)[int(index or 0)]


def init_params(spec: ModelSpec, seed: int) -> list[dict[str, jax.Array]]:
    """PyTorch-style uniform init, float32."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(spec.sizes[:-1], spec.sizes[1:], strict=True):
        bound = 1 / np.sqrt(fan_in)
        params.append(
            {
                "w": rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32),
                "b": rng.uniform(-bound, bound, (fan_out,)).astype(np.float32),
            }
        )
    return params


def forward(params: Any, x: jax.Array, key: jax.Array, dropout: float) -> jax.Array:
    """The MLP in whatever dtype ``params``/``x`` are in."""
    last = len(params) - 1
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < last:
            x = jax.nn.relu(x)
            if dropout:
                keep = jax.random.bernoulli(jax.random.fold_in(key, i), 1 - dropout, x.shape)
                x = jnp.where(keep, x / (1 - dropout), jnp.zeros((), x.dtype))
    return x


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _cast(tree: Any, dtype: Any) -> Any:
    """jmp's _cast_floating_to: floating leaves only."""
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def native_step(spec: ModelSpec, recipe: str, optimizer: optax.GradientTransformation):
    """The hand-written step ``(params, opt_state, (scale, counter), batch) -> (..., loss)``."""
    rec = get_recipe(recipe)
    compute = jnp.dtype(rec.policy.compute_dtype)
    scaling = rec.loss_scale.kind == "dynamic"

    def step(params, opt_state, ls, batch):
        scale, counter = ls

        def loss_of(p):
            logits = forward(_cast(p, compute), _cast(batch["x"], compute), batch["key"], spec.dropout)
            loss = cross_entropy(logits.astype(jnp.float32), batch["y"])
            return (loss * scale if scaling else loss), loss

        grads, loss = jax.grad(loss_of, has_aux=True)(params)
        if not scaling:
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, ls, loss
        grads = jax.tree_util.tree_map(lambda g: g / scale, grads)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(grads)]))
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = functools.partial(jax.tree_util.tree_map, lambda new, old: jnp.where(finite, new, old))
        params, opt_state = keep(new_params, params), keep(new_opt_state, opt_state)
        grow = counter == PERIOD - 1
        grown = jnp.where(jnp.isfinite(scale * 2), scale * 2, scale)
        scale = jnp.where(finite, jnp.where(grow, grown, scale), jnp.maximum(1.0, scale / 2))
        counter = jnp.where(finite & ~grow, counter + 1, 0)
        return params, opt_state, (scale, counter), loss

    return step


class Trainer:
    """``run(n)``: n training steps, then waits for the device. ``one()``: one step, no wait."""

    def __init__(self, impl: str, spec: ModelSpec, recipe: str, device: str | None, seed: int = 0):
        self.impl = impl
        self.device = dev = device_of(device)
        self.i = 0
        self.last = None
        put = functools.partial(jax.device_put, device=dev)
        params = put(init_params(spec, seed))
        rng = np.random.default_rng(seed + 1)
        self.batches = [
            put(
                {
                    "x": rng.standard_normal((spec.batch, spec.inputs), dtype=np.float32),
                    "y": rng.integers(0, spec.outputs, spec.batch).astype(np.int32),
                    "key": np.asarray(jax.random.PRNGKey(seed + 2 + i)),
                }
            )
            for i in range(N_BATCHES)
        ]
        optimizer = optax.adam(LR)
        rec = get_recipe(recipe)
        if impl in ("unimp", "fp8-off") and rec.fp8 is not None:
            self._fp8_trainer(spec, rec, optimizer, params, dev, fp8_on=impl == "unimp")
        elif impl == "unimp":
            mp = unimp.mixed_precision(rec, backend="jax")

            def loss_fn(p, batch):
                logits = forward(
                    mp.cast_to_compute(p), mp.cast_to_compute(batch["x"]), batch["key"], spec.dropout
                )
                return cross_entropy(mp.cast_to_output(logits), batch["y"])

            with jax.default_device(dev):
                # donation as on the native side: on accelerators only (see below)
                self.step = mp.train_step(
                    loss_fn, optimizer, params, donate=dev.platform != "cpu"
                )
            self.jitted = self.step._call_jitted  # noqa: SLF001 - what step(batch) runs
            self._one = self._unimp_one
        elif impl == "native":
            self.params = params
            self.opt_state = put(optimizer.init(params))
            self.ls = put((np.float32(2**15), np.int32(0)))
            # donating params and optimizer state is the rule on accelerators (no second copy);
            # on a CPU it made this step about 9% slower (measured: 1.088, 6 pairs), so not there
            donate = (0, 1, 2) if dev.platform != "cpu" else ()
            self.jitted = jax.jit(native_step(spec, recipe, optimizer), donate_argnums=donate)
            self._one = self._native_one
        else:
            raise ValueError(f"impl must be 'unimp' or 'native', got {impl!r}.")

    def state_bytes_per_param(self) -> float:
        """Bytes per model parameter of what training holds between steps: the parameters and
        the optimizer state (moments, a compensation buffer, its counters)."""
        params, state = (self.step.params, self.step.opt_state) if self.impl == "unimp" else (
            self.params, self.opt_state
        )
        size = lambda tree: sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
        return (size(params) + size(state)) / sum(x.size for x in jax.tree_util.tree_leaves(params))

    def _fp8_trainer(self, spec: ModelSpec, rec: Any, optimizer: Any, params: Any, dev: Any,
                     fp8_on: bool = True) -> None:
        """An FP8 recipe: unimp's float8 ``dot_general`` for the layers it selects (first and
        last out), in one jitted step that differentiates the params and the float8 states
        together (the states' "gradients" are the states after the step, one backward pass;
        ``mp.train_step`` would need a second one, see unimp.compare.runner_jax). Native per
        ``UNIMP_FP8_NATIVE`` read here, at construction, as torch's and Keras's layers read it.
        ``fp8_on=False`` (impl ``"fp8-off"``): the same step with every layer in the compute
        dtype, benchmarks.gemm's like-for-like bfloat16 reference."""
        from unimp.backends.jax.fp8 import fp8_matmul
        from unimp.fp8 import native_requested

        mp = unimp.mixed_precision(rec, backend="jax")
        selected = mp.fp8_layers([f"l{i}" for i in range(len(params))]) if fp8_on else ()
        native = native_requested(None, "benchmarks")
        config = rec.fp8.scaling

        def loss_fn(p, states, batch):
            x, last = mp.cast_to_compute(batch["x"]), len(p) - 1
            cast = mp.cast_to_compute(p)
            for i, layer in enumerate(p):
                path = f"l{i}"
                if path in selected:  # the float32 master weight, quantized
                    x = fp8_matmul(config, states, path, x, layer["w"], native=native)
                else:
                    x = x @ cast[i]["w"]
                x = x + cast[i]["b"]
                if i < last:
                    x = jax.nn.relu(x)
            return cross_entropy(mp.cast_to_output(x), batch["y"])

        def step(p, opt_state, states, batch):
            loss, (grads, new_states) = jax.value_and_grad(loss_fn, argnums=(0, 1))(p, states, batch)
            updates, opt_state = optimizer.update(grads, opt_state, p)
            return optax.apply_updates(p, updates), opt_state, new_states, loss

        put = functools.partial(jax.device_put, device=dev)
        self.params, self.opt_state = params, put(optimizer.init(params))
        self.ls = put(mp.fp8_states() if fp8_on else {})  # the float8 states ride where the loss scale does
        self.jitted = jax.jit(step, donate_argnums=(0, 1, 2) if dev.platform != "cpu" else ())
        self._one = self._native_one
        self.impl = "unimp-fp8"

    def _unimp_one(self) -> None:
        self.last = self.step(self.batches[self.i % N_BATCHES]).raw["loss"]
        self.i += 1

    def _native_one(self) -> None:
        self.params, self.opt_state, self.ls, self.last = self.jitted(
            self.params, self.opt_state, self.ls, self.batches[self.i % N_BATCHES]
        )
        self.i += 1

    def one(self) -> None:
        self._one()

    def sync(self) -> float:
        jax.block_until_ready(self.step.params if self.impl == "unimp" else self.params)
        return float(self.last) if self.last is not None else float("nan")

    def run(self, n: int) -> None:
        one = self._one
        for _ in range(n):
            one()
        self.sync()

    def args(self) -> tuple:
        """The jitted function's arguments for the next step."""
        batch = self.batches[self.i % N_BATCHES]
        if self.impl == "unimp":
            return self.step.params, self.step.opt_state, self.step.loss_scale, batch
        return self.params, self.opt_state, self.ls, batch

    def host_primitives(self) -> list[str]:
        """Primitives of the step's jaxpr (sub-jaxprs included) that reach the host."""
        jaxpr = jax.make_jaxpr(self.jitted)(*self.args())
        return sorted(
            name for name in _primitives(jaxpr.jaxpr) if any(h in name for h in HOST_PRIMITIVES)
        )


def _primitives(jaxpr) -> list[str]:
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for sub in _subjaxprs(eqn.params):
            names.extend(_primitives(sub))
    return names


def _subjaxprs(params: dict) -> list:
    out = []
    for v in params.values():
        for item in v if isinstance(v, (list, tuple)) else [v]:
            inner = getattr(item, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                out.append(inner)
            elif hasattr(item, "eqns"):
                out.append(item)
    return out


def framework_version() -> str:
    return f"jax {jax.__version__}, optax {optax.__version__}"


def reset_peak(device: jax.Device) -> None:
    """JAX has no reset: the peak is the process's (one config per process)."""


def live_mib() -> float:
    """MiB of the JAX arrays alive now (``jax.live_arrays()``): params, optimizer and
    loss-scale state, the batches, and whatever a step keeps."""
    return sum(a.nbytes for a in jax.live_arrays()) / 2**20


def framework_peak_mib(device: jax.Device) -> float | None:
    """``device.memory_stats()["peak_bytes_in_use"]`` in MiB; None where JAX reports nothing."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] / 2**20
