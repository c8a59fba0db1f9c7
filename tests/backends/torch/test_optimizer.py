"""torch backend, ``optimizer``: a skipped step leaves the parameters and the optimizer state unchanged; half optimizer state."""


import warnings

import numpy as np
import pytest
import torch

import unimp
import unimp.backends.torch as ut
from backends.torch.helpers import (
    DEV,
    HALF,
    MIXED,
    SKIP_OPTS,
    _assert_bitwise,
    _batch,
    _loss,
    _mlp,
    _state_copy,
)


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


# the warning and where it is not said (every backend): tests/conformance/test_half_state_warning.py


def test_no_half_state_warning_for_module_modes_float32_masters():
    mp = ut.MixedPrecision("O2", device=DEV)  # float16 model weights, float32 master weights
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
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


class _AmpAwareSGD(torch.optim.SGD):
    """A custom optimizer on torch.amp's contract: ``_step_supports_amp_scaling`` and a step that
    reads ``self.grad_scale`` (None once unscaled) and ``self.found_inf`` (nonzero: skip)."""

    _step_supports_amp_scaling = True

    def step(self, closure=None):
        seen = (self.grad_scale, self.found_inf)  # AttributeError if the scaler did not set them
        self.seen.append(None if seen[0] is None else float(seen[0]))
        if float(self.found_inf) != 0:
            return None
        with torch.no_grad():
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        grad = p.grad if self.grad_scale is None else p.grad / self.grad_scale
                        p.add_(grad, alpha=-g["lr"])
        return None


@pytest.mark.parametrize("scaler_kind", ["unimp", "torch.amp"])
def test_amp_aware_optimizer_finds_grad_scale_and_found_inf(scaler_kind):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = _AmpAwareSGD(model.parameters(), lr=0.1)
    opt.seen = []
    scaler = (
        ut.GradScaler(device="cpu") if scaler_kind == "unimp" else torch.amp.GradScaler("cpu")
    )
    weights = []
    for overflow in (False, True, False):
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 3)).sum()).backward()
        if overflow:  # a gradient overflow, the loss finite
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        weights.append(model.weight.detach().clone())
    assert len(opt.seen) == 3
    torch.testing.assert_close(weights[1], weights[0], rtol=0, atol=0)  # the overflow skipped
    # one clean SGD step of d(sum)/dw = 2 per weight, lr 0.1, applied twice
    torch.manual_seed(0)
    fresh = torch.nn.Linear(3, 1).weight.detach()
    torch.testing.assert_close(weights[2], fresh - 0.4, rtol=0, atol=1e-6)


@pytest.mark.parametrize("scaler_kind", ["unimp", "torch.amp"])
@pytest.mark.parametrize("overflow", [False, True])
def test_sparse_coo_parameter_steps_like_torch_amp(scaler_kind, overflow):
    # pytorch/pytorch#35810 kind: torch.where has no sparse kernel (NotImplementedError before)
    p = torch.nn.Parameter(torch.sparse_coo_tensor([[1, 2]], [1.0, 2.0], (4,), check_invariants=True))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = ut.GradScaler(device="cpu") if scaler_kind == "unimp" else torch.amp.GradScaler("cpu")
    scaler.scale(torch.tensor(1.0))
    s = scaler.get_scale()
    bad = float("inf") if overflow else 1.0
    p.grad = torch.sparse_coo_tensor([[1, 2]], [4.0 * s, 8.0 * s * bad], (4,), check_invariants=True)
    scaler.step(opt)
    scaler.update()
    got = p.detach().to_dense().tolist()
    if overflow:
        assert got == [0.0, 1.0, 2.0, 0.0] and scaler.get_scale() == s / 2
    else:  # entries 1 and 2 with gradients 4 and 8, lr 0.1
        assert got == pytest.approx([0.0, 0.6, 1.2, 0.0], abs=1e-7)


# -- half_update (issue 32) ------------------------------------------------------------------


def _bf16_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).to(torch.bfloat16)


def _steps(model, opt, batches):
    for x in batches:
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
])
def test_half_update_resumes_bit_for_bit_from_its_state_dict(mode, make):
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 6, generator=gen).to(torch.bfloat16) for _ in range(8)]
    ref = _bf16_model()
    ref_opt = ut.half_update(make(ref.parameters()), mode, seed=5)
    _steps(ref, ref_opt, batches)
    first = _bf16_model()
    opt = ut.half_update(make(first.parameters()), mode, seed=5)
    _steps(first, opt, batches[:4])
    model_state, opt_state = first.state_dict(), opt.state_dict()
    resumed = _bf16_model()
    resumed.load_state_dict(model_state)
    opt2 = ut.half_update(make(resumed.parameters()), mode, seed=5)
    opt2.load_state_dict(opt_state)
    _steps(resumed, opt2, batches[4:])
    for a, b in zip(ref.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    state = opt2.state[resumed[0].weight]
    key = "compensation" if mode == "kahan" else "update_step"
    assert state[key].dtype == (torch.bfloat16 if mode == "kahan" else torch.int32)
    if mode == "stochastic":
        assert int(state[key]) == 8
    assert state.get("exp_avg", state.get("momentum_buffer")).dtype == torch.bfloat16


def test_half_update_refuses_a_closure_and_survives_a_step_that_raises():
    model = _bf16_model()
    opt = ut.half_update(torch.optim.Adam(model.parameters(), lr=1e-2), "kahan")
    model(torch.ones(2, 6, dtype=torch.bfloat16)).float().sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match="takes no closure"):
        opt.step(lambda: None)
    assert all(p.dtype == torch.bfloat16 for g in opt.param_groups for p in g["params"])
    # a step that raises inside the optimizer leaves the model's parameters as they were, and
    # the next step puts the optimizer's own parameters back first
    opt.param_groups[0]["betas"] = "broken"
    with pytest.raises(Exception):  # noqa: B017 (whatever Adam raises on bad betas)
        opt.step()
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b) and p.dtype == torch.bfloat16
    opt.param_groups[0]["betas"] = (0.9, 0.999)
    opt.step()
    assert [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_half_update_refuses_a_module_and_a_second_install():
    # the refusals every backend shares: tests/conformance/test_half_update.py
    model = _bf16_model()
    with pytest.raises(TypeError, match="needs a torch.optim.Optimizer, got Sequential"):
        ut.half_update(model, "kahan")
    opt = ut.half_update(torch.optim.SGD(model.parameters(), lr=1.0), "kahan")
    with pytest.raises(TypeError, match="installed on this optimizer already"):
        ut.half_update(opt, "kahan")


@pytest.mark.parametrize("skip", ["guard", "auto"])
def test_an_imported_state_survives_a_skipped_first_step(skip):
    mp = unimp.mixed_precision("bf16-kahan", "torch")
    model = torch.nn.Linear(3, 2, bias=False).to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = mp.prepare(model, opt)
    comp = np.full((2, 3), 2.0**-12, np.float32)
    ut.import_update_state(opt, {"update": "kahan", "seed": 0, "params": [{"step": 0, "compensation": comp}]})
    step = mp.train_step(model, opt, lambda m, x: m(x).float().sum(), skip=skip)
    before = model.weight.detach().clone()
    step(torch.full((1, 3), float("inf")))
    assert torch.equal(model.weight, before)
    assert set(opt.state[model.weight]) == {"compensation"}  # Adam's lazy state dropped, ours kept
    np.testing.assert_array_equal(opt.state[model.weight]["compensation"].float().numpy(), comp)
    step(torch.ones(1, 3))
    assert {"exp_avg", "compensation"} <= set(opt.state[model.weight])
    assert ut.export_update_state(opt)["params"][0]["compensation"].shape == (2, 3)


def test_half_update_breakers_found():
    # a float16 group added after install: refused before any parameter is written
    a = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt = ut.half_update(torch.optim.SGD([a], lr=0.5), "stochastic", seed=np.int64(3))
    assert peek_seed(opt) == 3  # NumPy integers are seeds, as in TensorFlow and JAX
    opt.add_param_group({"params": [b]})
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    with pytest.raises(ValueError, match="rounds float32 to bfloat16"):
        opt.step()
    assert a.tolist() == [1.0, 1.0] and not opt.state[a]
    # a counter out of int32's range: refused by the check, nothing written
    x, y = (torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16)) for _ in range(2))
    opt = ut.half_update(torch.optim.SGD([x, y], lr=1e-3), "stochastic", seed=1)
    bad = {"update": "stochastic", "seed": 5, "params": [{"step": 7, "compensation": None}, {"step": 2**31, "compensation": None}]}
    with pytest.raises(ValueError, match="in \\[0, 2\\*\\*31\\)"):
        ut.import_update_state(opt, bad)
    assert ut.export_update_state(opt)["params"] == [None, None]
    # a sparse gradient is not taken by the rule: said once
    emb = torch.nn.Embedding(4, 2, sparse=True).to(torch.bfloat16)
    opt = ut.half_update(torch.optim.SGD(emb.parameters(), lr=1e-3), "kahan")
    emb(torch.tensor([0])).sum().backward()
    with pytest.warns(UserWarning, match="sparse gradient .* rounded to nearest"):
        opt.step()


def peek_seed(opt):
    from unimp.attached import peek

    return peek(opt, "half_update").seed


def test_a_state_dict_loaded_before_installing_keeps_an_int32_counter():
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = ut.half_update(torch.optim.SGD([w], lr=1e-3), "stochastic")
    for _ in range(5):
        w.grad = torch.full_like(w, 1e-3)
        opt.step()
    w2 = torch.nn.Parameter(w.detach().clone())
    plain = torch.optim.SGD([w2], lr=1e-3)
    plain.load_state_dict(opt.state_dict())  # torch casts the counter to bfloat16 here
    ut.half_update(plain, "stochastic")
    assert plain.state[w2]["update_step"].dtype == torch.int32 and int(plain.state[w2]["update_step"]) == 5
