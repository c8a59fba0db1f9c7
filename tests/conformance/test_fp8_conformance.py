"""Every backend's ``fp8`` module against the NumPy reference of :mod:`unimp.fp8`, bit for bit:
the scaling step (compiled: ``tf.function``, ``jax.jit``; torch eager) over sequences of maxima
with 0, inf and NaN, and the quantize-dequantize of float32 and bfloat16 tensors."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from conftest import require_backend
from kits import float_bits as _bits
from kits import native as _native

from unimp import fp8

INF, NAN = math.inf, math.nan
AMAXES = [3.5, 0.0, 1e-3, INF, 200.0, NAN, 7.0, 2.0**-20, 1e30, 1e-30, 5.0, 0.0, 0.25]
CONFIGS = {
    "unimp_delayed": fp8.DelayedScaling(amax_history_len=3, margin=1),
    "unimp_most_recent": fp8.DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent"),
    "unimp_current_pow2": fp8.CurrentScaling(power_of_2_scales=True),
    "keras": fp8.fp8_preset("keras", amax_history_len=3),
    "flax": fp8.fp8_preset("flax", amax_history_len=3),
    "transformer_engine": fp8.fp8_preset("transformer_engine", amax_history_len=3),
    "transformer_engine_current": fp8.fp8_preset("transformer_engine_current"),
    # torchao's power-of-two scales use each framework's log2 (not bit-identical by contract)
    "torchao": fp8.fp8_preset("torchao"),
}


def _compiled_step(backend, mod, config, role):
    if backend == "jax":
        import jax

        return jax.jit(lambda st, a: mod.fp8_step(config, st, a, role))
    if backend == "tensorflow":
        import tensorflow as tf

        # tf.function traces tuples, not dataclasses: the state goes in and out as its fields
        fn = tf.function(lambda s, i, h, a: _flat(mod.fp8_step(config, fp8.FP8State(s, i, h), a, role)))
        return lambda st, a: _unflat(fn(st.scale, st.scale_inv, st.amax_history, a))
    return lambda st, a: mod.fp8_step(config, st, a, role)


def _flat(out):
    (s, i), st = out
    return s, i, st.scale, st.scale_inv, st.amax_history


def _unflat(out):
    s, i, *st = out
    return (s, i), fp8.FP8State(*st)


@pytest.mark.parametrize("role", ["forward", "backward"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_scaling_step_matches_reference(backend, name, role):
    mod = require_backend(backend)
    config = CONFIGS[name]
    step = _compiled_step(backend, mod, config, role)
    state = mod.fp8_initial_state(config)
    for i, (ref_s, ref_inv, ref_state) in enumerate(fp8.simulate(config, AMAXES, role)):
        (s, inv), state = step(state, _native(backend, AMAXES[i]))
        got = mod.fp8_state_to_numpy(state)
        assert (_bits(s), _bits(inv)) == (_bits(ref_s), _bits(ref_inv)), f"step {i}"
        for f in ("scale", "scale_inv", "amax_history"):
            assert (_bits(getattr(got, f)) == _bits(getattr(ref_state, f))).all(), f"step {i} {f}"
    if backend == "jax":
        assert step._cache_size() == 1  # compiled once for every step


def _namespace(backend):
    require_backend(backend)
    import importlib

    ops = importlib.import_module(f"unimp.backends.{backend}.fp8").FP8Ops
    return ops("cpu") if backend == "torch" else ops


def test_the_scale_reciprocal_is_ieee_rounded_with_subnormals_kept(backend):
    # XLA and TensorFlow flush subnormals: their plain 1 / x of a scale above 2**126 is 0.
    # Every namespace's reciprocal equals NumPy's IEEE 1 / x bit for bit, over random bit
    # patterns of the ranges where it matters and the special values.
    ops = _namespace(backend)
    rng = np.random.default_rng(0)
    lo, hi = np.float32(2.0**126).view(np.int32), np.float32(np.finfo(np.float32).max).view(np.int32)
    patterns = np.concatenate([
        rng.integers(lo, hi, 20000, endpoint=True),  # results below the normal range
        rng.integers(1, 2**23, 5000),  # subnormal scales
        rng.integers(2**23, lo, 5000),  # everything else
        np.array([0, 1, 2**23 - 1, 2**23, lo, lo + 1, hi, 0x7F800000, 0x7FC00000], np.int64),
    ]).astype(np.int32)
    x = patterns.view(np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        want = np.float32(1.0) / x
    got = np.asarray(ops.reciprocal(_native(backend, x)))
    assert _bits(got).tolist() == _bits(want).tolist()


@pytest.mark.parametrize(
    ("name", "want"),
    [("transformer_engine", (3.4028235e38, 2.938736e-39)), ("unimp_delayed", (2.0**126, 2.0**-126))],
)
def test_a_tiny_amax_gives_the_same_loadable_state_everywhere(backend, name, want):
    # TE caps an infinite scale at FLT_MAX and takes its IEEE reciprocal, a subnormal; unimp's
    # rule caps the scale at 2**126. The saved state loads (it was refused with scale_inv 0).
    mod = require_backend(backend)
    config = fp8.DelayedScaling(amax_history_len=3) if name == "unimp_delayed" else CONFIGS[name]
    _, state = _compiled_step(backend, mod, config, "forward")(
        mod.fp8_initial_state(config), _native(backend, np.float32(1e-37))
    )
    got = mod.fp8_state_to_numpy(state)
    assert (float(got.scale), float(got.scale_inv)) == (np.float32(want[0]), np.float32(want[1]))
    _, loaded = fp8.from_state_dict(fp8.state_dict(config, {"kernel": got}))
    assert _bits(loaded["kernel"].scale_inv) == _bits(got.scale_inv)


@pytest.mark.parametrize("name", ["transformer_engine", "transformer_engine_current", "keras", "flax", "unimp_delayed"])
def test_amax_ignores_nan_elements_under_transformer_engine_only(backend, name):
    # TE's cast kernels reduce the amax with fmaxf: NaN elements are ignored and an all-NaN
    # tensor records 0 (a step not recorded); Keras, flax and torchao take max(abs(x)).
    mod = require_backend(backend)
    config = CONFIGS[name]
    te = config.rule == "transformer_engine"
    some, every = [1.0, NAN, -2.0, 0.5], [NAN, NAN]
    got = [float(np.asarray(mod.fp8_amax(_native(backend, x), config))) for x in (some, every)]
    assert got[0] == 2.0 if te else math.isnan(got[0])
    assert got[1] == 0.0 if te else math.isnan(got[1])
    ref = [float(fp8.amax_of(fp8.NumpyOps, np.asarray(x, np.float32), config)) for x in (some, every)]
    assert _bits(got).tolist() == _bits(ref).tolist()
    assert math.isnan(float(np.asarray(mod.fp8_amax(_native(backend, some)))))  # no config: max(abs)
    if name == "transformer_engine":  # the history records 2.0, then nothing for the all-NaN step
        state = mod.fp8_initial_state(config)
        for x in (some, every):
            _, state = mod.fp8_step(config, state, mod.fp8_amax(_native(backend, x), config))
        assert mod.fp8_state_to_numpy(state).amax_history.tolist() == [2.0, 0.0, 0.0]


def test_amax_of_a_large_tensor_keeps_its_nan(backend):
    """A NaN among 4,096 elements is the amax (max(abs(x)), no config), eagerly and compiled:
    XLA's CPU reduce-max drops it in reductions this large (JAX 0.10), so the JAX backend
    checks for NaN by hand (found by issue 33's block-scaled conformance); so does TensorFlow's
    under ``jit_compile=True``, where XLA drops it from 16 elements on (TensorFlow 2.21)."""
    mod = require_backend(backend)
    x = np.ones((64, 64), np.float32)
    x[3, 5] = NAN
    assert math.isnan(float(np.asarray(mod.fp8_amax(_native(backend, x)))))
    if backend == "jax":
        import jax

        assert math.isnan(float(jax.jit(mod.fp8_amax)(_native(backend, x))))
    if backend == "tensorflow":
        import tensorflow as tf

        compiled = tf.function(mod.fp8_amax, jit_compile=True)
        assert math.isnan(float(compiled(_native(backend, x))))

@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
def test_quantize_dequantize_matches_reference(backend, dtype, x_dtype):
    mod = require_backend(backend)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(512) * np.exp2(rng.integers(-12, 12, 512))).astype(np.float32)
    x[:6] = [0.0, -0.0, NAN, INF, -1e9, 272.0]
    scale, inv = np.float32(3.0), np.float32(1.0) / np.float32(3.0)
    if x_dtype == "bfloat16":
        x = x.astype(ml_dtypes.bfloat16)
    ref = fp8.quantize_dequantize(x, scale, inv, dtype)
    nx = _native(backend, x.astype(np.float32))
    if x_dtype == "bfloat16":
        nx = _to_bf16(backend, nx)
    got = mod.fp8_quantize_dequantize(nx, _native(backend, scale), _native(backend, inv), dtype)
    got = np.asarray(_to_numpy(backend, got)).astype(np.float32)
    np.testing.assert_array_equal(_bits(got), _bits(ref.astype(np.float32)))


def _to_bf16(backend, x):
    if backend == "torch":
        import torch

        return x.to(torch.bfloat16)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.cast(x, tf.bfloat16)
    return x.astype("bfloat16")


def _to_numpy(backend, x):
    if backend == "torch":
        import torch

        return x.to(torch.float32).numpy()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.cast(x, tf.float32).numpy()
    return np.asarray(x.astype("float32"))


@pytest.mark.parametrize("source", ["torch", "tensorflow", "jax"])
def test_state_saved_in_one_backend_resumes_in_another(backend, source):
    import json

    config = CONFIGS["transformer_engine"]
    src, dst = require_backend(source), require_backend(backend)
    state = src.fp8_initial_state(config)
    for a in AMAXES[:6]:
        _, state = src.fp8_step(config, state, _native(source, a))
    saved = json.dumps(fp8.state_dict(config, {"dense/input": src.fp8_state_to_numpy(state)}))
    loaded_config, tensors = fp8.from_state_dict(json.loads(saved))
    assert loaded_config == config
    state = dst.fp8_state_from_numpy(tensors["dense/input"])
    reference = fp8.simulate(config, AMAXES)
    for i, a in enumerate(AMAXES[6:], start=6):
        (s, inv), state = dst.fp8_step(config, state, _native(backend, a))
        assert (_bits(s), _bits(inv)) == (_bits(reference[i][0]), _bits(reference[i][1]))
    got = dst.fp8_state_to_numpy(state)
    assert (_bits(got.amax_history) == _bits(reference[-1][2].amax_history)).all()


@pytest.mark.parametrize("length", [1, 5])
def test_a_state_of_another_history_length_is_refused_when_compiled(backend, length):
    # a longer history silently widened the window (its old maxima kept ruling the scale)
    mod = require_backend(backend)
    config = fp8.DelayedScaling(amax_history_len=3)
    state = mod.fp8_state_from_numpy(fp8.FP8State.initial(fp8.DelayedScaling(amax_history_len=length)))
    with pytest.raises(ValueError, match=rf"'amax_history' has shape \({length},\), the config needs \(3,\)"):
        _compiled_step(backend, mod, config, "forward")(state, _native(backend, 2.0))


def test_the_namespace_makes_each_constant_once_by_its_bits(backend):
    """``f32`` of a Python number: the same float32 bits give the same tensor, a NaN too (a NaN
    key never equals itself: torch's cache grew by one tensor per call), and -0.0 keeps its
    sign (0.0 == -0.0 as keys)."""
    ops = _namespace(backend)
    for value in (float("nan"), -0.0, 0.0, 2.5):
        a, b = np.asarray(ops.f32(value)), np.asarray(ops.f32(value))
        assert _bits(a) == _bits(b) == _bits(np.float32(value))
    if backend == "torch":
        assert ops.f32(float("nan")) is ops.f32(float("nan"))
        assert len(ops._cache) == 4
