from conftest import require_backend

ut = require_backend("torch")  # skips with a reason if not under test, FAILS if missing

import copy  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import unimp  # noqa: E402
from unimp.backends._base import COMMON_API, MixedPrecisionBase  # noqa: E402
from unimp.loss_scale import DynamicLossScale, LossScaleError, NoLossScale, StaticLossScale  # noqa: E402

# These tests build their tensors on the CPU; the backend itself takes the device from the user.
DEV = "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HALF = ["float16", "bfloat16"]
MIXED = {"float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}


class _InfGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``inf`` when ``bad`` (an overflow
    in the backward pass with a finite loss)."""

    @staticmethod
    def forward(ctx, x, bad):
        ctx.bad = bad
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (g * float("inf") if ctx.bad else g), None


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )


def _loss(model, batch):
    x, y, bad = batch
    return torch.nn.functional.cross_entropy(_InfGrad.apply(model(x), bad), y)


def _batch(seed, bad=False, n=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g), bad


def _state_copy(opt):
    return {k: {n: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v)) for n, v in s.items()}
            for k, s in opt.state.items()}


def _assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


# ------------------------------------------------------------------ exports and binding


def test_exports_common_api():
    assert set(COMMON_API) <= set(ut.__all__)
    for name in ut.__all__:
        assert hasattr(ut, name), name
    assert ut.StepResult is unimp.StepResult
    assert issubclass(ut.MixedPrecision, MixedPrecisionBase)


@pytest.mark.parametrize("half", HALF)
def test_mixed_precision_binding(half):
    mp = unimp.mixed_precision(MIXED[half], backend="torch", device=DEV)
    assert isinstance(mp, ut.MixedPrecision)
    assert mp.compute_dtype == ut.to_dtype(half)
    assert mp.param_dtype == torch.float32 and mp.output_dtype == torch.float32
    assert mp.policy.compute_dtype == half and mp.recipe.policy is mp.policy
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


@pytest.mark.parametrize("device", ["meta", "cuda"])
def test_device_that_cannot_run_the_dtype_raises(device):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error path needs a device without it")
    with pytest.raises(ValueError, match="cannot run on"):
        ut.MixedPrecision("mixed_float16", device=device)


@pytest.mark.parametrize("recipe", ["mixed_float16", "mixed_bfloat16", "bf16-true"])
def test_cuda_without_cuda_raises(recipe):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error path needs a machine without it")
    with pytest.raises(ValueError, match="CUDA is not available"):
        ut.MixedPrecision(recipe, device="cuda")


@pytest.mark.parametrize("call", ["prepare", "train_step"])
def test_model_on_another_device_type_raises(call):
    mp = ut.MixedPrecision("mixed_bfloat16", device=DEV)
    model = _mlp().to("meta")
    with pytest.raises(ValueError, match="bound to cpu"):
        if call == "prepare":
            mp.prepare(model)
        else:
            mp.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss)
    assert not getattr(model, "_unimp_prepared", False)


def test_bad_device_name_raises():
    with pytest.raises(ValueError, match="not a torch device"):
        ut.MixedPrecision("mixed_float16", device="gpu0")


# ------------------------------------------------------------------ casting


@pytest.mark.parametrize("half", HALF)
def test_cast_tree_touches_floating_leaves_only(half):
    mp = ut.MixedPrecision(MIXED[half], device=DEV)
    tree = {"x": torch.ones(2), "i": torch.tensor([1, 2]), "b": torch.tensor([True]),
            "s": 3.5, "nested": [torch.zeros(1, dtype=torch.float64), "text", (torch.ones(1),)]}
    out = mp.cast_to_compute(tree)
    assert out["x"].dtype == ut.to_dtype(half)
    assert out["i"] is tree["i"] and out["b"] is tree["b"] and out["s"] == 3.5
    assert out["nested"][0].dtype == ut.to_dtype(half) and out["nested"][1] == "text"
    assert out["nested"][2][0].dtype == ut.to_dtype(half)
    back = mp.cast_to_output(out)
    assert back["x"].dtype == torch.float32 and back["i"].dtype == torch.int64
    assert mp.cast_to_param(out)["nested"][0].dtype == torch.float32


def test_cast_tree_keeps_mapping_types():
    from collections import OrderedDict, defaultdict
    from types import MappingProxyType

    od = ut.cast_tree(OrderedDict(a=torch.ones(1)), "bf16")
    dd = ut.cast_tree(defaultdict(list, a=torch.ones(1)), "bf16")
    frozen = ut.cast_tree(MappingProxyType({"a": torch.ones(1)}), "bf16")
    assert type(od) is OrderedDict and type(dd) is defaultdict and dd.default_factory is list
    assert od["a"].dtype == dd["a"].dtype == frozen["a"].dtype == torch.bfloat16


def test_all_finite():
    assert bool(ut.all_finite({"a": torch.ones(3), "n": torch.tensor([1])}))
    assert not bool(ut.all_finite([torch.ones(2), torch.tensor([1.0, float("nan")])]))
    assert bool(ut.all_finite({"only_ints": torch.tensor([1])}))


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


def test_module_mode_masters_start_exact():
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ut.MixedPrecision(unimp.get_recipe("O2"), device=DEV).prepare(model, opt)
    for b, m in zip(before, ut.master_params(opt), strict=True):
        _assert_bitwise(b, m.detach())


# O3 (static scale 1.0) is allowed: unscaling by exactly 1 is exact (test_apex_o3_runs_pure_float16)
@pytest.mark.parametrize("recipe", ["mixed_float16", "float16"])
def test_prepare_refuses_float16_params_with_loss_scaling(recipe):
    model = _mlp().half() if recipe == "mixed_float16" else _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    forward = model.forward
    dtypes = [p.dtype for p in model.parameters()]
    with pytest.raises(ValueError, match=r"0\.weight.*loss_scale='none'"):
        ut.MixedPrecision(recipe, device=DEV).prepare(model, opt)
    assert model.forward == forward and [p.dtype for p in model.parameters()] == dtypes
    assert not getattr(model, "_unimp_prepared", False)


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


# ------------------------------------------------------------------ GradScaler vs torch.amp.GradScaler


def _run_scaler(scaler, flags, opt_factory):
    model = _mlp()
    opt = opt_factory(model.parameters())
    scales = []
    for i, ok in enumerate(flags):
        opt.zero_grad()
        x, y, _ = _batch(i)
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        if not ok:
            model[3].bias.grad[1] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return model, opt, scales


OPTS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
}


@pytest.mark.parametrize("opt_name", list(OPTS))
@settings(max_examples=8, deadline=None)
@given(flags=st.lists(st.booleans(), min_size=1, max_size=10))
def test_matches_torch_grad_scaler(opt_name, flags):
    cfg = DynamicLossScale.preset("torch", growth_interval=2)
    ref = torch.amp.GradScaler(DEV, init_scale=cfg.init_scale, growth_interval=2)
    m_ref, o_ref, s_ref = _run_scaler(ref, flags, OPTS[opt_name])
    m, o, s = _run_scaler(ut.GradScaler(cfg, device=DEV), flags, OPTS[opt_name])
    assert s == s_ref
    for a, b in zip(m.parameters(), m_ref.parameters(), strict=True):
        _assert_bitwise(a.detach(), b.detach())
    # torch's fused path leaves zero state behind a skipped first step; unimp leaves none
    assert len(o.state) == (len(o_ref.state) if any(flags) else 0)


@pytest.mark.parametrize(
    "cfg",
    [
        DynamicLossScale(init_scale=4.0, growth_interval=1, min_scale=1.0, max_scale=16.0),
        DynamicLossScale.preset("apex", growth_interval=1),
        DynamicLossScale(init_scale=2.0**127, growth_interval=1, min_scale=None, max_scale=None),
        StaticLossScale(128.0),
        NoLossScale(),
    ],
    ids=["dyn_min_max", "apex", "near_fmax", "static", "none"],
)
@settings(max_examples=10, deadline=None)
@given(flags=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=14))
def test_scaler_matches_reference(cfg, flags):
    scaler = ut.GradScaler(cfg, device=DEV)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    for grads_ok, loss_ok in flags:
        opt.zero_grad()
        # a tiny loss keeps the scaled gradients finite even at a scale of 2**127
        loss = (w * torch.tensor([1.0, 2.0])).sum() * (1e-30 if loss_ok else float("inf"))
        scaler.scale(loss).backward()
        if not grads_ok:
            w.grad[0] = float("nan")
        scaler.step(opt)
        scaler.update()
    expected = unimp.simulate(cfg, flags)[-1]
    assert scaler.state == expected


def test_forward_overflow_skips_without_backoff():
    scaler = ut.GradScaler(DynamicLossScale(init_scale=1024.0), device=DEV)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale((w * float("inf")).sum()).backward()
    applied = scaler.step(opt)
    scaler.update()
    assert not bool(applied) and torch.equal(w.detach(), torch.ones(2))
    s = scaler.state
    assert (float(s.scale), int(s.consecutive_skips), int(s.total_skips)) == (1024.0, 1, 1)


def test_unscale_twice_is_harmless():
    scaler = ut.GradScaler(StaticLossScale(8.0), device=DEV)
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler.scale((w * torch.tensor([3.0, 4.0])).sum()).backward()
    scaler.unscale_(opt)
    scaler.unscale_(opt)
    assert torch.equal(w.grad, torch.tensor([3.0, 4.0]))
    assert bool(scaler.step(opt))
    scaler.update()
    assert torch.equal(w.detach(), torch.tensor([-2.0, -2.0]))


def test_two_optimizers_share_one_scaler():
    scaler = ut.GradScaler(DynamicLossScale(init_scale=256.0), device=DEV)
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    oa, ob = torch.optim.SGD([a], lr=0.5), torch.optim.SGD([b], lr=0.5)
    scaler.scale(a.sum() + b.sum()).backward()
    a.grad[0] = float("inf")
    ra, rb = scaler.step(oa), scaler.step(ob)
    scaler.update()
    assert not bool(ra) and bool(rb)
    assert torch.equal(a.detach(), torch.ones(2)) and torch.equal(b.detach(), torch.full((2,), 0.5))
    assert scaler.get_scale() == 128.0 and int(scaler.state.total_skips) == 1  # one update


def test_scaler_refuses_float16_grads_naming_params():
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = ut.GradScaler("dynamic", device=DEV)
    scaler.scale(w.float().sum()).backward()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*master weights"):
        scaler.unscale_(opt)


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        (dict(loss_scale="bogus"), ValueError),
        (dict(loss_scale=StaticLossScale(2.0), growth_interval=5), ValueError),
        (dict(loss_scale=None, growth_intervall=5), TypeError),
        (dict(loss_scale=None, device="nope"), ValueError),
    ],
)
def test_scaler_bad_input(kwargs, exc):
    with pytest.raises(exc):
        ut.GradScaler(**kwargs)


def test_scaler_accepts_torch_signature():
    s = ut.GradScaler(DEV, init_scale=1024, growth_interval=7)
    assert s.get_scale() == 1024.0 and s.config.growth_interval == 7 and s.device == torch.device(DEV)
    assert ut.GradScaler(enabled=False, device=DEV).is_enabled() is False


# ------------------------------------------------------------------ state dicts


def _used_scaler(cfg=None):
    s = ut.GradScaler(cfg or DynamicLossScale(init_scale=64.0, growth_interval=3), device=DEV)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    for bad in (False, True, False):
        opt.zero_grad()
        s.scale(w.sum()).backward()
        if bad:
            w.grad[0] = float("inf")
        s.step(opt)
        s.update()
    return s


@pytest.mark.parametrize("source", ["fresh", "used", "disabled"])
@pytest.mark.parametrize("target", ["fresh", "used"])
def test_state_dict_round_trip(source, target):
    src = {
        "fresh": lambda: ut.GradScaler(DynamicLossScale(init_scale=32.0), device=DEV),
        "used": _used_scaler,
        "disabled": lambda: ut.GradScaler(StaticLossScale(4.0), device=DEV, enabled=False),
    }[source]()
    sd = json.loads(json.dumps(src.state_dict()))
    dst = ut.GradScaler(device=DEV) if target == "fresh" else _used_scaler(DynamicLossScale.preset("jmp"))
    dst.load_state_dict(sd)
    assert dst.state_dict() == sd and dst.config == src.config


def test_used_state_dict_values():
    sd = _used_scaler().state_dict()
    assert sd["format"] == "unimp.loss_scale/1"
    assert sd["state"] == {"scale": 32.0, "counter": 1, "consecutive_skips": 0, "total_skips": 1}


def test_loads_torch_grad_scaler_state_dict():
    ref = torch.amp.GradScaler(DEV, init_scale=512.0, growth_interval=10)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(3):
        ref.scale(w.sum()).backward()
        ref.step(opt)
        ref.update()
    s = ut.GradScaler(device=DEV)
    s.load_state_dict(ref.state_dict())
    assert s.get_scale() == 512.0 and int(s.state.counter) == 3 and s.config.growth_interval == 10


@pytest.mark.parametrize(
    "bad, match",
    [
        ({}, "empty state_dict"),
        ({"format": "unimp.loss_scale/1", "config": {"kind": "dynamic"}, "state": {"scale": 1.0}}, "missing"),
        ({"scale": 2.0, "_growth_tracker": 0}, "missing"),
        ({"format": "other"}, "format"),
        ("nope", "dict"),
    ],
)
def test_bad_state_dict_changes_nothing(bad, match):
    s = _used_scaler()
    before = s.state_dict()
    with pytest.raises(ValueError, match=match):
        s.load_state_dict(bad)
    assert s.state_dict() == before


# ------------------------------------------------------------------ skips leave everything bitwise unchanged

SKIP_OPTS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5),
    "sgd_plain": lambda p: torch.optim.SGD(p, lr=0.1),  # keeps no state at all
}


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("opt_name", list(SKIP_OPTS))
def test_skip_leaves_params_and_optimizer_state_bitwise(half, opt_name):
    mp = ut.MixedPrecision(unimp.get_recipe(MIXED[half], loss_scale="dynamic"), device=DEV)
    model = _mlp()
    opt = SKIP_OPTS[opt_name](model.parameters())
    step = mp.train_step(model, opt, _loss)
    first = step(_batch(0, bad=True))  # skipped first step: the lazy state must not appear
    assert not first.applied and opt.state == {} or all(not s for s in opt.state.values())
    assert step(_batch(1)).applied
    params = [p.detach().clone() for p in model.parameters()]
    state = _state_copy(opt)
    r = step(_batch(2, bad=True))
    assert (r.applied, r.grads_finite, r.loss_finite) == (False, False, True)
    for a, b in zip(model.parameters(), params, strict=True):
        _assert_bitwise(a.detach(), b)
    assert set(opt.state) == set(state)
    for p, s in opt.state.items():
        for k, v in s.items():
            if torch.is_tensor(v):
                _assert_bitwise(v, state[p][k])
            else:
                assert v == state[p][k]
    assert any("step" in s for s in opt.state.values()) == ("adam" in opt_name or "rms" in opt_name)


FIRST_STEP_OPTS = {
    # dampening != 0: a zero momentum buffer left by a skipped first step would change the next
    # update (SGD initialises the buffer from the first gradient)
    "sgd_dampening": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.5),
    # fused SGD allocates its buffers with torch.empty_like on the first step; torch.amp's
    # GradScaler leaves that uninitialised memory behind when the first step overflows
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("opt_name", list(FIRST_STEP_OPTS))
def test_skipped_first_step_then_same_as_fresh(opt_name):
    runs = []
    for skip_first in (False, True):
        mp = ut.MixedPrecision("mixed_bfloat16", device=DEV)
        model = _mlp()
        opt = FIRST_STEP_OPTS[opt_name](model.parameters())
        step = mp.train_step(model, opt, _loss)
        if skip_first:
            step(_batch(0, bad=True))
        step(_batch(1))
        step(_batch(2))
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs, strict=True):
        _assert_bitwise(a, b)


# ------------------------------------------------------------------ train step right values


RIGHT_VALUE_RECIPES = ["float32", "mixed_float16", "mixed_bfloat16"]


def _right_value_step(max_grad_norm=1.0, grad=(3.0, 4.0), recipe="float32", **kw):
    mp = ut.MixedPrecision(unimp.get_recipe(recipe, loss_scale=StaticLossScale(2.0**16)), device=DEV)
    w = torch.nn.Parameter(torch.zeros(2))
    model = torch.nn.Module()
    model.w = w
    opt = torch.optim.SGD([w], lr=1.0)
    step = mp.train_step(model, opt, lambda m, b: (m.w * b).sum(), max_grad_norm=max_grad_norm, **kw)
    return step, w, torch.tensor(grad)


@pytest.mark.parametrize("recipe", RIGHT_VALUE_RECIPES)
def test_clipping_on_unscaled_gradients(recipe):
    step, w, g = _right_value_step(recipe=recipe)
    r = step(g)
    assert r.scale == 65536.0 and r.grad_norm == 5.0 and r.applied
    torch.testing.assert_close(w.detach(), torch.tensor([-0.6, -0.8]), rtol=0, atol=0)


@pytest.mark.parametrize("recipe", RIGHT_VALUE_RECIPES)
def test_clipping_with_inf_gradient_skips(recipe):
    step, w, g = _right_value_step(grad=(3.0, float("inf")), recipe=recipe)
    r = step(g)
    assert not np.isfinite(r.grad_norm) and r.applied is False and r.grads_finite is False
    assert torch.equal(w.detach(), torch.zeros(2))


def test_no_clipping_reports_no_norm():
    step, w, g = _right_value_step(max_grad_norm=None)
    r = step(g)
    assert r.grad_norm is None and torch.equal(w.detach(), torch.tensor([-3.0, -4.0]))


@pytest.mark.parametrize("half", HALF)
def test_step_result_fields(half):
    mp = ut.MixedPrecision(MIXED[half], device=DEV)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = mp.prepare(model, opt)
    step = mp.train_step(model, opt, _loss, max_grad_norm=10.0)
    r = step(_batch(0))
    d = r.as_dict()
    assert set(d) == set(unimp.step.STEP_FIELDS)
    assert isinstance(d["loss"], float) and np.isfinite(d["loss"])
    assert d["scale"] == (32768.0 if half == "float16" else 1.0)
    assert (d["applied"], d["loss_finite"], d["grads_finite"]) == (True, True, True)
    assert (d["consecutive_skips"], d["total_skips"]) == (0, 0)
    r2 = step(_batch(1, bad=True))
    assert (r2.applied, r2.consecutive_skips, r2.total_skips) == (False, 1, 1)
    assert r2.scale == d["scale"]  # the scale used for the step, before the update


def test_forward_overflow_in_train_step():
    mp = ut.MixedPrecision("mixed_float16", device=DEV)
    w = torch.nn.Parameter(torch.ones(2))
    model = torch.nn.Module()
    model.w = w
    step = mp.train_step(model, torch.optim.SGD([w], lr=0.1), lambda m, b: (m.w * b).sum())
    r = step(torch.tensor([float("inf"), 1.0]))
    assert (r.loss_finite, r.applied, r.scale) == (False, False, 32768.0)
    assert step.scaler.get_scale() == 32768.0 and torch.equal(w.detach(), torch.ones(2))


def test_max_consecutive_skips_raises_on_read():
    cfg = DynamicLossScale(init_scale=8.0, max_consecutive_skips=2)
    mp = ut.MixedPrecision(unimp.get_recipe("mixed_bfloat16", loss_scale=cfg), device=DEV)
    model = _mlp()
    step = mp.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss)
    results = [step(_batch(i, bad=True)) for i in range(3)]
    assert results[1].total_skips == 2
    with pytest.raises(LossScaleError, match="stuck"):
        _ = results[2].applied


# ------------------------------------------------------------------ accumulation


@pytest.mark.parametrize("half", HALF)
def test_accumulation_is_the_mean_of_micro_batches(half):
    mp = ut.MixedPrecision(unimp.get_recipe(MIXED[half], loss_scale=StaticLossScale(1024.0)), device=DEV)
    w = torch.nn.Parameter(torch.zeros(3))
    model = torch.nn.Module()
    model.w = w
    opt = torch.optim.SGD([w], lr=1.0)
    step = mp.train_step(model, opt, lambda m, b: (m.w * b).sum(), grad_accum_steps=2)
    r = step([torch.tensor([1.0, 2.0, 4.0]), torch.tensor([3.0, 6.0, 0.0])])
    assert r.applied and r.loss == 0.0
    assert torch.equal(w.detach(), torch.tensor([-2.0, -4.0, -2.0]))
    assert w.grad is None  # buffer reset


def test_accumulation_window_skipped_whole():
    mp = ut.MixedPrecision("mixed_bfloat16", device=DEV)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = mp.train_step(model, opt, _loss, grad_accum_steps=3)
    step([_batch(0), _batch(1), _batch(2)])
    params, state = [p.detach().clone() for p in model.parameters()], _state_copy(opt)
    r = step([_batch(3), _batch(4, bad=True), _batch(5)])
    assert not r.applied and r.total_skips == 1
    for a, b in zip(model.parameters(), params, strict=True):
        _assert_bitwise(a.detach(), b)
    for p, s in opt.state.items():
        _assert_bitwise(s["momentum_buffer"], state[p]["momentum_buffer"])
    assert all(p.grad is None for p in model.parameters())
    # the next window starts from exact zeros: equal to a fresh single window on its batches
    r2 = step([_batch(6), _batch(7), _batch(8)])
    assert r2.applied


@pytest.mark.parametrize(
    "kwargs, batch, exc, match",
    [
        (dict(grad_accum_steps=0), None, ValueError, "grad_accum_steps"),
        (dict(grad_accum_steps=True), None, ValueError, "grad_accum_steps"),
        (dict(max_grad_norm=-1.0), None, ValueError, "max_grad_norm"),
        (dict(max_grad_norm=float("nan")), None, ValueError, "max_grad_norm"),
        (dict(scheduler=object()), None, TypeError, "scheduler"),
        (dict(grad_accum_steps=2), "one", ValueError, "list of 2 micro-batches"),
        (dict(grad_accum_steps=2), [1, 2, 3], ValueError, "length 3"),
    ],
)
def test_train_step_bad_input(kwargs, batch, exc, match):
    mp = ut.MixedPrecision("mixed_bfloat16", device=DEV)
    model = _mlp()
    with pytest.raises(exc, match=match):
        step = mp.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, **kwargs)
        step(batch)


def test_non_scalar_loss_raises_and_leaves_no_grads():
    mp = ut.MixedPrecision("mixed_bfloat16", device=DEV)
    model = _mlp()
    step = mp.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b[0]))
    with pytest.raises(ValueError, match="scalar"):
        step(_batch(0))
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------ scheduler


def test_scheduler_advances_only_on_applied_steps():
    mp = ut.MixedPrecision("mixed_float16", device=DEV)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    step = mp.train_step(model, opt, _loss, scheduler=sched)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lrs = []
        for i, bad in enumerate([True, False, True, False]):
            r = step(_batch(i, bad=bad))
            lrs.append(opt.param_groups[0]["lr"])
            assert r.applied is (not bad)
    assert lrs == [1.0, 0.5, 0.5, 0.25]
    assert all(int(s["step"]) == 2 for s in opt.state.values())


# ------------------------------------------------------------------ no host sync


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adamw_fused", "sgd_plain"])
def test_step_does_not_sync(opt_name, monkeypatch):
    mp = ut.MixedPrecision("mixed_float16", device=DEV)
    model = _mlp()
    opt = SKIP_OPTS[opt_name](model.parameters())
    step = mp.train_step(model, opt, _loss, max_grad_norm=1.0)
    step(_batch(0))  # creates the optimizer state (the one step that may sync)

    def no_sync(*a, **k):
        raise AssertionError("host sync during a step")

    for name in ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    results = [step(_batch(i, bad=(i == 2))) for i in range(1, 4)]
    monkeypatch.undo()
    assert [r.applied for r in results] == [True, False, True]


# ------------------------------------------------------------------ train step state dict


def test_train_step_state_dict_round_trip():
    mp = ut.MixedPrecision("mixed_float16", device=DEV)
    model = _mlp()
    step = mp.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss)
    step(_batch(0, bad=True))
    sd = step.state_dict()
    assert sd["state"] == {"scale": 16384.0, "counter": 0, "consecutive_skips": 1, "total_skips": 1}
    other = mp.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss)
    other.load_state_dict(sd)
    assert other.state_dict() == sd


def test_device_info_lists_cpu():
    info = ut.device_info()
    assert info[0]["device"] == "cpu" and info[0]["bfloat16"] is True
    assert info[0]["kind"] == "cpu" and info[0]["recommended"] == "float32"  # core rule: device_support
    assert ut.framework_version() == torch.__version__


def test_update_with_new_scale():
    s = _used_scaler()
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    s.scale(w.sum()).backward()
    s.step(opt)
    s.update(new_scale=8.0)
    assert s.get_scale() == 8.0 and int(s.state.counter) == 2
    s.scale(w.sum()).backward()
    s.step(opt)
    with pytest.raises(ValueError, match="outside"):
        s.update(new_scale=0.5)  # below min_scale=1
    assert s.get_scale() == 8.0


def test_update_without_step_raises():
    with pytest.raises(RuntimeError, match="no unscale_"):
        ut.GradScaler(device=DEV).update()


def test_module_mode_moves_existing_optimizer_state_to_masters():
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y, _ = _batch(0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    steps = sorted(int(s["step"]) for s in opt.state.values())
    model, opt = ut.MixedPrecision("O2", device=DEV).prepare(model, opt)
    assert set(opt.state) == set(ut.master_params(opt))
    assert sorted(int(s["step"]) for s in opt.state.values()) == steps


@pytest.mark.parametrize("args", [["--recipe", "mixed_bfloat16"], ["--loop", "scaler", "--recipe", "O2"]])
def test_mlp_example_runs(args):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "torch_mlp.py"), "--steps", "3", *args],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "last" in out.stdout


def test_module_mode_checkpoints_carry_the_masters():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ut.MixedPrecision("O2", device=DEV).prepare(model, opt)
    step = ut.MixedPrecision("O2", device=DEV).train_step(model, opt, _loss)
    step(_batch(0))
    sd = model.state_dict()
    masters = list(ut.master_params(opt))
    assert sd["0.weight"].dtype == torch.float32 and torch.equal(sd["0.weight"], masters[0].detach())
    plain = _mlp(seed=1)
    plain.load_state_dict(sd)  # loads into a float32 model without loss
    assert torch.equal(plain[0].weight, masters[0].detach())
    model.load_state_dict(_mlp(seed=2).state_dict())
    assert torch.equal(masters[0].detach(), _mlp(seed=2)[0].weight.detach())
    step(_batch(1))  # the next step starts from the loaded weights, not the old masters
    assert not torch.equal(masters[0].detach(), plain[0].weight.detach())
    assert torch.equal(model[0].weight, masters[0].detach().half())


@pytest.mark.parametrize(
    "setter, value",
    [("set_growth_factor", 0.5), ("set_backoff_factor", 2.0), ("set_growth_interval", 0)],
)
def test_scaler_setters_validate(setter, value):
    s = ut.GradScaler(device=DEV)
    before = s.config
    with pytest.raises(ValueError):
        getattr(s, setter)(value)
    assert s.config == before


def test_scaler_setters_and_getters():
    s = ut.GradScaler(device=DEV)
    s.set_growth_factor(4.0)
    s.set_backoff_factor(0.25)
    s.set_growth_interval(10)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (4.0, 0.25, 10)


# ---- found by a bad-input review ------------------------------------------------------------


def test_failed_accumulation_window_leaves_nothing_behind():
    mp = ut.MixedPrecision("mixed_float16", device="cpu")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(0)
    ref_model = torch.nn.Linear(4, 2)
    ref_model, ref_opt = ut.MixedPrecision("mixed_float16", device="cpu").prepare(
        ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1)
    )
    x, y = torch.ones(3, 4), torch.zeros(3, 2)

    def loss_fn(m, mb):
        if mb is None:
            raise RuntimeError("bad micro-batch")
        return ((m(mb[0]).float() - mb[1]) ** 2).mean()

    step = mp.train_step(model, opt, loss_fn, grad_accum_steps=2)
    with pytest.raises(RuntimeError, match="bad micro-batch"):
        step([(x * float("nan"), y), None])
    assert all(p.grad is None for p in model.parameters())
    r = step([(x, y), (x, y)])
    assert r.applied and r.loss_finite
    ref = ut.MixedPrecision("mixed_float16", device="cpu").train_step(ref_model, ref_opt, loss_fn, grad_accum_steps=2)
    ref([(x, y), (x, y)])
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "new_scale,needle",
    [
        (torch.tensor(float("inf")), "outside"),
        (torch.tensor(0.0), "outside"),
        (torch.tensor(float("nan")), "outside"),
        (torch.tensor([1.0, 2.0]), "one-element"),
        ("abc", "number"),
    ],
    ids=["inf", "zero", "nan", "shape", "string"],
)
def test_update_new_scale_is_validated_before_anything_changes(new_scale, needle):
    s = ut.GradScaler(unimp.DynamicLossScale(init_scale=8.0, growth_interval=1), device="cpu")
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    s.scale(w.sum()).backward()
    s.step(opt)
    with pytest.raises(ValueError, match=needle):
        s.update(new_scale)
    assert s.get_scale() == 8.0
    s.update()
    assert s.get_scale() == 16.0


def test_static_scale_cannot_be_moved():
    s = ut.GradScaler(unimp.StaticLossScale(2.0), device="cpu")
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    s.scale(w.sum()).backward()
    s.step(opt)
    with pytest.raises(ValueError, match="cannot change"):
        s.update(4.0)


def test_apex_o3_runs_pure_float16():
    mp = ut.MixedPrecision("O3", device="cpu")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mp.prepare(model, opt)
    assert next(model.parameters()).dtype == torch.float16
    step = mp.train_step(model, opt, lambda m, b: m(b).float().pow(2).mean())
    r = step(torch.ones(3, 4))
    assert r.applied and r.scale == 1.0


def test_cuda_device_without_cuda_is_a_value_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        ut.GradScaler(device="cuda")


def test_loss_of_shape_1_is_refused_like_the_other_backends():
    mp = ut.MixedPrecision("mixed_float16", device="cpu")
    model = torch.nn.Linear(2, 1)
    step = mp.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).sum().reshape(1))
    with pytest.raises(ValueError, match="0-d"):
        step(torch.ones(1, 2))


# ---- pure float16 with an adaptive optimizer ---------------------------------------------


def test_pure_float16_adam_warns_once_per_optimizer():
    mp = ut.MixedPrecision("O3", device=DEV)  # pure float16, static scale 1
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    with pytest.warns(unimp.HalfOptimizerStateWarning, match="Adam keeps its moments in float16.*becomes 0"):
        model, opt = mp.prepare(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.train_step(model, opt, lambda m, b: m(b).float().sum())  # said once already


@pytest.mark.parametrize(
    "recipe,make_opt",
    [
        ("O3", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),  # no second moment
        ("O3", lambda ps: torch.optim.Adam(ps, eps=1e-4)),  # the pure-float16 mitigation
        ("O2", lambda ps: torch.optim.Adam(ps)),  # float32 master weights
        ("bf16-true", lambda ps: torch.optim.Adam(ps)),  # bfloat16 has float32's range
    ],
)
def test_no_half_state_warning_where_the_state_is_safe(recipe, make_opt):
    mp = ut.MixedPrecision(recipe, device=DEV)
    model = torch.nn.Linear(3, 2)
    opt = make_opt(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", unimp.HalfOptimizerStateWarning)
        model, opt = mp.prepare(model, opt)
        mp.train_step(model, opt, lambda m, b: m(b).float().sum())


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.Adam(ps, eps=np.float32(1e-3)),
        lambda ps: torch.optim.Adam(ps, eps=torch.tensor(1e-3)),
    ],
    ids=["numpy-eps", "tensor-eps"],
)
def test_half_state_check_reads_any_numeric_eps(make_opt):
    model = torch.nn.Linear(3, 2)
    opt = make_opt(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", unimp.HalfOptimizerStateWarning)
        ut.MixedPrecision("O3", device=DEV).prepare(model, opt)


def test_frozen_float16_params_are_not_optimizer_state():
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    opt = torch.optim.Adam([model.bias])  # only a frozen parameter
    with warnings.catch_warnings():
        warnings.simplefilter("error", unimp.HalfOptimizerStateWarning)
        ut.MixedPrecision("O3", device=DEV).prepare(model, opt)
