"""``unimp compare`` in JAX: the shared model as jmp-style functions, optax, unimp's jax backend."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from unimp.backends import jax as backend
from unimp.backends.jax import observe
from unimp.compare.fp8_scales import TENSORS, capture_first, scales_record
from unimp.compare.models import FP8_PATHS, LAYER_NORM_EPS, VIT_HEADS, weight_layer
from unimp.compare.run import RunSpec, test_metrics, train_loop
from unimp.compare.user import UnsupportedModel, user_model

#: ``cast(layer, x)``: an activation entering a layer, in that layer's compute dtype
#: (``mp.cast_to_compute(x, path=layer)``: the recipe's, or a per-layer override's).
Cast = Callable[[str, jax.Array], jax.Array]


#: key of the flat weights dict under which an FP8 run passes ``(mp, states, float32 weights)``
_FP8 = "__fp8__"
#: key set in the flat weights dict of a block-scaled run: (mp, the selected paths, the float32
#: weights); the stochastic rounding of NVFP4's gradients takes step 0 in every step here
_BLOCK = "__block__"


#: key set in the flat weights dict for the FP8 states pass, which observes nothing
_QUIET = "__quiet__"


def _obs(p: dict, name: str, y: jax.Array) -> jax.Array:
    return y if p.get(_QUIET) else observe(name, y)


def _matmul(p: dict, path: str, weight: str, x: jax.Array) -> jax.Array:
    """``x @ p[weight]``; in an FP8 run, a layer the recipe selected (``path``, dotted as in
    torch and Keras) runs ``mp.fp8_matmul`` on the float32 kernel, as torch's FP8Dense and the
    Keras float8 Dense quantize the float32 master weight."""
    fp8 = p.get(_FP8)
    if fp8 is not None and path in fp8[1]:
        mp, states, raw = fp8
        return mp.fp8_matmul(states, path, x, raw[weight])
    block = p.get(_BLOCK)
    if block is not None and path in block[1]:  # the float32 kernel, as torch's and Keras's layers read it
        mp, _, raw = block
        return mp.block_matmul(path, x, raw[weight])
    return x @ p[weight]



def _dense(p: dict, name: str, x: jax.Array, cast: Cast) -> jax.Array:
    # the layer's output is observed (tensor statistics) under the name torch and Keras give it
    x = cast(weight_layer(f"{name}_w"), x)
    return _obs(p, name.replace("_", "/"), _matmul(p, name.replace("_", "."), f"{name}_w", x) + p[f"{name}_b"])


def _layer_norm(p: dict, name: str, x: jax.Array, cast: Cast) -> jax.Array:
    """LayerNorm over the last axis, mean and variance in ``x``'s dtype (as jmp users write it)."""
    x = cast(name, x)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + LAYER_NORM_EPS) * p[f"{name}_g"] + p[f"{name}_b"]
    return _obs(p, name, y)


def _attention(p: dict, x: jax.Array, heads: int, cast: Cast) -> jax.Array:
    """Multi-head self-attention: ``softmax(q k^T / sqrt(head_dim)) v``, then ``o``."""
    n, t, d = x.shape
    hd = d // heads

    def proj(name: str, y: jax.Array) -> jax.Array:
        with jax.named_scope(name):
            return _dense(p, f"attn_{name}", y, cast)

    def split(y: jax.Array) -> jax.Array:  # (N, T, D) -> (N, heads, T, hd)
        return y.reshape(n, t, heads, hd).transpose(0, 2, 1, 3)

    q, k, v = (split(proj(name, x)) for name in "qkv")
    att = jax.nn.softmax(q @ k.swapaxes(-1, -2) / math.sqrt(hd), axis=-1)
    return proj("o", (att @ v).transpose(0, 2, 1, 3).reshape(n, t, d))


def _vit(p: dict, x: jax.Array, cast: Cast) -> jax.Array:
    """vit of :mod:`unimp.compare.models` up to the pooled (N, D) features, in ``x``'s dtype."""
    n, h, w, c = x.shape
    with jax.named_scope("emb"):
        z = _dense(p, "emb", x.reshape(n, h, w * c), cast)
    with jax.named_scope("pos"):
        z = z + p["pos"]
    with jax.named_scope("ln1"):
        y = _layer_norm(p, "ln1", z, cast)
    with jax.named_scope("attn"):
        z = z + _attention(p, y, VIT_HEADS, cast)
    with jax.named_scope("ln2"):
        y = _layer_norm(p, "ln2", z, cast)
    with jax.named_scope("mlp"):
        with jax.named_scope("fc1"):
            y = jax.nn.relu(_dense(p, "mlp_fc1", y, cast))
        with jax.named_scope("fc2"):
            z = z + _dense(p, "mlp_fc2", y, cast)
    with jax.named_scope("lnf"):
        z = _layer_norm(p, "lnf", z, cast)
    return z.mean(1)


def _forward(mp: Any, kind: str, block_selected: tuple[str, ...] = ()):
    def forward(params: dict, x: jax.Array, mask: jax.Array, fp8_states: Any = None,
                quiet: bool = False) -> jax.Array:
        # params are {layer: {weight: array}} (gradient names "l1/w1" line up with the other
        # frameworks' "l1.weight" and "l1/kernel"); the maths reads the flat weight names
        p = {k: v for layer in mp.cast_to_compute(params).values() for k, v in layer.items()}
        if fp8_states is not None:
            p[_FP8] = (mp, fp8_states, {k: v for layer in params.values() for k, v in layer.items()})
        if block_selected:
            p[_BLOCK] = (mp, block_selected, {k: v for layer in params.values() for k, v in layer.items()})
        p[_QUIET] = quiet
        x = mp.cast_to_compute(x)

        def cast(layer: str, y: jax.Array) -> jax.Array:  # a no-op without overrides
            return mp.cast_to_compute(y, path=layer)

        if kind == "vit":
            h = _vit(p, x, cast)
        elif kind == "mlp":
            with jax.named_scope("l1"):
                x1 = cast("l1", x.reshape(x.shape[0], -1))
                h = jax.nn.relu(_obs(p, "l1", _matmul(p, "l1", "w1", x1) + p["b1"]))
        else:
            with jax.named_scope("conv"):
                y = jax.lax.conv_general_dilated(
                    cast("conv", x), p["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
                )
                h = jax.nn.relu(_obs(p, "conv", y + p["bk"])).reshape(x.shape[0], -1)
        h = h * mask.astype(h.dtype)
        with jax.named_scope("l2"):
            h = cast("l2", h)
            logits = _obs(p, "l2", _matmul(p, "l2", "w2", h) + p["b2"])
        return mp.cast_to_output(logits)

    return forward


def _fp8_scales(states: Any) -> dict[str, dict[str, float]]:
    """``{layer: {tensor: scale}}`` of the float8 states (``{path: (input, kernel, grad)}``)."""
    return {p: {t: float(s.scale) for t, s in zip(TENSORS, per, strict=True)} for p, per in states.items()}


def probe(module: Any, x: np.ndarray, seed: int) -> np.ndarray:
    """The user's flax module's outputs for ``x`` in float32, from ``module.init`` with
    ``PRNGKey(seed)`` (the shape check of ``--model FILE.py:FUNCTION``, before any training)."""
    variables = module.init(jax.random.PRNGKey(seed), jnp.asarray(x))
    _check_collections(variables, spec_model=None)
    return np.asarray(module.apply(variables, jnp.asarray(x)), np.float32)


def _check_collections(variables: Any, spec_model: str | None) -> None:
    other = sorted(k for k in variables if k != "params")
    if other:
        raise UnsupportedModel(
            f"{'the module' if spec_model is None else f'--model {spec_model}: the module'} keeps "
            f"{', '.join(other)} besides its params; compare runs flax modules as "
            "module.apply({'params': p}, x), without mutable collections (drop BatchNorm, or use "
            "mp.train_step(..., model_state=) in your own loop)."
        )


def loss_of(out: jax.Array, y: jax.Array, loss: str) -> jax.Array:
    """The mean loss of a batch, in float32: softmax cross-entropy of logits and class indices,
    or the mean squared error."""
    out = out.astype(jnp.float32)
    if loss == "mse":
        return jnp.mean((out - y.astype(jnp.float32)) ** 2)
    return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()


def _user_build(spec: RunSpec, mp: Any, options: dict[str, Any], opt: Any) -> Any:
    """The train step of the user's flax module: its ``params`` from ``module.init``, the
    forward pass cast jmp-style at its boundary (:meth:`MixedPrecision.apply`)."""
    if spec.recipe.fp8 is not None or spec.recipe.block is not None:
        raise ValueError(
            f"--model {spec.model}: a float8 or block-scaled recipe in JAX needs unimp's layers in "
            "the model; compare a flax model with a recipe without them."
        )
    module, _ = user_model(spec.model, spec.seed)
    variables = module.init(jax.random.PRNGKey(spec.seed), jnp.asarray(spec.batches[0]["x"][:1]))
    _check_collections(variables, spec.model)
    forward = mp.apply(lambda params, x: module.apply({"params": params}, x))

    def loss_fn(params: Any, b: dict) -> jax.Array:
        return loss_of(forward(params, b["x"]), b["y"], spec.loss)

    step = mp.train_step(loss_fn, opt, variables["params"], **options)
    step.forward = lambda params, x, mask, states: forward(params, x)
    return step


def _device(spec: RunSpec) -> Any:
    return jax.devices("gpu" if spec.device == "cuda" else "cpu")[0]


def build(spec: RunSpec) -> tuple[Any, Any, Callable[[dict], Any]]:
    """The bound recipe, the train step and the batch conversion, as :func:`run` uses them.

    Returns:
        ``(mp, step, convert)``.
    """
    with jax.default_device(_device(spec)):
        mp = backend.MixedPrecision(spec.recipe)
        block_selected = ()
        if spec.recipe.block is not None and not spec.user_model:  # the block-scaled recipe's selection
            block_selected = mp.fp8_layers(FP8_PATHS[spec.model])
        forward = _forward(mp, spec.model, block_selected)

        def loss_fn(params: dict, b: dict, fp8_states: Any = None, quiet: bool = False) -> jax.Array:
            logits = forward(params, b["x"], b["mask"], fp8_states, quiet).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

        options = spec.step_options()
        fp8_states = None
        if spec.recipe.fp8 is not None and not spec.user_model:
            mp.fp8_layers(FP8_PATHS[spec.model])
            fp8_states = mp.fp8_states()
            plain_loss = loss_fn

            def loss_fn(params: dict, states: Any, b: dict) -> tuple[jax.Array, Any]:
                # the float8 states after the step are the "gradients" of the states: a second
                # backward pass with the parameters held constant gives them (the same values
                # the first computes; the compare models are small)
                fixed = jax.lax.stop_gradient(params)
                new_states = jax.grad(lambda st: plain_loss(fixed, b, st, True))(states)
                return plain_loss(params, b, states), new_states

            options["model_state"] = fp8_states

        # the learning rate as a hyperparameter in the state: the step log reads it from there.
        # Built as a user builds it: with bfloat16 parameters the train step keeps the injected
        # hyperparameters in float32 (unimp.backends.jax._float32_update)
        if spec.optimizer == "adam":
            opt = optax.inject_hyperparams(optax.adam)(learning_rate=spec.lr, eps=1e-8)
        else:
            opt = optax.inject_hyperparams(optax.sgd)(learning_rate=spec.lr)
        if spec.user_model:
            step = _user_build(spec, mp, options, opt)
            return mp, step, lambda b: {k: jnp.asarray(v) for k, v in b.items()}
        params: dict[str, dict[str, jax.Array]] = {}
        for k, v in spec.weights.items():
            params.setdefault(weight_layer(k), {})[k] = jnp.asarray(v)
        step = mp.train_step(loss_fn, opt, params, **options)
    step.forward = forward  # for the test accuracy
    step.block_layers = block_selected  # the paths in the block-scaled format (a report row)
    return mp, step, lambda b: {k: jnp.asarray(v) for k, v in b.items()}


def run(spec: RunSpec) -> dict[str, Any]:
    device = _device(spec)
    mp, step, convert = build(spec)
    with jax.default_device(device):
        trace = mp.trace(step, convert(spec.batches[0])) if spec.trace else None
        fp8_on = spec.recipe.fp8 is not None
        first = capture_first(spec, lambda: _fp8_scales(step.model_state) if fp8_on else {})
        out = train_loop(step, spec, convert)
        fp8 = scales_record(first, _fp8_scales(step.model_state)) if fp8_on else None
        ones = jnp.ones((len(spec.x_test), spec.batches[0]["mask"].shape[1]), jnp.float32)
        # an FP8 run evaluates with the states it trained (no gradient taken: they stay as they are)
        logits = jax.jit(step.forward)(step.params, jnp.asarray(spec.x_test), ones,
                                       step.model_state if fp8_on else None)
        test = test_metrics(np.asarray(logits.astype(jnp.float32)), spec.y_test, spec.loss)
    stats = device.memory_stats() if spec.device == "cuda" else None
    return {
        "framework": "jax",
        "version": backend.framework_version(),
        "device": str(device),
        **out,
        **test,
        "peak_memory_bytes": None if not stats else int(stats.get("peak_bytes_in_use", 0)) or None,
        "trace": None if trace is None else trace.to_dict(),
        "fp8_scales": fp8,
        "block_layers": list(step.block_layers) if spec.recipe.block is not None else None,
    }
