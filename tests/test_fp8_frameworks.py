"""unimp's Keras and flax presets against Keras's and flax's own FP8 code, run on CPU on the
same sequences of maxima (0, inf and NaN included): the scales each quantizes with, step for
step, and the quantize-dequantize output, bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from unimp import fp8

INF, NAN = math.inf, math.nan
amax_values = st.one_of(
    st.sampled_from([0.0, INF, NAN, 1e-37, 448.0, 3e38]),  # normal: TF flushes subnormals
    st.floats(min_value=2.0**-20, max_value=2.0**20, width=32),
)
sequences = st.lists(amax_values, min_size=1, max_size=12)


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _tensor_with_amax(a, n=8):
    """A float32 vector whose max(abs(.)) is ``a`` (NaN: a NaN element)."""
    x = np.linspace(-0.5, 0.25, n).astype(np.float32) * np.float32(a if math.isfinite(a) else 1.0)
    x[3] = -a
    return x


@settings(max_examples=10, deadline=None)
@given(sequences, st.integers(1, 4))
def test_keras_quantizers_real_run(amaxes, L):
    keras = pytest.importorskip("keras")
    from keras import ops, quantizers

    scale = ops.ones((), "float32")
    hist = ops.zeros((L,), "float32")
    cfg = fp8.fp8_preset("keras", amax_history_len=L)
    state = fp8.FP8State.initial(cfg)
    fmax = ops.cast(448.0, "float32")
    for a in amaxes:
        x = _tensor_with_amax(a)
        # dense.py _float8_call, quantized_dequantize_inputs with training=True
        new_scale = quantizers.compute_float8_scale(ops.max(hist, axis=0), scale, fmax)
        new_hist = quantizers.compute_float8_amax_history(x, hist)
        (s, inv), state = fp8.step(cfg, state, fp8.amax_of(fp8.NumpyOps, x))
        # Keras divides by its stored divisor: unimp's scale_inv is that divisor exactly.
        assert _bits(inv) == _bits(ops.convert_to_numpy(scale))
        scale, hist = new_scale, new_hist
        assert _bits(state.scale_inv) == _bits(ops.convert_to_numpy(scale))
        assert sorted(_bits(state.amax_history).tolist()) == sorted(_bits(ops.convert_to_numpy(hist)).tolist())
    assert keras.backend.backend() in ("tensorflow", "jax", "torch")


@settings(max_examples=25, deadline=None)
@given(sequences, st.integers(1, 4))
@example([1e-37, 1e-37], 1)  # subnormal elements (found by hypothesis in CI-like runs)
def test_flax_fp8_ops_real_run(amaxes, L):
    pytest.importorskip("flax")
    import jax
    import jax.numpy as jnp
    from flax.linen import fp8_ops

    update = jax.jit(fp8_ops.quantize_dequantize_update, static_argnums=(1, 4))
    scale = jnp.ones((), jnp.float32)
    hist = jnp.zeros((L,), jnp.float32)
    cfg = fp8.fp8_preset("flax", amax_history_len=L)
    state = fp8.FP8State.initial(cfg)
    for a in amaxes:
        x = _tensor_with_amax(a)
        q, scale, hist = update(jnp.asarray(x), jnp.float8_e4m3fn, scale, hist, jnp.float32)
        (s, inv), state = fp8.step(cfg, state, fp8.amax_of(fp8.NumpyOps, x))
        assert _bits(inv) == _bits(scale)
        assert sorted(_bits(state.amax_history).tolist()) == sorted(_bits(hist).tolist())
        # flax's x / d is computed by XLA as x * (1 / d): unimp's multiply-only rule matches it.
        ours = fp8.quantize_dequantize(x, s, inv, "float8_e4m3fn")
        # XLA on CPU reads float32 subnormals as zero (docs/observability.md): flax sees 0 where
        # NumPy sees a subnormal element (e.g. amax 1e-37 makes 0 * inf = NaN there), so those
        # elements are platform, not rule; every other element matches bit for bit
        normal = (np.asarray(x) == 0) | (np.abs(np.asarray(x)) >= np.finfo(np.float32).tiny)
        assert (_bits(ours) == _bits(q))[normal].all()


def test_keras_dense_quantized_to_float8_real_run():
    # A real Keras Dense after model.quantize("float8"), trained with train_on_batch (the
    # optimizer overwrites the scale and history variables with their "gradients"): its input
    # scale after each step is the keras preset's, step for step, on maxima with a zero and an inf.
    keras = pytest.importorskip("keras")

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    model.quantize("float8")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    layer = model.layers[0]
    L = int(layer.inputs_amax_history.shape[0])
    cfg = fp8.fp8_preset("keras", amax_history_len=L)
    state = fp8.FP8State.initial(cfg)
    for a in [3.0, 0.0, 5.0, INF, 2.0, 1.0]:
        x = np.zeros((2, 3), np.float32)
        x[0, 1] = a  # max(abs(x)) == a
        model.train_on_batch(x, np.zeros((2, 4), np.float32))
        _, state = fp8.step(cfg, state, np.float32(a))
        assert _bits(state.scale_inv) == _bits(layer.inputs_scale.numpy())
        assert sorted(_bits(state.amax_history).tolist()) == sorted(_bits(layer.inputs_amax_history.numpy()).tolist())
    assert float(layer.inputs_scale.numpy()) == float(np.float32(1) / np.float32(448 / 5))  # max 5
