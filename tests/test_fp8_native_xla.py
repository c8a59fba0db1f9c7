"""The XLA native float8 paths, run on the CPU: JAX's ``fp8_dot_general(native=True)`` hands
float8 operands to ``dot_general`` (what XLA's GPU ``gemm_rewriter`` turns into a cuBLASLt
float8 GEMM) and equals the emulated path bit for bit on XLA:CPU, which widens them to float32;
Keras's native GEMMs are an XLA cluster whose optimized HLO feeds the float8 converts straight
into the dot. The shared cases (states equal, fallback, warnings) are in
tests/conformance/test_fp8_native_paths.py."""

from __future__ import annotations

import re
import types
import warnings

import numpy as np
import pytest
from conftest import require_backend

from unimp import fp8

CONFIG = fp8.DelayedScaling(amax_history_len=4)
DENSE = (((1,), (0,)), ((), ()))


def _jax_steps(native, shape, n_out=48, steps=3, name="fc"):
    require_backend("jax")
    import jax
    import jax.numpy as jnp

    from unimp.backends.jax import fp8 as jfp8

    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((shape[-1], n_out)), jnp.float32)
    states = tuple(jfp8.fp8_initial_state(CONFIG) for _ in range(3))

    @jax.jit
    def step(w, states, x, r):
        def loss(x, w, states):
            dn = (((x.ndim - 1,), (0,)), ((), ()))
            y = jfp8.fp8_dot_general(CONFIG, *states, native=native, name=name)(x, w, dn)
            return (y * r).sum(), y

        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, states)
        return y, grads

    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        for _ in range(steps):
            x = jnp.asarray(rng.standard_normal(shape) * 3, jnp.float32)
            r = jnp.asarray(rng.standard_normal((*shape[:-1], n_out)) * 1e3, jnp.float32)
            y, (dx, dw, states) = step(w, states, x, r)
            out.append([np.asarray(v) for v in (y, dx, dw, *jax.tree.leaves(states))])
    return out


@pytest.mark.parametrize("shape", [(7, 64), (2, 5, 256)], ids=["2d", "3d"])
def test_jax_native_equals_emulated_bit_for_bit_on_cpu(shape):
    # XLA:CPU converts the float8 operands to float32 and runs the same dot as the emulated
    # path (observed in the optimized HLO, jax 0.10.2): y, dx, dw and the states are identical
    ref, got = _jax_steps(False, shape), _jax_steps(True, shape)
    for step, (r, g) in enumerate(zip(ref, got, strict=True)):
        for i, (a, b) in enumerate(zip(r, g, strict=True)):
            assert a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32)), (step, i)


def test_jax_native_gives_float8_operands_to_the_dot():
    require_backend("jax")
    import jax
    import jax.numpy as jnp

    from unimp.backends.jax import fp8 as jfp8

    states = tuple(jfp8.fp8_initial_state(CONFIG) for _ in range(3))
    x, w = jnp.ones((32, 64)), jnp.ones((64, 16))

    def loss(x, w, native):
        return jfp8.fp8_dot_general(CONFIG, *states, native=native)(x, w, DENSE).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        native = jax.jit(jax.value_and_grad(lambda x, w: loss(x, w, True), (0, 1))).lower(x, w).as_text()
        emulated = jax.jit(jax.value_and_grad(lambda x, w: loss(x, w, False), (0, 1))).lower(x, w).as_text()
    dots = [line for line in native.splitlines() if "dot_general" in line]
    assert len(dots) == 3  # forward, dx, dw
    operands = [re.findall(r"tensor<[\dx]+x(f8E\w+|f32)>", line) for line in dots]
    # e4m3 x e4m3 forward; the e5m2 gradient with an e4m3 operand in backward; float32 out
    assert sorted(tuple(o) for o in operands) == sorted([
        ("f8E4M3FN", "f8E4M3FN", "f32"), ("f8E5M2", "f8E4M3FN", "f32"), ("f8E5M2", "f8E4M3FN", "f32"),
    ])
    assert "f8E4M3FN" not in " ".join(line for line in emulated.splitlines() if "dot_general" in line)


def test_jax_dimension_numbers_other_than_dense_fall_back(monkeypatch):
    require_backend("jax")
    import jax.numpy as jnp

    from unimp.backends.jax import fp8 as jfp8

    monkeypatch.setattr(jfp8, "_FALLBACK_WARNED", set())
    states = tuple(jfp8.fp8_initial_state(CONFIG) for _ in range(3))
    batched = (((2,), (1,)), ((0,), (0,)))  # a batched product: (B, M, K) x (B, K, N)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            dg = jfp8.fp8_dot_general(CONFIG, *states, native=True, name="attn.scores")
            y = dg(jnp.ones((2, 16, 32)), jnp.ones((2, 32, 16)), batched)
    fallback = [str(w.message) for w in caught if issubclass(w.category, fp8.FP8NativeFallbackWarning)]
    assert len(fallback) == 1 and "'attn.scores'" in fallback[0] and "not a Dense product" in fallback[0]
    assert y.shape == (2, 16, 16) and float(y[0, 0, 0]) == 32.0


def test_jax_flax_dense_is_named_by_its_path(monkeypatch):
    require_backend("jax")
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from unimp.backends.jax import fp8 as jfp8

    monkeypatch.setattr(jfp8, "_FALLBACK_WARNED", set())

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            cls = jfp8.fp8_flax_dot_general_cls(CONFIG, native=True)
            return nn.Dense(20, dot_general_cls=cls, name="fc1")(x)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Net().init(jax.random.PRNGKey(0), jnp.ones((4, 16)))
    fallback = [str(w.message) for w in caught if issubclass(w.category, fp8.FP8NativeFallbackWarning)]
    assert len(fallback) == 1 and "layer 'fc1'" in fallback[0] and "out_features=20" in fallback[0]


@pytest.mark.parametrize("platform,capability,expected", [
    ("cpu", None, False), ("gpu", "8.0", False), ("gpu", "8.9", True), ("gpu", "9.0", True),
])
def test_jax_float8_units_from_compute_capability(platform, capability, expected):
    require_backend("jax")
    from unimp.backends.jax import fp8 as jfp8

    device = types.SimpleNamespace(platform=platform, compute_capability=capability)
    assert jfp8.native_fp8_supported(device) is expected
    assert jfp8.native_fp8_supported() is False  # this machine's CPU


def test_tensorflow_native_gemm_hlo_feeds_float8_converts_into_the_dot():
    # TF refuses float8 matmul operands; the native GEMM is an XLA cluster whose optimized HLO
    # is dot(convert(f8 parameter), convert(f8 parameter)): the pattern XLA's GPU rewriter
    # turns into a cuBLASLt float8 GEMM (gemm_rewriter.cc MatchFp8Param)
    require_backend("tensorflow")
    import tensorflow as tf

    from unimp.backends.tensorflow import fp8 as tfp8

    a = tf.cast(tf.ones((32, 64)), tf.dtypes.experimental.float8_e5m2)
    b = tf.cast(tf.ones((48, 64)), tf.dtypes.experimental.float8_e4m3fn)
    hlo = tfp8._xla_matmul.experimental_get_compiler_ir(a, b, False, True)(stage="optimized_hlo")
    entry = hlo[hlo.index("ENTRY"):]
    params = dict(re.findall(r"%(\S+) = (f8e\w+)\[[\d,]+\]\{[\d,]+\} parameter", entry))
    assert sorted(params.values()) == ["f8e4m3fn", "f8e5m2"]
    converts = re.findall(r"%(\S+) = f32\[[\d,]+\]\{[\d,]+\} fusion\(%(\S+)\)", entry)
    assert {src for _, src in converts} == set(params)  # each float8 operand widened once
    (dot,) = [line for line in hlo.splitlines() if " dot(" in line]
    assert all(f"%{name}" in dot for name, _ in converts)  # ... straight into the dot
    assert tfp8.native_fp8_supported() is False  # this machine has no GPU


def test_tensorflow_prepare_names_the_refused_layer_by_its_path(monkeypatch):
    require_backend("tensorflow")
    import keras

    import unimp

    monkeypatch.setenv(fp8.NATIVE_ENV, "1")
    model = keras.Sequential([keras.Input((16,))] + [
        keras.layers.Dense(n, name=f"d{i}") for i, n in enumerate((16, 20, 16, 16))
    ])
    mp = unimp.mixed_precision("fp8-delayed", backend="tensorflow")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = mp.prepare(model)
        model(np.ones((4, 16), np.float32), training=True)
    fallback = sorted(str(w.message) for w in caught if issubclass(w.category, fp8.FP8NativeFallbackWarning))
    assert len(fallback) == 2
    assert "layer 'd1'" in fallback[0] and "out_features=20" in fallback[0]
    assert "layer 'd2'" in fallback[1] and "in_features=20" in fallback[1]
