"""One float8 layer run the same way in every framework: the conformance tests of the emulated
layers (test_fp8_layers.py) and of the native paths (test_fp8_native_paths.py) share it."""

from __future__ import annotations

from typing import Any

import numpy as np
from conftest import require_backend

from unimp import fp8


def run_fp8_layer(backend: str, config: Any, w: np.ndarray, batches: list[tuple[np.ndarray, np.ndarray]],
                  **layer_kwargs: Any) -> list[tuple[Any, ...]]:
    """Per batch ``(x, g)`` (input and output gradient): ``(y, dx, dw, states)`` as NumPy, with
    ``dw`` in the kernel layout ``(in, out)`` of ``w`` and ``states`` the three scaling states
    after the step; the weights are not updated. ``layer_kwargs`` (``native``, ``name``) go to
    the backend's FP8Dense / ``fp8_dot_general``."""
    mod = require_backend(backend)
    n_in, n_out = w.shape
    tensors = fp8.LAYER_TENSORS
    out = []
    if backend == "torch":
        import torch

        layer = mod.FP8Dense(n_in, n_out, bias=False, config=config, **layer_kwargs)
        with torch.no_grad():
            layer.weight.copy_(torch.tensor(w.T))
        for x, g in batches:
            xt = torch.tensor(x, requires_grad=True)
            y = layer(xt)
            y.backward(torch.tensor(g))
            states = {n: mod.fp8_state_to_numpy(layer.fp8_state(n)) for n in tensors}
            out.append((y.detach().numpy(), xt.grad.numpy(), layer.weight.grad.numpy().T, states))
            layer.weight.grad = None
        return out
    if backend == "tensorflow":
        import tensorflow as tf

        layer = mod.FP8Dense(n_out, use_bias=False, config=config, **layer_kwargs)
        layer.build((None, n_in))
        layer.kernel.assign(w)

        @tf.function
        def fwd_bwd(x, g):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
            dx, dw = tape.gradient(y, [x, layer.kernel.value], output_gradients=g)
            return y, dx, dw

        for x, g in batches:
            y, dx, dw = fwd_bwd(tf.constant(x), tf.constant(g))
            states = {n: mod.fp8_state_to_numpy(layer.fp8_state(n)) for n in tensors}
            out.append((y.numpy(), dx.numpy(), dw.numpy(), states))
        return out
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    states = {n: mod.fp8_initial_state(config) for n in tensors}

    def forward(x_, w_, s_):
        dg = mod.fp8_dot_general(config, *(s_[n] for n in tensors), **layer_kwargs)
        return nn.Dense(n_out, use_bias=False, dot_general=dg).apply({"params": {"kernel": w_}}, x_)

    @jax.jit
    def apply(wk, st, x, g):
        # the states after the step come out as the "gradients" of the states
        y, vjp = jax.vjp(forward, x, wk, st)
        return (y, *vjp(g))

    for x, g in batches:
        y, dx, dw, states = apply(jnp.asarray(w), states, jnp.asarray(x), jnp.asarray(g))
        out.append((np.asarray(y), np.asarray(dx), np.asarray(dw),
                    {n: mod.fp8_state_to_numpy(s) for n, s in states.items()}))
    return out
