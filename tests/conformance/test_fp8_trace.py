"""A float8 layer's casts into and out of float8 show in every backend's dtype trace under
their own names (``fp8_quantize`` / ``fp8_dequantize``, :func:`unimp.trace.fp8_cast_op`)."""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest
from conftest import require_backend

import unimp
from unimp import fp8
from unimp.trace import OpRecord, fp8_cast_op


@pytest.mark.parametrize(
    ("inputs", "outputs", "op"),
    [(("float32",), ("float8_e4m3fn",), "fp8_quantize"), (("float8_e5m2",), ("float32",), "fp8_dequantize"),
     (("float32",), ("bfloat16",), "cast")],
)
def test_fp8_cast_op_rule(inputs, outputs, op):
    assert fp8_cast_op("cast", inputs, outputs) == op
    assert OpRecord("torch", "cast", "aten._to_copy", "", "forward", inputs, outputs).op == op
    assert fp8_cast_op("matmul", ("float8_e4m3fn",), ("float32",)) == "matmul"


def _traced(backend):
    mod = require_backend(backend)
    mp = unimp.mixed_precision("float32", backend=backend)
    config = fp8.DelayedScaling(amax_history_len=4)
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    if backend == "torch":
        import torch

        layer = mod.FP8Dense(4, 2, config=config)

        def fn(x):
            layer(x).sum().backward()

        return mp.trace(fn, torch.from_numpy(x))
    if backend == "tensorflow":
        import tensorflow as tf

        layer = mod.FP8Dense(2, config=config)
        layer.build((None, 4))

        def fn(x):
            with tf.GradientTape() as tape:
                y = tf.reduce_sum(layer(x, training=True))
            return tape.gradient(y, layer.trainable_variables)

        return mp.trace(fn, tf.constant(x))
    import jax
    import jax.numpy as jnp

    states = [mod.fp8_initial_state(config) for _ in range(3)]
    w = jnp.ones((4, 2))

    def fn(x, w, states):
        return jax.grad(lambda w, s: mod.fp8_dot_general(config, *s)(x, w, (((1,), (0,)), ((), ()))).sum(),
                        argnums=(0, 1))(w, states)

    return mp.trace(fn, jnp.asarray(x), w, states)


def test_float8_layer_shows_quantize_and_dequantize_ops(backend):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        trace = _traced(backend)
    quant = Counter(r.outputs[0] for r in trace if r.op == "fp8_quantize")
    dequant = Counter(r.inputs[0] for r in trace if r.op == "fp8_dequantize")
    # input and kernel into e4m3 in the forward pass, the output gradient into e5m2 (HYBRID)
    assert quant == {"float8_e4m3fn": 2, "float8_e5m2": 1}
    assert dequant == {"float8_e4m3fn": 2, "float8_e5m2": 1}
    assert not [r for r in trace if r.op == "cast" and "float8" in "".join(r.inputs + r.outputs)]


def test_float8_layer_shows_amax_and_scale_update_ops(backend):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        trace = _traced(backend)
    amax = [r for r in trace if r.op == "fp8_amax"]
    update = [r for r in trace if r.op == "fp8_scale_update"]
    assert amax and update
    # the reductions and the update run in float32 (the rule's dtype), whatever the layer's
    assert {r.compute for r in amax if r.floating} == {"float32"}
    assert {r.compute for r in update if r.floating} == {"float32"}
    natives = " ".join(r.native.lower() for r in amax)
    assert "abs" in natives and "max" in natives  # max(abs(x))
    # three tensors: input and kernel in the forward pass, the output gradient in backward
    assert {r.phase for r in amax} >= {"forward"} and len({r.native for r in amax}) >= 2
