"""Each backend's opt-in native float8 GEMM path (torch ``FP8Dense(native=True)``:
``torch._scaled_mm``; Keras ``FP8Dense(native=True)``: XLA-compiled GEMMs of float8 tensors;
JAX ``fp8_dot_general(..., native=True)``: float8 operands to ``dot_general``) against the
emulated path on the same weights and batches, on the CPU: the same maxima give the same
scaling states bit for bit, the GEMMs agree within the float32 summation bound (JAX: bit for
bit, see tests/test_fp8_native_xla.py), a layer the shape rule refuses falls back once with a
warning naming it, and on a device without float8 units the native path warns it is emulated.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import require_backend
from fp8_kit import run_fp8_layer

from unimp import fp8
from unimp.fp8 import layers as fp8_config

STEPS = 3
CONFIGS = {"delayed": fp8.DelayedScaling(amax_history_len=4), "current": fp8.CurrentScaling()}


def _data(step, n_in, n_out, rows=5):
    rng = np.random.default_rng(step)
    x = (rng.standard_normal((2, rows, n_in)) * 2.0 ** (step - 1)).astype(np.float32)
    g = (rng.standard_normal((2, rows, n_out)) * 2.0 ** (2 * step)).astype(np.float32)
    return x, g


def _weights(n_in, n_out):
    return np.random.default_rng(7).standard_normal((n_in, n_out)).astype(np.float32)  # (in, out)


def _run(backend, config, native, n_in=64, n_out=48, name="mlp.fc1", rows=5):
    """Per step: y, dx, dw (kernel layout ``(in, out)``) and the three states, as NumPy."""
    batches = [_data(step, n_in, n_out, rows) for step in range(STEPS)]
    return run_fp8_layer(backend, config, _weights(n_in, n_out), batches, native=native, name=name)


def _quiet(backend, config, native, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        warnings.simplefilter("error", fp8.FP8NativeFallbackWarning)
        return _run(backend, config, native, **kw)


def test_native_path_takes_an_empty_batch(backend):
    # amax 0 for the empty input and gradient, as the emulated path; outputs (2, 0, 48)
    config = CONFIGS["delayed"]
    native, emulated = (_quiet(backend, config, flag, rows=0) for flag in (True, False))
    for (y, dx, _, states), (y_e, _, _, states_e) in zip(native, emulated, strict=True):
        assert y.shape == y_e.shape == (2, 0, 48) and dx.shape == (2, 0, 64)
        for n in ("input", "grad"):
            assert not states[n].amax_history.any() and float(states[n].scale) == 1.0
            np.testing.assert_array_equal(states[n].amax_history, states_e[n].amax_history)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_native_scales_equal_the_emulated_reference(backend, kind):
    # the issue: "the native paths run the same recipe (scales equal the emulated reference on
    # the same maxima)"
    config = CONFIGS[kind]
    ref, got = _quiet(backend, config, False), _quiet(backend, config, True)
    for step, (r, g) in enumerate(zip(ref, got, strict=True)):
        for n in fp8.LAYER_TENSORS:
            for f in fp8.STATE_FIELDS:
                a, b = getattr(r[3][n], f), getattr(g[3][n], f)
                assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (step, n, f)
        for what, a, b in zip(("y", "dx", "dw"), r[:3], g[:3], strict=True):
            assert a.shape == b.shape and np.isfinite(b).all(), (step, what)
            # exact float8 products summed in float32 in another order, scaled once (measured on
            # CPU: within 2 eps of max|y|, as for torch in tests/test_fp8_native.py); K <= 64
            bound = 4 * 64 * 2.0**-24 * np.abs(a).max()
            assert np.abs(b.astype(np.float64) - a).max() <= bound, (step, what)


def test_refused_layer_falls_back_once_naming_it(backend, monkeypatch):
    config = CONFIGS["delayed"]
    if backend == "jax":  # JAX warns once per layer name, for the process: start afresh
        from unimp.backends.jax import fp8 as jfp8

        monkeypatch.setattr(jfp8, "_FALLBACK_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run(backend, config, True, n_in=60, name="mlp.fc1")
    fallback = [w for w in caught if issubclass(w.category, fp8.FP8NativeFallbackWarning)]
    assert len(fallback) == 1, [str(w.message) for w in fallback]  # once, not per step
    message = str(fallback[0].message)
    assert "'mlp.fc1'" in message and "in_features=60" in message and "multiple of 16" in message
    ref = _quiet(backend, config, False, n_in=60)
    for r, g in zip(ref, got, strict=True):  # the emulated path itself, bit for bit
        for a, b in zip(r[:3], g[:3], strict=True):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_native_without_float8_units_warns_emulated_once(backend):
    fp8_config._EMULATION_WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(backend, CONFIGS["current"], True)
    emulated = [w for w in caught if issubclass(w.category, fp8.FP8EmulationWarning)]
    assert len(emulated) == 1 and f"{backend}, cpu" in str(emulated[0].message)


def test_the_switch_is_one_environment_variable(backend, monkeypatch):
    mod = require_backend(backend)
    assert fp8.NATIVE_ENV == "UNIMP_FP8_NATIVE"
    if backend == "jax":
        def build(native=None):
            return mod.fp8_dot_general(CONFIGS["current"], *(mod.fp8_initial_state(CONFIGS["current"])
                                                             for _ in range(3)), native=native)
    elif backend == "torch":
        def build(native=None):
            return mod.FP8Dense(16, 16, native=native)
    else:
        def build(native=None):
            return mod.FP8Dense(16, native=native)
    with pytest.raises(TypeError, match="native must be True, False or None"):
        build(native="yes")
    if backend != "jax":  # the layers keep the switch as it was at construction
        monkeypatch.delenv(fp8.NATIVE_ENV, raising=False)
        assert build().native is False
        monkeypatch.setenv(fp8.NATIVE_ENV, "1")
        assert build().native is True and build(native=False).native is False
