"""Each backend's emulated FP8 Dense (torch ``FP8Dense``, Keras ``FP8Dense``, JAX
``fp8_dot_general`` through ``flax.linen.Dense``) against one NumPy reference of the rule in
:func:`unimp.fp8.quantize_arrays`: same weights and batches give bit-identical outputs, input
and kernel gradients, and scaling states, step after step (CPU)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import require_backend
from fp8_kit import run_fp8_layer

from unimp import fp8
from unimp.fp8 import NumpyOps as N

IN, OUT, STEPS = 6, 5, 4
CONFIGS = {
    "delayed": fp8.DelayedScaling(amax_history_len=2),
    "current": fp8.CurrentScaling(),
}


def _data(step):
    rng = np.random.default_rng(step)
    x = (rng.standard_normal((3, IN)) * 2.0 ** (step - 2)).astype(np.float32)
    g = (rng.standard_normal((3, OUT)) * 2.0 ** (3 * step)).astype(np.float32)  # a loss scale
    return x, g


def _weights():
    return np.random.default_rng(7).standard_normal((IN, OUT)).astype(np.float32)  # (in, out)


def _empty_first(step):
    """An empty batch (0 rows) at step 0, then :func:`_data`'s batches."""
    x, g = _data(step)
    return (x[:0], g[:0]) if step == 0 else (x, g)


def _reference(config, data=_data):
    """Per step: y, dx, dw of the quantized matmul, with the NumPy reference states."""
    w = _weights()
    states = {n: fp8.FP8State.initial(config) for n in ("input", "kernel", "grad")}
    out = []
    fwd, bwd = config.dtype("forward"), config.dtype("backward")
    with np.errstate(all="ignore"):
        for step in range(STEPS):
            x, g = data(step)
            (sx, ix), states["input"] = fp8.step(config, states["input"], fp8.amax_of(N, x))
            (sw, iw), states["kernel"] = fp8.step(config, states["kernel"], fp8.amax_of(N, w))
            (sg, ig), states["grad"] = fp8.step(config, states["grad"], fp8.amax_of(N, g), "backward")
            qx = fp8.quantize_arrays(N, x, sx, fwd, fp8.FP8_MAX[fwd])
            qw = fp8.quantize_arrays(N, w, sw, fwd, fp8.FP8_MAX[fwd])
            qg = fp8.quantize_arrays(N, g, sg, bwd, fp8.FP8_MAX[bwd])
            y = (qx @ qw) * (ix * iw)
            dx = (qg @ qw.T) * (ig * iw)
            dw = (qx.T @ qg) * (ix * ig)
            out.append((y, dx, dw, {k: v for k, v in states.items()}))
    return out


def _run(backend, config, data=_data):
    """Per step: y, dx, dw and states from the backend's FP8 layer (weights not updated)."""
    return run_fp8_layer(backend, config, _weights(), [data(step) for step in range(STEPS)])


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("data", [_data, _empty_first], ids=["batches", "empty-first"])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_fp8_dense_matches_reference(backend, kind, data):
    # An empty batch is an amax of 0 (max(abs(x)) over nothing, initial 0) in every backend,
    # which each preset treats as it treats any amax 0; the output is empty, (0, OUT).
    config = CONFIGS[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        got = _run(backend, config, data)
    for step, (ref, run) in enumerate(zip(_reference(config, data), got, strict=True)):
        for name, r, o in zip(("y", "dx", "dw"), ref[:3], run[:3], strict=True):
            assert r.shape == o.shape, (step, name)
            np.testing.assert_array_equal(_bits(o), _bits(r), err_msg=f"step {step} {name}")
        for n in ("input", "kernel", "grad"):
            for f in ("scale", "scale_inv", "amax_history"):
                assert (_bits(getattr(run[3][n], f)) == _bits(getattr(ref[3][n], f))).all(), (step, n, f)
    if data is _empty_first:  # the empty input and gradient record amax 0, never -inf
        assert got[0][0].shape == (0, OUT)
        state_dict = fp8.state_dict(config, {f"l/{n}": s for n, s in got[0][3].items()})
        loaded = fp8.from_state_dict(state_dict)[1]
        for n in ("l/input", "l/grad"):
            assert not loaded[n].amax_history.any() and float(loaded[n].scale) == 1.0, n


def test_emulation_warns_once_not_per_step(backend):
    from unimp.fp8 import layers as fp8_config

    config = CONFIGS["current"]
    fp8_config._EMULATION_WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(backend, config)  # STEPS forward and backward passes
    emulated = [w for w in caught if issubclass(w.category, fp8.FP8EmulationWarning)]
    assert len(emulated) == 1
    assert "emulated" in str(emulated[0].message) and backend in str(emulated[0].message)


def test_gradient_amax_is_the_scaled_gradients(backend):
    # With loss scaling the output gradient flows in multiplied by the loss scale; its amax (and
    # so its float8 scale) is taken on that scaled tensor, before unscaling, in every backend.
    config = CONFIGS["delayed"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        run = _run(backend, config)
    for step, (_, _, _, states) in enumerate(run):
        _, g = _data(step)  # g carries a loss scale of 2**(3 * step)
        assert float(states["grad"].amax_history[0]) == float(np.max(np.abs(g)))


def test_torch_fp8_dense_bias_bfloat16_and_eval():
    # torch's nn.Linear API: bias in the output dtype, bfloat16 inputs, and eval mode uses the
    # stored delayed scale without stepping it.
    mod = require_backend("torch")
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        layer = mod.FP8Dense(IN, OUT, config=CONFIGS["delayed"])
        x = torch.tensor(_data(1)[0]).to(torch.bfloat16).requires_grad_()
        y = layer(x)
        y.float().sum().backward()
        assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
        assert layer.weight.grad.dtype == torch.float32 and layer.bias.grad is not None
        before = {k: v.clone() for k, v in layer.state_dict().items() if "scale" in k or "amax" in k}
        layer.eval()
        layer(x)
        after = {k: v for k, v in layer.state_dict().items() if k in before}
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert float(layer.input_amax_history[0]) == float(x.detach().float().abs().max())


def _layer(backend):
    mod = require_backend(backend)
    if backend == "torch":
        return mod, mod.FP8Dense(IN, OUT, config=CONFIGS["delayed"])
    layer = mod.FP8Dense(OUT, config=CONFIGS["delayed"])
    layer.build((None, IN))
    return mod, layer


_GOOD = fp8.FP8State(np.float32(2.0), np.float32(0.5), np.array([3.0, 1.0], np.float32))


@pytest.mark.parametrize(
    ("name", "state", "match"),
    [("input", fp8.FP8State(2.0, 0.5, np.zeros(1, np.float32)), "list of 2 numbers"),  # broadcast before
     ("input", fp8.FP8State(2.0, 0.5, np.zeros(5, np.float32)), "list of 2 numbers"),  # scale set, then failed
     ("grad", fp8.FP8State(-2.0, 0.5, np.zeros(2, np.float32)), "'scale' must be one finite number > 0"),
     ("kernel", fp8.FP8State(2.0, float("nan"), np.zeros(2, np.float32)), "'scale_inv'"),
     ("kernel", fp8.FP8State(True, 0.5, np.zeros(2, np.float32)), "real numbers"),
     ("kernel", fp8.FP8State(2.0, 0.5, np.array([-1.0, 0.0], np.float32)), ">= 0"),
     ("weight", _GOOD, "name must be one of"),
     ("kernel", fp8.FP8State(1.0, 1e-40, np.zeros(2, np.float32)), "'scale_inv' must be 1 / scale"),
     ("input", {"scale": 2.0, "amax_history": [0.0, 0.0]}, r"missing \['scale_inv'\]"),],
    ids=["history-1", "history-5", "negative-scale", "nan-scale-inv", "bool", "negative-amax", "name",
         "subnormal-scale-inv", "dict-missing-key"],
)
@pytest.mark.parametrize("backend", ["torch", "tensorflow"])  # JAX's states are arrays the user holds
def test_fp8_dense_load_fp8_state_refuses_bad_state_and_changes_nothing(backend, name, state, match):
    mod, layer = _layer(backend)
    before = {n: mod.fp8_state_to_numpy(layer.fp8_state(n)) for n in ("input", "kernel", "grad")}
    with pytest.raises(ValueError, match=match):
        layer.load_fp8_state(name, state)
    for n, s in before.items():
        after = mod.fp8_state_to_numpy(layer.fp8_state(n))
        for f in ("scale", "scale_inv", "amax_history"):
            np.testing.assert_array_equal(getattr(after, f), getattr(s, f))
    layer.load_fp8_state("grad", _GOOD)
    np.testing.assert_array_equal(mod.fp8_state_to_numpy(layer.fp8_state("grad")).amax_history, [3.0, 1.0])


@pytest.mark.parametrize("backend", ["torch", "tensorflow"])  # JAX's states are arrays the user holds
def test_fp8_dense_load_fp8_state_takes_the_state_as_its_to_dict(backend):
    # an AttributeError ('dict' object has no attribute 'scale') before
    mod, layer = _layer(backend)
    layer.load_fp8_state("input", _GOOD.to_dict())
    np.testing.assert_array_equal(mod.fp8_state_to_numpy(layer.fp8_state("input")).amax_history, [3.0, 1.0])
    with pytest.raises(TypeError, match=r"FP8Dense.load_fp8_state: state must be a unimp.fp8.FP8State or its "
                                        r"to_dict\(\) \(read by FP8State.from_dict\), got list"):
        layer.load_fp8_state("input", [2.0, 0.5, [0.0, 0.0]])


def test_jax_fp8_dot_general_takes_states_as_their_to_dict():
    # JAX's states are arrays the user holds: a dict of them (a state's to_dict()) is one state,
    # and the new states come back as the gradient in the same structure (an AttributeError
    # 'dict' object has no attribute 'scale' before)
    mod = require_backend("jax")
    import jax
    import jax.numpy as jnp

    cfg = fp8.DelayedScaling(amax_history_len=4)
    st = mod.fp8_initial_state(cfg)
    as_dict = {k: jnp.asarray(v) for k, v in st.to_dict().items()}
    x, w, dn = jnp.linspace(-1, 1, 64).reshape(4, 16), jnp.ones((16, 8)), (((1,), (0,)), ((), ()))

    def loss(states):
        return mod.fp8_dot_general(cfg, *states)(x, w, dn).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from_states = jax.grad(loss)((st, st, st))
        from_dicts = jax.grad(loss)((as_dict, as_dict, as_dict))
        assert jnp.array_equal(loss((st, st, st)), loss((as_dict, as_dict, as_dict)))
    for a, b in zip(from_states, from_dicts, strict=True):
        assert isinstance(b, dict)
        for f in ("scale", "scale_inv", "amax_history"):
            np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(b[f]))
    with pytest.raises(ValueError, match=r"fp8_dot_general kernel_state: FP8 tensor state keys must be"):
        mod.fp8_dot_general(cfg, st, {"scale": 1.0}, st)


@pytest.mark.parametrize("backend", ["torch", "tensorflow"])  # JAX's states are arrays the user holds
def test_fp8_state_of_an_unknown_tensor_names_the_tensors(backend):
    _, layer = _layer(backend)
    with pytest.raises(ValueError, match=r"name must be one of \['input', 'kernel', 'grad'\], got 'weight'"):
        layer.fp8_state("weight")  # an AttributeError about a buffer before


#: the amax recorded for a batch of float32 subnormals (1e-40) on CPU: TensorFlow and XLA:CPU
#: flush it to zero, NumPy and torch keep it (docs/fp8.md)
_SUBNORMAL_AMAX = {"torch": np.float32(1e-40), "tensorflow": np.float32(0.0), "jax": np.float32(0.0)}


def test_a_subnormal_amax_is_recorded_as_the_docs_say_on_cpu(backend):
    mod = require_backend(backend)
    x = np.full((2, IN), 1e-40, np.float32)
    if backend == "torch":
        import torch

        got = mod.fp8_amax(torch.tensor(x)).numpy()
    elif backend == "tensorflow":
        got = mod.fp8_amax(x).numpy()
    else:
        got = np.asarray(mod.fp8_amax(x))
    assert got == _SUBNORMAL_AMAX[backend]
    assert fp8.amax_of(N, x) == np.float32(1e-40)  # the reference


def test_fp8_dense_takes_an_integer_input_as_its_framework_dense_does(backend):
    # Keras's Dense gives float32 for an int32 input, torch's nn.Linear raises, lax.dot_general
    # multiplies integers exactly; unimp's layers gave truncated int32 outputs in torch and Keras
    mod = require_backend(backend)
    x = np.arange(2 * IN, dtype=np.int32).reshape(2, IN)
    if backend == "torch":
        import torch

        layer = mod.FP8Dense(IN, OUT, config=CONFIGS["current"])
        with pytest.raises(TypeError, match=r"FP8Dense .*floating-point operands, got torch.int32; "
                                            r"cast the input to a float dtype \(x.float\(\)\)"):
            layer(torch.tensor(x))
        assert not torch.any(layer.input_amax_history)  # nothing stepped
    elif backend == "tensorflow":
        import keras

        layer = mod.FP8Dense(OUT, config=CONFIGS["current"])
        layer.build((None, IN))
        y = layer(x)
        dense = keras.layers.Dense(OUT)
        dense.build((None, IN))
        assert y.dtype == dense(x).dtype == "float32"
        np.testing.assert_array_equal(np.asarray(y), np.asarray(layer(x.astype(np.float32))))
    else:
        import jax.numpy as jnp

        s = mod.fp8_initial_state(CONFIGS["current"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
            dg = mod.fp8_dot_general(CONFIGS["current"], s, s, s)
        dn = (((1,), (0,)), ((), ()))
        with pytest.raises(TypeError, match="fp8_dot_general: the float8 matmul takes floating-point "
                                            "operands, got int32; cast it to a float dtype"):
            dg(jnp.asarray(x), jnp.ones((IN, OUT), jnp.float32), dn)


@pytest.mark.parametrize("native", [False, True])
def test_fp8_dot_general_returns_the_preferred_element_type_as_lax_does(native):
    # bfloat16 was asked for and float32 returned, where lax.dot_general returns bfloat16
    mod = require_backend("jax")
    import jax
    import jax.numpy as jnp

    cfg = CONFIGS["current"]
    s = mod.fp8_initial_state(cfg)
    x, w = jnp.asarray(_data(1)[0]), jnp.asarray(np.ones((IN, 16), np.float32))
    dn = (((1,), (0,)), ((), ()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dg = mod.fp8_dot_general(cfg, s, s, s, native=native)
        y = dg(x, w, dn, preferred_element_type=jnp.bfloat16)
        assert y.dtype == jax.lax.dot_general(x, w, dn, preferred_element_type=jnp.bfloat16).dtype
        np.testing.assert_array_equal(np.asarray(y), np.asarray(dg(x, w, dn).astype(jnp.bfloat16)))
        dx = jax.grad(lambda a: dg(a, w, dn, preferred_element_type=jnp.bfloat16).astype(jnp.float32).sum())(x)
        assert dx.dtype == x.dtype
        with pytest.raises(TypeError, match="preferred_element_type must be a float dtype"):
            dg(x, w, dn, preferred_element_type=jnp.int32)


@pytest.mark.parametrize("how", ["set_weights", "load_weights"])
@pytest.mark.parametrize("backend", ["tensorflow"])  # Keras's own loaders; torch loads through load_state_dict
def test_keras_fp8_dense_checks_the_states_keras_loads(backend, how, tmp_path):
    # set_weights / load_weights assigned a scale of -5 unchecked, and the outputs blew up
    mod, layer = _layer(backend)
    x = _data(1)[0]
    y = np.asarray(layer(x))
    good = layer.get_weights()
    bad = [np.full_like(w, -5.0) if w.ndim == 0 else w for w in good]
    if how == "set_weights":
        load = lambda: layer.set_weights(bad)  # noqa: E731
    else:
        import keras

        _, src = _layer(backend)
        src.set_weights(good)
        src.input_scale.assign(-5.0)
        model = keras.Sequential([keras.Input((IN,)), src])
        model.save_weights(tmp_path / "w.weights.h5")
        load = lambda: keras.Sequential([keras.Input((IN,)), layer]).load_weights(tmp_path / "w.weights.h5")  # noqa: E731
    with pytest.raises(ValueError, match=f"FP8Dense.{'set_weights' if how == 'set_weights' else 'load_own'}.*'input' "
                                         "'scale' must be one finite number > 0 under the 'unimp_delayed' preset"):
        load()
    for w, before in zip(layer.get_weights(), good, strict=True):
        np.testing.assert_array_equal(w, before)
    np.testing.assert_array_equal(np.asarray(layer(x)), y)


def test_torch_load_state_dict_checks_the_scaling_states():
    # Keras's loaders check the states (set_weights, load_weights); torch's load_state_dict
    # loaded a scale of -5 unchecked
    _, layer = _layer("torch")
    sd = {k: v.clone() for k, v in layer.state_dict().items()}
    sd["input_scale"].fill_(-5.0)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"'scale' must be one finite number > 0"):
        layer.load_state_dict(sd)
    import torch

    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), k
    good = {k: v.clone() for k, v in before.items()}
    good["input_amax_history"][0] = 3.0
    layer.load_state_dict(good)
    assert float(layer.input_amax_history[0]) == 3.0
