"""torch FP8Dense's native path (``torch._scaled_mm``), run on the CPU where torch 2.13
implements the op: the same quantized values, scales and states as the emulated path, the GEMMs
within the float32 summation bound of it (not bit-identical: docs/fp8.md), the fallback of a
layer the kernel refuses warned once by name, and the emulation warning once per device type."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import unimp
from unimp import fp8
from unimp.backends.torch import fp8 as tfp8
from unimp.fp8 import layers as fp8_config

pytestmark = pytest.mark.backend("torch")  # torch-only module: the native float8 GEMM is torch's

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
STEPS = 3
CONFIGS = {"delayed": fp8.DelayedScaling(amax_history_len=4), "current": fp8.CurrentScaling()}


@pytest.fixture
def count_scaled_mm(monkeypatch):
    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    return calls


def _bound(qa, qb, k):
    # |fl(sum) - fl'(sum)| <= 2 * gamma_K * sum|a_i b_i| for two summation orders (Higham,
    # Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5), u = 2**-24
    u = 2.0**-24
    return 2 * (k * u / (1 - k * u)) * (qa.double().abs() @ qb.double().abs().t())


def _pair(config, in_f=64, out_f=48, name=None):
    torch.manual_seed(0)
    emu = tfp8.FP8Dense(in_f, out_f, config=config)
    nat = tfp8.FP8Dense(in_f, out_f, config=config, native=True, name=name)
    nat.load_state_dict(emu.state_dict())
    return emu, nat


def _steps(layer, shape=(2, 5, 64), out_f=48):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randn(*shape, generator=gen).requires_grad_()
        r = torch.randn(*shape[:-1], out_f, generator=gen)
        layer.weight.grad = None
        y = layer(x)
        (y * r).sum().backward()  # the output gradient is r: the same in both paths
        states = {n: [getattr(layer, f"{n}_{f}").clone() for f in ("scale", "scale_inv", "amax_history")]
                  for n in ("input", "kernel", "grad")}
        out.append((y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone(), states))
    return out


def test_native_probe_is_cached_per_device(count_scaled_mm):
    tfp8._NATIVE_PROBED.clear()
    assert tfp8.native_fp8_supported("cpu") is True  # torch 2.13 implements _scaled_mm on CPU
    assert len(count_scaled_mm) == 1
    for _ in range(3):
        assert tfp8.native_fp8_supported(torch.device("cpu")) is True
    assert len(count_scaled_mm) == 1  # probed once, never per step


def test_emulated_stays_the_default(monkeypatch):
    monkeypatch.delenv(tfp8.NATIVE_ENV, raising=False)
    assert tfp8.FP8Dense(16, 16).native is False
    monkeypatch.setenv(tfp8.NATIVE_ENV, "1")
    assert tfp8.FP8Dense(16, 16).native is True
    assert tfp8.FP8Dense(16, 16, native=False).native is False
    with pytest.raises(TypeError, match="native must be True, False or None"):
        tfp8.FP8Dense(16, 16, native="yes")


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_native_matches_emulated_within_summation_bound(kind, count_scaled_mm):
    config = CONFIGS[kind]
    emu, nat = _pair(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        warnings.simplefilter("error", tfp8.FP8NativeFallbackWarning)
        ref = _steps(emu)
        assert count_scaled_mm == []
        got = _steps(nat)
    assert len(count_scaled_mm) == 3 * STEPS  # forward, dx and dw GEMMs each step
    for step, (r, g) in enumerate(zip(ref, got, strict=True)):
        for name in ("input", "kernel", "grad"):  # same maxima -> the same scales, bit for bit
            for a, b in zip(r[4][name], g[4][name], strict=True):
                assert torch.equal(a, b), (step, name)
        for i, what in enumerate(("y", "dx", "dw", "db")):
            assert g[i].shape == r[i].shape and torch.isfinite(g[i]).all(), (step, what)
            # both accumulate exact float8 products in float32 and scale once; only the order
            # differs (measured on CPU: at most 2 * eps * max|y|, docs/fp8.md); K <= 64 here
            assert (g[i] - r[i]).abs().max() <= 4 * 64 * 2.0**-24 * r[i].abs().max(), (step, what)
        assert torch.equal(g[3], r[3])  # the bias gradient does not pass the float8 GEMM


@pytest.mark.parametrize("m,k,n", [(1, 4096, 16), (7, 1024, 48), (100, 256, 256), (5, 40, 16)])
@pytest.mark.parametrize("fmt_a", [E4M3, E5M2])
def test_native_matmul_within_bound_of_float32_gemm(m, k, n, fmt_a):
    gen = torch.Generator().manual_seed(k + m)
    fmax = fp8.FP8_MAX[fmt_a]
    qa = (torch.randn(m, k, generator=gen) * fmax / 4).clamp(-fmax, fmax).to(tfp8._FP8_DTYPES[fmt_a]).float()
    qb = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    got = tfp8._native_matmul(qa, fmt_a, qb, E4M3)  # k = 40 is zero-padded to 48
    ref = qa @ qb.t()
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert ((got.double() - ref.double()).abs() <= _bound(qa, qb, k)).all()


def test_refused_dimensions_fall_back_once_naming_the_layer(count_scaled_mm):
    emu, nat = _pair(CONFIGS["delayed"], in_f=60, out_f=48, name="mlp.fc1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _steps(nat, shape=(4, 60))
    fallback = [w for w in caught if issubclass(w.category, tfp8.FP8NativeFallbackWarning)]
    assert len(fallback) == 1  # once, not per step
    message = str(fallback[0].message)
    assert "'mlp.fc1'" in message and "in_features=60" in message and "16" in message
    assert count_scaled_mm == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = _steps(emu, shape=(4, 60))
    for r, g in zip(ref, got, strict=True):  # the emulated path, bit for bit
        for a, b in zip(r[:4], g[:4], strict=True):
            assert torch.equal(a, b)


def test_kernel_error_falls_back_once_with_torchs_message(monkeypatch):
    # a CUDA kernel's refusal, as torch words it (torch 2.13 _meta_registrations.py)
    def refusing(*args, **kwargs):
        raise RuntimeError("Expected both dimensions of mat2 to be divisible by 16")

    emu, nat = _pair(CONFIGS["current"], name="attn.q")
    monkeypatch.setitem(tfp8._NATIVE_PROBED, ("cpu", None), True)  # probed before it refuses
    monkeypatch.setattr(torch, "_scaled_mm", refusing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _steps(nat)
        ref = _steps(emu)
    fallback = [w for w in caught if issubclass(w.category, tfp8.FP8NativeFallbackWarning)]
    assert len(fallback) == 1
    assert "'attn.q'" in str(fallback[0].message) and "divisible by 16" in str(fallback[0].message)
    for r, g in zip(ref, got, strict=True):
        for a, b in zip(r[:4], g[:4], strict=True):
            assert torch.equal(a, b)


def test_emulation_warns_once_on_a_device_without_float8_units():
    # the CPU runs _scaled_mm but has no float8 units: the native path still warns, once
    fp8_config._EMULATION_WARNED.clear()
    _, nat = _pair(CONFIGS["delayed"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(nat)
    emulated = [w for w in caught if issubclass(w.category, fp8.FP8EmulationWarning)]
    assert len(emulated) == 1 and "torch, cpu" in str(emulated[0].message)


def test_gradients_flow_through_the_native_path():
    _, nat = _pair(CONFIGS["delayed"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        y, dx, dw, db, states = _steps(nat)[-1]
    for g in (dx, dw, db):
        assert g is not None and torch.isfinite(g).all() and g.abs().max() > 0
    assert float(states["grad"][0]) != 1.0  # the grad state was stepped in backward


def test_prepare_names_the_refused_layer_by_its_path(monkeypatch):
    monkeypatch.setenv(tfp8.NATIVE_ENV, "1")
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 20),
                              torch.nn.Linear(20, 16), torch.nn.Linear(16, 16))
    mp = unimp.mixed_precision("fp8-delayed", backend="torch", device="cpu")
    net, _ = mp.prepare(net, torch.optim.SGD(net.parameters(), lr=0.0))
    assert [n for n, m in net.named_modules() if isinstance(m, tfp8.FP8Dense)] == ["1", "2"]
    assert net[1].native and net[2].native
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            net(torch.randn(4, 16)).float().sum().backward()
    fallback = sorted(str(w.message) for w in caught if issubclass(w.category, tfp8.FP8NativeFallbackWarning))
    assert len(fallback) == 2
    assert "layer '1'" in fallback[0] and "out_features=20" in fallback[0]
    assert "layer '2'" in fallback[1] and "in_features=20" in fallback[1]
    assert np.isfinite(net[1].weight.grad.numpy()).all()
