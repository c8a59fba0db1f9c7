"""torch backend, ``mixed_precision``: the recipe bound to the framework (autocast, prepare, examples).
The exports and the bound dtypes (every backend) are in tests/conformance/test_backend_api.py."""


import os
import subprocess
import sys
import warnings

import pytest
import torch

import unimp
import unimp.backends.torch as ut
from backends.torch.helpers import (
    DEV,
    HALF,
    MIXED,
    _batch,
    _mlp,
)
from unimp.attached import peek

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


@pytest.mark.parametrize("half", HALF)
def test_autocast_is_torchs_autocast_in_the_compute_dtype(half):
    mp = unimp.mixed_precision(MIXED[half], backend="torch", device=DEV)
    with mp.autocast():
        assert torch.is_autocast_enabled(DEV) and torch.get_autocast_dtype(DEV) == ut.to_dtype(half)


@pytest.mark.parametrize("device", [DEV, "meta"])
@pytest.mark.parametrize("name", ["float32", "O0", "32-true"])
def test_float32_recipe_is_a_noop(name, device):
    mp = unimp.mixed_precision(name, backend="torch", device=device)
    model = _mlp()
    forward = model.forward
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = mp.prepare(model)
        with mp.autocast():
            assert not torch.is_autocast_enabled(DEV)
    assert out is model and model.forward == forward and mp.mode == "none"


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("mode", ["autocast", "module"])
def test_dtype_audit(half, mode):
    mp = ut.MixedPrecision(unimp.get_recipe(MIXED[half], cast_mode=mode), device=DEV)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mp.prepare(model, opt)
    seen = {}
    model[0].register_forward_hook(lambda m, a, o: seen.update(linear=o.dtype))  # returns None
    model[1].register_forward_hook(lambda m, a, o: seen.update(norm_in=a[0].dtype))
    x, y, _ = _batch(0)
    out = model(x)
    assert seen["linear"] == ut.to_dtype(half)
    assert out.dtype == torch.float32
    ints = torch.tensor([1, 2])
    assert mp.cast_to_compute(ints) is ints
    torch.nn.functional.cross_entropy(out, y).backward()
    opt.step()  # master weights: grads moved to float32 and values copied back
    for p in ut.master_params(opt):
        assert p.dtype == torch.float32
    if mode == "module":
        assert seen["norm_in"] == torch.float32 and model[1].weight.dtype == torch.float32
        assert model[0].weight.dtype == ut.to_dtype(half)
        assert all(p.grad is None or p.grad.dtype == torch.float32 for p in ut.master_params(opt))
        masters = [p for p in ut.master_params(opt) if p.shape == model[0].weight.shape]
        assert torch.equal(masters[0].to(ut.to_dtype(half)), model[0].weight)
    else:
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())


# O3 (static scale 1.0) is allowed: unscaling by exactly 1 is exact (test_apex_o3_runs_pure_float16)
@pytest.mark.parametrize("recipe", ["mixed_float16", "float16"])
def test_prepare_refuses_float16_params_with_loss_scaling(recipe):
    model = _mlp().half() if recipe == "mixed_float16" else _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    forward = model.forward
    dtypes = [p.dtype for p in model.parameters()]
    with pytest.raises(ValueError, match=r"0\.weight.*loss_scale='none'"):
        # pure float16 comes without a loss scale (Lightning's 16-true): asked for here
        scaled = unimp.get_recipe(recipe, loss_scale="dynamic")
        ut.MixedPrecision(scaled, device=DEV).prepare(model, opt)
    assert model.forward == forward and [p.dtype for p in model.parameters()] == dtypes
    assert not peek(model, "prepared", False)


@pytest.mark.parametrize(
    "args, exc, match",
    [
        (("not a module",), TypeError, "nn.Module"),
        ((torch.nn.Linear(2, 2), "opt"), TypeError, "Optimizer"),
        ((torch.nn.Linear(2, 2),), ValueError, "master weights"),
    ],
)
def test_prepare_bad_input(args, exc, match):
    with pytest.raises(exc, match=match):
        ut.MixedPrecision("O2", device=DEV).prepare(*args)


def test_prepare_twice_raises():
    mp = ut.MixedPrecision("mixed_bfloat16", device=DEV)
    model = mp.prepare(_mlp())
    with pytest.raises(ValueError, match="already prepared"):
        mp.prepare(model)


@pytest.mark.parametrize("args", [["--recipe", "mixed_bfloat16"], ["--loop", "scaler", "--recipe", "O2"]])
def test_mlp_example_runs(args):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "torch_mlp.py"), "--steps", "3", *args],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "last" in out.stdout


def test_apex_o3_runs_pure_float16():
    mp = ut.MixedPrecision("O3", device="cpu")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mp.prepare(model, opt)
    assert next(model.parameters()).dtype == torch.float16
    step = mp.train_step(model, opt, lambda m, b: m(b).float().pow(2).mean())
    r = step(torch.ones(3, 4))
    assert r.applied and r.scale == 1.0


@pytest.mark.parametrize("recipe", ["mixed_float16", "O2"])
def test_a_deep_copy_of_a_prepared_model_runs_itself(recipe):
    # the EMA pattern: ema = copy.deepcopy(model); a forward closure would run the original
    import copy

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    mp = unimp.mixed_precision(recipe, backend="torch", device="cpu")
    prepared = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model = prepared[0] if isinstance(prepared, tuple) else prepared
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.zero_()
    x = torch.ones(4, 3)
    assert torch.equal(ema(x), torch.zeros(4, 2))
    assert model(x).abs().sum() > 0 and model(x).dtype == torch.float32
    if recipe == "mixed_float16":  # a pickled prepared model loads and still casts
        import pickle

        back = pickle.loads(pickle.dumps(model))
        assert back(x).dtype == torch.float32 and torch.equal(back(x), model(x))


_NEW_SWITCHES = getattr(torch.backends.cuda.matmul, "fp32_precision", None) in ("none", "ieee", "tf32")
_SWITCHES = (
    (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn)
    if _NEW_SWITCHES
    else ()
)
needs_fp32_precision = pytest.mark.skipif(not _NEW_SWITCHES, reason="torch < 2.9 has no fp32_precision switches")


@pytest.fixture
def torch_switches_restored():
    """Puts torch's switches (and the legacy matmul setting the test may change) back after."""
    saved = [k.fp32_precision for k in _SWITCHES]
    yield
    torch.set_float32_matmul_precision("highest")
    for k, v in zip(_SWITCHES, saved, strict=True):
        k.fp32_precision = v


def _oneDNN_matmul() -> str:  # "ieee" / "tf32" / "bf16": tells highest, high and medium apart
    return torch.backends.mkldnn.matmul.fp32_precision


@needs_fp32_precision
def test_matmul_precision_restores_switches_torchs_getter_refuses_to_read(torch_switches_restored):
    # torch.backends.cuda.matmul.allow_tf32 = False alone leaves the CUDA and oneDNN matmul
    # switches disagreeing; torch.get_float32_matmul_precision() then raises (the legacy and
    # new APIs mixed). unimp's block must neither raise nor change what the user had.
    from unimp.backends.torch.precision import current_matmul_precision, matmul_precision

    torch.set_float32_matmul_precision("high")
    torch.backends.cuda.matmul.allow_tf32 = False
    before = current_matmul_precision()
    assert (before["cuda.matmul"], before["mkldnn.matmul"]) == ("ieee", "tf32")
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        torch.get_float32_matmul_precision()
    with matmul_precision("highest"):
        assert _oneDNN_matmul() == "ieee"
    assert current_matmul_precision() == before


@needs_fp32_precision
def test_nested_matmul_precision_blocks_restore_what_each_one_found(torch_switches_restored):
    # a train step opens a block and its autocast a second one with the same setting; the
    # inner one changes and restores nothing (the outer does), yet a different inner setting,
    # or a change made by user code between the two, is still set and restored by the inner one
    from unimp.backends.torch.precision import matmul_precision

    with matmul_precision("high"):
        with matmul_precision("high"):
            assert _oneDNN_matmul() == "tf32"
        assert _oneDNN_matmul() == "tf32"
        with matmul_precision("highest"):
            assert _oneDNN_matmul() == "ieee"
        assert _oneDNN_matmul() == "tf32"
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"  # user code inside the outer block
        with matmul_precision("high"):
            assert _oneDNN_matmul() == "tf32"
        assert _oneDNN_matmul() == "bf16"
    assert _oneDNN_matmul() == "none"
    with pytest.raises(RuntimeError, match="boom"), matmul_precision("high"):
        with matmul_precision("high"):
            raise RuntimeError("boom")
    assert _oneDNN_matmul() == "none"
    with matmul_precision("high"):  # the stack of open blocks was unwound by the error
        assert _oneDNN_matmul() == "tf32"
    assert _oneDNN_matmul() == "none"


@pytest.mark.parametrize(
    "name,legacy", [("highest", ("highest", False)), ("high", ("high", True)), ("medium", ("medium", True))]
)
def test_torch_without_fp32_precision_gets_the_legacy_calls(monkeypatch, torch_switches_restored, name, legacy):
    # torch < 2.9 has no fp32_precision switches: unimp then calls set_float32_matmul_precision
    # and sets cudnn.allow_tf32 (this torch still has both), and puts both back, also on error
    from unimp.backends.torch import precision

    monkeypatch.setattr(precision, "_switches", lambda: ())

    def read():
        return torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32

    before = read()
    with precision.matmul_precision(name):
        assert read() == legacy
        assert precision.current_matmul_precision() == {
            "api": "set_float32_matmul_precision + cudnn.allow_tf32 (torch<2.9)",
            "matmul": legacy[0],
            "conv_tf32": legacy[1],
        }
    assert read() == before
    with pytest.raises(RuntimeError, match="boom"), precision.matmul_precision(name):
        raise RuntimeError("boom")
    assert read() == before
