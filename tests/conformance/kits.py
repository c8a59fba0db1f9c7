"""One tiny model, built the same way in every framework from the same NumPy weights.

A *kit* per backend builds a :class:`Run`: the model ``x (B, 4) -> Dense 8 -> ReLU -> Dense 3 ->
logits``, an optimizer (SGD or Adam), the recipe bound with ``unimp.mixed_precision``, and the
backend's ``train_step``. Each batch is ``{"x": float32 (B, 4), "y": int32 (B,), "poison":
float32 ()}``. ``poison`` multiplies the gradient flowing back into the logits (a custom-gradient
identity op in each framework): 1.0 leaves training alone, ``inf`` or ``nan`` injects a real
non-finite value into every gradient while the loss stays finite. A non-finite ``x`` makes a
forward overflow (non-finite loss).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from unimp import from_state_dict, mixed_precision
from unimp.loss_scale import LossScaleState

IN, HIDDEN, OUT = 4, 8, 3


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    """The shared initial weights, float32, ``w`` as (in, out)."""
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.normal(0, 0.5, (IN, HIDDEN)).astype(np.float32),
        "b1": rng.normal(0, 0.1, (HIDDEN,)).astype(np.float32),
        "w2": rng.normal(0, 0.5, (HIDDEN, OUT)).astype(np.float32),
        "b2": rng.normal(0, 0.1, (OUT,)).astype(np.float32),
    }


def batch(
    seed: int = 0, size: int = 8, poison: float = 1.0, x_scale: float = 1.0
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 + seed)
    return {
        "x": (rng.normal(0, 1, (size, IN)) * x_scale).astype(np.float32),
        "y": rng.integers(0, OUT, size).astype(np.int32),
        "poison": np.float32(poison),
    }


class Run:
    """A model + optimizer + train step in one framework, read back as NumPy."""

    backend: str
    _step_fn: Any  # the backend's train step

    def _convert(self, b: Any) -> Any:
        return b

    def step(self, b: Any):
        """One training step through the backend's ``train_step``: a StepResult."""
        return self._step_fn(self._convert(b))

    def params(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def optimizer_state(self) -> list[np.ndarray]:
        raise NotImplementedError

    def loss_scale_state(self) -> LossScaleState:
        return from_state_dict(self._step_fn.state_dict())[1]

    def state_dict(self) -> dict[str, Any]:
        return self._step_fn.state_dict()

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._step_fn.load_state_dict(d)

    def checkpoint(self) -> dict[str, Any]:
        """Params, optimizer state and loss-scale state, as copies."""
        raise NotImplementedError

    def restore(self, ckpt: dict[str, Any]) -> None:
        raise NotImplementedError


# ----------------------------------------------------------------------------------- torch


class TorchRun(Run):
    backend = "torch"

    def __init__(self, recipe, w, optimizer="sgd", lr=0.1, **step_kwargs):
        import torch

        self.torch = torch
        torch.manual_seed(0)
        self.mp = mixed_precision(recipe, backend="torch", device="cpu")
        model = torch.nn.Sequential(
            torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT)
        )
        with torch.no_grad():
            model[0].weight.copy_(torch.from_numpy(w["w1"].T.copy()))
            model[0].bias.copy_(torch.from_numpy(w["b1"]))
            model[2].weight.copy_(torch.from_numpy(w["w2"].T.copy()))
            model[2].bias.copy_(torch.from_numpy(w["b2"]))
        opt_cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam
        kw = {"eps": 1e-8} if optimizer == "adam" else {}
        opt = opt_cls(model.parameters(), lr=lr, **kw)
        prepared = self.mp.prepare(model, opt)
        model, opt = prepared if isinstance(prepared, tuple) else (prepared, opt)
        self.model, self.opt = model, opt

        class Poison(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, p):
                ctx.save_for_backward(p)
                return x.view_as(x)

            @staticmethod
            def backward(ctx, g):
                (p,) = ctx.saved_tensors
                return g * p.to(g.dtype), None

        def loss_fn(model, b):
            logits = model(b["x"])
            logits = Poison.apply(logits.float(), b["poison"])
            return torch.nn.functional.cross_entropy(logits, b["y"].long())

        self._step_fn = self.mp.train_step(model, opt, loss_fn, **step_kwargs)

    def _convert(self, b):
        if isinstance(b, (list, tuple)):
            return [self._convert(m) for m in b]
        return {k: self.torch.as_tensor(np.asarray(v)) for k, v in b.items()}

    def params(self):
        names = {"0.weight": "w1", "0.bias": "b1", "2.weight": "w2", "2.bias": "b2"}
        out = {}
        for k, v in self.model.state_dict().items():
            a = v.detach().float().cpu().numpy().copy()
            out[names[k]] = a.T.copy() if a.ndim == 2 else a
        return out

    def optimizer_state(self):
        out = []
        for _, st in sorted(self.opt.state_dict()["state"].items()):
            for k in sorted(st):
                v = st[k]
                out.append(
                    np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v).copy()
                )
        return out

    def audit(self, b):
        torch = self.torch
        t = self._convert(b)
        seen = {}

        def record(module, inputs, output):
            seen["activation"] = output.dtype  # returns None: the output is not replaced

        hook = self.model[0].register_forward_hook(record)
        try:
            with self.mp.autocast():
                out = self.model(t["x"])
                loss = torch.nn.functional.cross_entropy(out.float(), t["y"].long())
            loss.backward()
        finally:
            hook.remove()
        grads = {dtype_name(p.grad.dtype) for p in self.model.parameters()}
        self.opt.zero_grad(set_to_none=True)
        return {
            "params": _one({dtype_name(p.dtype) for p in self.model.parameters()}),
            "activation": dtype_name(seen["activation"]),
            "output": dtype_name(out.dtype),
            "grads": _one(grads),
            "int_input": dtype_name(self.mp.cast_to_compute({"y": t["y"]})["y"].dtype),
        }

    def checkpoint(self):
        return {
            "model": copy.deepcopy(self.model.state_dict()),
            "opt": copy.deepcopy(self.opt.state_dict()),
            "scaler": self.state_dict(),
        }

    def restore(self, ckpt):
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["opt"])
        self.load_state_dict(ckpt["scaler"])


# ------------------------------------------------------------------------------ tensorflow


class TensorflowRun(Run):
    backend = "tensorflow"

    def __init__(self, recipe, w, optimizer="sgd", lr=0.1, **step_kwargs):
        import keras
        import tensorflow as tf

        self.tf, self.keras = tf, keras
        self.mp = mixed_precision(recipe, backend="tensorflow")
        with self.mp.autocast():
            model = keras.Sequential(
                [
                    keras.Input((IN,)),
                    keras.layers.Dense(HIDDEN, activation="relu"),
                    keras.layers.Dense(OUT),
                ]
            )
        model.layers[0].set_weights([w["w1"], w["b1"]])
        model.layers[1].set_weights([w["w2"], w["b2"]])
        inner = (
            keras.optimizers.SGD(lr)
            if optimizer == "sgd"
            else keras.optimizers.Adam(lr, epsilon=1e-8)
        )
        model, opt = self.mp.prepare(model, inner)
        self.model, self.opt = model, opt

        @tf.custom_gradient
        def poison(x, p):
            def grad(g):
                return g * tf.cast(p, g.dtype), tf.zeros_like(p)

            return tf.identity(x), grad

        def loss_fn(model, b):
            logits = tf.cast(model(b["x"]), tf.float32)
            logits = poison(logits, b["poison"])
            return tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=b["y"], logits=logits)
            )

        self._step_fn = self.mp.train_step(model, opt, loss_fn, **step_kwargs)

    def params(self):
        (w1, b1), (w2, b2) = self.model.layers[0].get_weights(), self.model.layers[1].get_weights()
        return {"w1": w1, "b1": b1, "w2": w2, "b2": b2}

    def optimizer_state(self):
        return [np.array(v.numpy()) for v in self.opt.inner_optimizer.variables]

    def audit(self, b):
        tf = self.tf
        x = tf.constant(b["x"])
        with tf.GradientTape() as tape:
            out = self.model(x)
            loss = tf.reduce_mean(tf.cast(out, tf.float32))
        grads = tape.gradient(loss, self.model.trainable_variables)
        return {
            "params": _one({dtype_name(v.dtype) for v in self.model.trainable_variables}),
            "activation": dtype_name(self.model.layers[0](x).dtype),
            "output": dtype_name(out.dtype),
            "grads": _one({dtype_name(g.dtype) for g in grads}),
            "int_input": dtype_name(self.mp.cast_to_compute({"y": tf.constant(b["y"])})["y"].dtype),
        }

    def checkpoint(self):
        return {
            "model": [np.array(v) for v in self.model.get_weights()],
            "opt": [np.array(v.numpy()) for v in self.opt.inner_optimizer.variables],
            "scaler": self.state_dict(),
        }

    def restore(self, ckpt):
        self.model.set_weights(ckpt["model"])
        for v, value in zip(self.opt.inner_optimizer.variables, ckpt["opt"], strict=True):
            v.assign(value)
        self.load_state_dict(ckpt["scaler"])


# ------------------------------------------------------------------------------------- jax


class JaxRun(Run):
    backend = "jax"

    def __init__(self, recipe, w, optimizer="sgd", lr=0.1, **step_kwargs):
        import jax
        import jax.numpy as jnp
        import optax

        self.jax = jax
        self.mp = mp = mixed_precision(recipe, backend="jax")

        @jax.custom_vjp
        def poison(x, p):
            return x

        poison.defvjp(lambda x, p: (x, p), lambda p, g: (g * p.astype(g.dtype), jnp.zeros_like(p)))

        def forward(params, x):
            p = mp.cast_to_compute(params)
            h = jax.nn.relu(mp.cast_to_compute(x) @ p["w1"] + p["b1"])
            return h, mp.cast_to_output(h @ p["w2"] + p["b2"])

        def loss_fn(params, b):
            logits = forward(params, b["x"])[1].astype(jnp.float32)
            logits = poison(logits, b["poison"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

        opt = optax.sgd(lr) if optimizer == "sgd" else optax.adam(lr, eps=1e-8)
        params = {k: jnp.asarray(v) for k, v in w.items()}
        self._forward, self._loss_fn = forward, loss_fn
        self._step_fn = mp.train_step(loss_fn, opt, params, **step_kwargs)

    def audit(self, b):
        jnp = self.jax.numpy
        params = self._step_fn.params
        h, out = self._forward(params, jnp.asarray(b["x"]))
        grads = self.jax.grad(self._loss_fn)(params, {k: jnp.asarray(v) for k, v in b.items()})
        return {
            "params": _one({dtype_name(v.dtype) for v in params.values()}),
            "activation": dtype_name(h.dtype),
            "output": dtype_name(out.dtype),
            "grads": _one({dtype_name(g.dtype) for g in grads.values()}),
            "int_input": dtype_name(self.mp.cast_to_compute({"y": jnp.asarray(b["y"])})["y"].dtype),
        }

    def params(self):
        return {k: np.array(v, dtype=np.float32) for k, v in self._step_fn.params.items()}

    def optimizer_state(self):
        return [np.array(x) for x in self.jax.tree_util.tree_leaves(self._step_fn.opt_state)]

    def checkpoint(self):
        return {
            "params": self.jax.tree_util.tree_map(np.array, self._step_fn.params),
            "opt": self.jax.tree_util.tree_map(np.array, self._step_fn.opt_state),
            "scaler": self.state_dict(),
        }

    def restore(self, ckpt):
        s = self._step_fn
        s._params = self.jax.tree_util.tree_map(self.jax.numpy.asarray, ckpt["params"])
        s._opt_state = self.jax.tree_util.tree_map(self.jax.numpy.asarray, ckpt["opt"])
        self.load_state_dict(ckpt["scaler"])


KITS = {"torch": TorchRun, "tensorflow": TensorflowRun, "jax": JaxRun}


def native(backend: str, values: Any, dtype: str = "float32") -> Any:
    """``values`` as ``backend``'s array of ``dtype`` (``"bfloat16"`` too: rounded from float32)."""
    half = dtype in ("float16", "bfloat16")
    x = np.asarray(values, np.float32 if half else dtype)
    if backend == "torch":
        import torch

        t = torch.from_numpy(x)
        return t.to(getattr(torch, dtype)) if half else t
    if backend == "tensorflow":
        import tensorflow as tf

        t = tf.constant(x)
        return tf.cast(t, dtype) if half else t
    import jax.numpy as jnp

    return jnp.asarray(x).astype(dtype) if half else jnp.asarray(x)


def float_bits(x: Any) -> np.ndarray:
    """``x``'s float32 bit patterns as uint32, every NaN as one pattern (NaN payloads differ by
    framework and are not promised): compare results bit for bit with these."""
    x = np.asarray(x, np.float32)
    return np.where(np.isnan(x), np.uint32(0x7FC00000), x.view(np.uint32))


def dtype_name(dtype: Any) -> str:
    """``"float16"``, ``"int32"``, ... for a torch, TF, NumPy or JAX dtype."""
    name = getattr(dtype, "name", None)
    text = name if isinstance(name, str) else str(dtype)
    return text.replace("torch.", "")


def _one(names: set[str]) -> str:
    return names.pop() if len(names) == 1 else "mixed: " + ",".join(sorted(names))


# ----------------------------------------------------------------------- the linear kit
# Parameters w (n,), loss = sum(c * w) (+ 0.5 * sum(w * w) when quadratic): the true gradient
# is c (+ w), so right values (clipping, accumulation, one SGD step) can be written exactly.


def linear_batch(c: list[float], poison: float = 1.0) -> dict[str, np.ndarray]:
    return {"c": np.asarray(c, np.float32), "poison": np.float32(poison)}


class LinearRun:
    """``loss = sum(c * w) (+ 0.5 * |w|**2 when quadratic)``: the gradient is ``c`` (``+ w``).
    ``optimizer``: ``"sgd"``, ``"momentum"`` (SGD with momentum 0.9) or ``"adam"`` (epsilon
    ``eps``; in JAX built as users build it to read the learning rate,
    ``optax.inject_hyperparams(optax.adam)``)."""

    def __init__(self, backend, recipe, w, lr, quadratic=False, optimizer="sgd", eps=1e-8, **step_kwargs):
        self.backend = backend
        self.mp = mixed_precision(recipe, backend=backend)
        w = np.asarray(w, np.float32)
        q = 1.0 if quadratic else 0.0
        self._optimizer, self._eps = optimizer, eps
        getattr(self, f"_build_{backend}")(w, lr, q, step_kwargs)

    def _build_torch(self, w, lr, q, step_kwargs):
        import torch

        model = torch.nn.Linear(len(w), 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(torch.from_numpy(w[None, :]))
        if self._optimizer == "adam":
            opt = torch.optim.Adam(model.parameters(), lr=lr, eps=self._eps)
        else:
            momentum = 0.9 if self._optimizer == "momentum" else 0.0
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        if self.mp.policy.param_dtype != "float32":  # pure half recipes: module mode
            model, opt = self.mp.prepare(model, opt)

        class Poison(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, p):
                ctx.save_for_backward(p)
                return x.view_as(x)

            @staticmethod
            def backward(ctx, g):
                return g * ctx.saved_tensors[0].to(g.dtype), None

        def loss_fn(model, b):
            v = model.weight[0].float()
            return Poison.apply((b["c"] * v).sum() + 0.5 * q * (v * v).sum(), b["poison"])

        def convert(b):
            if isinstance(b, (list, tuple)):
                return [convert(m) for m in b]
            return {k: torch.as_tensor(v) for k, v in b.items()}

        self._convert = convert
        def read():  # NumPy has no bfloat16: read it as float32 (exact)
            v = model.weight.detach()[0].cpu()
            return (v.float() if v.dtype == torch.bfloat16 else v).numpy().copy()

        self.w = read
        self._step = self.mp.train_step(model, opt, loss_fn, **step_kwargs)

    def _build_tensorflow(self, w, lr, q, step_kwargs):
        import keras
        import tensorflow as tf

        with self.mp.autocast():
            model = keras.Sequential(
                [keras.Input((len(w),)), keras.layers.Dense(1, use_bias=False)]
            )
        model.layers[0].set_weights([w[:, None]])

        @tf.custom_gradient
        def poison(x, p):
            return tf.identity(x), lambda g: (g * tf.cast(p, g.dtype), tf.zeros_like(p))

        def loss_fn(model, b):
            v = tf.cast(tf.convert_to_tensor(model.layers[0].kernel)[:, 0], tf.float32)
            return poison(tf.reduce_sum(b["c"] * v) + 0.5 * q * tf.reduce_sum(v * v), b["poison"])

        self._convert = lambda b: b
        self.w = lambda: model.layers[0].get_weights()[0][:, 0].copy()
        if self._optimizer == "adam":
            opt = keras.optimizers.Adam(lr, epsilon=self._eps)
        else:
            opt = keras.optimizers.SGD(lr, momentum=0.9 if self._optimizer == "momentum" else 0.0)
        self._step = self.mp.train_step(model, opt, loss_fn, **step_kwargs)

    def _build_jax(self, w, lr, q, step_kwargs):
        import jax
        import jax.numpy as jnp
        import optax

        @jax.custom_vjp
        def poison(x, p):
            return x

        poison.defvjp(lambda x, p: (x, p), lambda p, g: (g * p.astype(g.dtype), jnp.zeros_like(p)))

        def loss_fn(params, b):
            v = params["w"]
            return poison(jnp.sum(b["c"] * v) + 0.5 * q * jnp.sum(v * v), b["poison"])

        self._convert = lambda b: b
        if self._optimizer == "adam":
            opt = optax.inject_hyperparams(optax.adam)(learning_rate=lr, eps=self._eps)
        else:
            opt = optax.sgd(lr, momentum=0.9 if self._optimizer == "momentum" else None)
        self._step = self.mp.train_step(loss_fn, opt, {"w": jnp.asarray(w)}, **step_kwargs)
        self.w = lambda: np.array(self._step.params["w"])

    def step(self, b):
        return self._step(self._convert(b))


def build_linear(backend: str, recipe: Any, w: list[float], lr: float, **kwargs: Any) -> LinearRun:
    """A :class:`LinearRun` in ``backend``."""
    return LinearRun(backend, recipe, w, lr, **kwargs)


def build(
    backend: str,
    recipe: Any = "mixed_float16",
    w: dict[str, np.ndarray] | None = None,
    **kwargs: Any,
) -> Run:
    """A :class:`Run` of the tiny model in ``backend``."""
    return KITS[backend](recipe, weights() if w is None else w, **kwargs)


# A BatchNorm model, x (B, 3) -> Dense 4 -> BatchNorm -> Dense 1, loss mean(out**2), SGD 0.1:
# the forward pass updates the norm's running statistics, so a skipped step must put them back.


class NormRun:
    """``forward_state()``: the state the forward pass changes (running / moving statistics and
    counters), ``params()``, ``optimizer_state()``, and ``evaluate(x)`` in inference mode, all
    as NumPy. Built with Adam (its moments and step count are optimizer state a skip must keep)."""

    def __init__(self, backend: str, recipe: Any, seed: int = 0):
        self.backend = backend
        self.mp = mixed_precision(recipe, backend=backend)
        rng = np.random.default_rng(seed)
        self.w1 = rng.normal(0, 0.5, (3, 4)).astype(np.float32)
        self.w2 = rng.normal(0, 0.5, (4, 1)).astype(np.float32)
        getattr(self, f"_build_{backend}")()

    def _build_torch(self):
        import torch

        model = torch.nn.Sequential(
            torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)
        )
        with torch.no_grad():
            model[0].weight.copy_(torch.from_numpy(self.w1.T))
            model[2].weight.copy_(torch.from_numpy(self.w2.T))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        self._step = self.mp.train_step(model, opt, lambda m, x: m(x).float().pow(2).mean())
        self._convert = torch.from_numpy
        self.forward_state = lambda: {
            k: v.detach().cpu().numpy().copy() for k, v in model.named_buffers()
        }
        self.params = lambda: [p.detach().cpu().numpy().copy() for p in model.parameters()]
        self.optimizer_state = lambda: [
            np.asarray(v.cpu() if isinstance(v, torch.Tensor) else v).copy()
            for s in opt.state.values() for v in s.values()
        ]

        def evaluate(x):
            model.eval()
            try:
                with torch.no_grad(), self.mp.autocast():
                    return model(torch.from_numpy(x)).float().numpy()
            finally:
                model.train()

        self.evaluate = evaluate

    def _build_tensorflow(self):
        import keras
        import tensorflow as tf

        with self.mp.autocast():
            model = keras.Sequential(
                [keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization(),
                 keras.layers.Dense(1)]
            )
        model.layers[0].kernel.assign(self.w1)
        model.layers[2].kernel.assign(self.w2)
        opt = keras.optimizers.Adam(0.01)

        def loss_fn(m, x):
            return tf.reduce_mean(tf.square(tf.cast(m(x, training=True), tf.float32)))

        self._step = self.mp.train_step(model, opt, loss_fn)
        self._convert = lambda x: x
        self.forward_state = lambda: {
            v.path: np.asarray(v.numpy()).copy() for v in model.layers[1].non_trainable_variables
        }
        self.params = lambda: [np.asarray(v.numpy()).copy() for v in model.trainable_variables]
        self.optimizer_state = lambda: [
            np.asarray(v.numpy()).copy() for v in self._step.optimizer.inner_optimizer.variables
        ]
        self.evaluate = lambda x: np.asarray(model(x, training=False), np.float32)

    def _build_jax(self):
        import flax.linen as nn
        import jax
        import jax.numpy as jnp
        import optax

        kw = self.mp.module_kwargs()

        class Net(nn.Module):
            @nn.compact
            def __call__(self, x, train):
                x = nn.Dense(4, **kw)(x)
                x = nn.BatchNorm(use_running_average=not train, momentum=0.9, **kw)(x)
                return nn.Dense(1, **kw)(x)

        net = Net()
        variables = net.init(jax.random.key(0), jnp.zeros((2, 3)), train=False)
        params = jax.tree_util.tree_map(np.asarray, variables["params"])
        params["Dense_0"]["kernel"] = self.w1
        params["Dense_1"]["kernel"] = self.w2

        def loss_fn(p, stats, x):
            out, updates = net.apply(
                {"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
            )
            return jnp.mean(jnp.square(out.astype(jnp.float32))), updates["batch_stats"]

        self._step = self.mp.train_step(
            loss_fn, optax.adam(0.01), params, model_state=variables["batch_stats"]
        )
        self._convert = lambda x: x
        leaves = lambda t: [np.asarray(v).copy() for v in jax.tree_util.tree_leaves(t)]  # noqa: E731
        self.forward_state = lambda: {
            jax.tree_util.keystr(k): np.asarray(v).copy()
            for k, v in jax.tree_util.tree_leaves_with_path(self._step.model_state)
        }
        self.params = lambda: leaves(self._step.params)
        self.optimizer_state = lambda: leaves(self._step.opt_state)
        self.evaluate = lambda x: np.asarray(
            net.apply({"params": self._step.params, "batch_stats": self._step.model_state},
                      x, train=False),
            np.float32,
        )

    def step(self, x: np.ndarray):
        return self._step(self._convert(x))
