"""torch backend, ``scaling``: the loss-scale state and its update against the reference and the framework's own scaler."""


import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import unimp
import unimp.backends.torch as ut
from backends.torch.helpers import (
    DEV,
    _assert_bitwise,
    _batch,
    _mlp,
)
from unimp.loss_scale import DynamicLossScale, NoLossScale, StaticLossScale


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
    assert scaler.step(opt) is None  # skipped (SGD returns None either way)
    scaler.update()
    assert torch.equal(w.detach(), torch.ones(2))
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
    assert scaler.step(opt) is None  # what SGD.step() returns
    scaler.update()
    assert torch.equal(w.detach(), torch.tensor([-2.0, -2.0]))


def test_two_optimizers_share_one_scaler():
    scaler = ut.GradScaler(DynamicLossScale(init_scale=256.0), device=DEV)
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    oa, ob = torch.optim.SGD([a], lr=0.5), torch.optim.SGD([b], lr=0.5)
    scaler.scale(a.sum() + b.sum()).backward()
    a.grad[0] = float("inf")
    assert scaler.step(oa) is None and scaler.step(ob) is None
    scaler.update()
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
    assert sd["state"] == {"scale": 32.0, "counter": 1, "consecutive_skips": 0, "total_skips": 1,
                           "hysteresis_used": 0, "overflows_since_rescale": 0, "steps_since_rescale": 0,
                           "floor_hits": 0}


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


_TORCH_SD = {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
             "_growth_tracker": 0}  # torch.amp.GradScaler("cpu").state_dict() of torch 2.x


@pytest.mark.parametrize(
    "bad, match",
    [
        ({}, "empty state_dict"),
        ({"format": "unimp.loss_scale/1", "config": {"kind": "dynamic"}, "state": {"scale": 1.0}}, "missing"),
        ({"scale": 2.0, "_growth_tracker": 0}, "missing"),
        (_TORCH_SD | {"scale": "abc"}, "'scale' must be a number, got 'abc'"),
        (_TORCH_SD | {"scale": None}, "'scale' must be a number"),
        (_TORCH_SD | {"_growth_tracker": 2.5}, "'_growth_tracker' must be an int, got 2.5"),  # was cut to 2
        (_TORCH_SD | {"_growth_tracker": "3"}, "'_growth_tracker' must be an int"),  # was read as 3
        (_TORCH_SD | {"growth_interval": True}, "'growth_interval' must be an int"),
        (_TORCH_SD | {"_growth_tracker": 2**40}, r"'_growth_tracker' must be an int in \[0, 2\*\*31 - 1\]"),  # was an OverflowError
        (_TORCH_SD | {"_growth_tracker": -1}, r"'_growth_tracker' must be an int in \[0"),
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


def test_update_with_new_scale():
    s = _used_scaler()
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    s.scale(w.sum()).backward()
    s.step(opt)
    s.update(new_scale=8.0)
    # as torch.amp.GradScaler: the growth counter stays (1 from _used_scaler's last step), the
    # skip counters still record the step
    assert s.get_scale() == 8.0 and int(s.state.counter) == 1 and int(s.state.total_skips) == 1
    s.scale(w.sum()).backward()
    s.step(opt)
    with pytest.raises(ValueError, match="outside"):
        s.update(new_scale=0.5)  # below min_scale=1
    assert s.get_scale() == 8.0


@settings(max_examples=12, deadline=None)
@given(
    plan=st.lists(
        st.tuples(st.booleans(), st.sampled_from([None, None, 4.0, 512.0]), st.booleans()),
        min_size=1, max_size=10,
    )
)
def test_update_new_scale_matches_torch_grad_scaler(plan):
    # each entry: (gradients finite, new_scale or None, step before the update); torch sets
    # the scale and leaves its growth tracker, with or without a step since the last update
    ref = torch.amp.GradScaler(DEV, init_scale=64.0, growth_interval=3)
    ours = ut.GradScaler(DynamicLossScale.preset("torch", init_scale=64.0, growth_interval=3), device=DEV)
    for scaler in (ref, ours):
        w = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([w], lr=0.1)
        for i, (finite, new_scale, stepped) in enumerate(plan):
            if stepped or new_scale is None or i == 0:  # torch's scale is made by the first scale()
                opt.zero_grad()
                scaler.scale(w.sum()).backward()
                if not finite:
                    w.grad[0] = float("inf")
                scaler.step(opt)
            scaler.update(new_scale)
    assert ours.get_scale() == ref.get_scale()
    assert int(ours.state.counter) == int(ref.state_dict()["_growth_tracker"])


def test_update_without_step_raises():
    with pytest.raises(RuntimeError, match="no unscale_"):
        ut.GradScaler(device=DEV).update()


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


class _Returning(torch.optim.SGD):
    """An SGD whose step returns a value without a closure (unlike torch's optimizers)."""

    def step(self, closure=None):
        super().step(closure)
        return "stepped"


@pytest.mark.parametrize(
    "make",
    [lambda: ut.GradScaler(device=DEV), lambda: torch.amp.GradScaler("cpu", init_scale=1024.0)],
    ids=["unimp", "torch.amp"],
)
def test_step_returns_what_the_optimizers_step_returns_or_none_when_skipped(make):
    # torch.amp.GradScaler.step: retval = optimizer.step(*args, **kwargs), None on a skipped
    # step; a closure passed positionally runs on an applied step only (LBFGS's loss comes
    # back), and closure= is refused. The same code runs on both classes.
    scaler = make()
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.LBFGS([w], lr=0.1, max_iter=1)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = (w * w).sum()
        loss.backward()
        return loss

    scaler.scale((w * w).sum()).backward()
    ret = scaler.step(opt, closure)
    scaler.update()
    assert isinstance(ret, torch.Tensor) and float(ret.detach()) == 5.0 and calls == [1]
    opt.zero_grad()
    scaler.scale((w * float("inf")).sum()).backward()
    assert scaler.step(opt, closure) is None and calls == [1]  # skipped: no closure call
    scaler.update()
    with pytest.raises(RuntimeError, match="Closure use is not currently supported if GradScaler is enabled"):
        scaler.step(opt, closure=closure)
    r = _Returning([w], lr=0.1)
    r.zero_grad()
    scaler.scale(w.sum()).backward()
    assert scaler.step(r) == "stepped"
    scaler.update()
    r.zero_grad()
    scaler.scale(w.sum() * float("inf")).backward()
    assert scaler.step(r) is None


def test_a_parameter_listed_twice_is_unscaled_once():
    # torch's optimizers warn about a duplicated parameter and allow it; unscaling it twice
    # (torch.amp's GradScaler does) would divide its gradient by scale**2
    scaler = ut.GradScaler(StaticLossScale(8.0), device=DEV)
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = torch.optim.SGD([w, w], lr=0.1)
    scaler.scale((w * torch.tensor([3.0, 4.0])).sum()).backward()
    scaler.unscale_(opt)
    assert torch.equal(w.grad, torch.tensor([3.0, 4.0]))


# the public step calls (begin_step .. end_step) an engine runs, fused and on the reference path
STEP_CONFIGS = {
    "fused": DynamicLossScale(init_scale=2.0**10, growth_interval=2),
    "reference": DynamicLossScale(init_scale=2.0**10, growth_interval=2, hysteresis=2),
}


@pytest.mark.parametrize("cfg", list(STEP_CONFIGS))
def test_the_public_step_calls_are_the_train_steps(cfg):
    """An engine driving GradScaler's public step calls by hand gets the train step's results,
    parameters and loss-scale state, bit for bit, through clean, overflowing and forward
    overflowing steps (the train step calls nothing else of the scaler)."""
    from backends.torch.helpers import _loss

    config = STEP_CONFIGS[cfg]
    assert ut.scaling.fused_rule(config) == (cfg == "fused")
    events = ["ok", "grads", "ok", "loss", "ok", "ok"]
    mp = ut.MixedPrecision(unimp.get_recipe("mixed_float16", loss_scale=config), device=DEV)
    model, by_hand = _mlp(), _mlp()
    step = mp.train_step(model, torch.optim.Adam(model.parameters(), lr=1e-2, fused=True), _loss)
    opt = torch.optim.Adam(by_hand.parameters(), lr=1e-2, fused=True)
    sc = ut.GradScaler(config, device=DEV)
    for i, event in enumerate(events):
        x, y, _ = _batch(i)
        if event == "loss":
            x[0, 0] = float("nan")
        r = step((x, y, event == "grads"))
        scale = sc.begin_step()
        with mp.autocast():
            loss = _loss(by_hand, (x, y, event == "grads"))
        (loss * scale).backward()
        sc.record_loss(loss.detach())
        sc.unscale_(opt)
        grads_finite = None if sc.loss_finite is None else sc.found_inf(opt) == 0
        loss_finite = sc.loss_finite
        applied = sc.apply_step(opt)
        fields, _ = sc.end_step(grads_finite, loss_finite)
        opt.zero_grad(set_to_none=True)
        raw = {"applied": applied, "loss_finite": loss_finite, "grads_finite": grads_finite, **fields}
        for name in ("applied", "loss_finite", "grads_finite", "consecutive_skips", "total_skips"):
            assert ut.scaling.to_host(raw[name]) == getattr(r, name), (i, name)
        assert r.applied == (event == "ok")
    assert sc.state == step.scaler.state
    for a, b in zip(model.parameters(), by_hand.parameters(), strict=True):
        _assert_bitwise(a.detach(), b.detach())


def test_the_public_step_calls_refuse_misuse():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sc = ut.GradScaler(DynamicLossScale(), device=DEV)
    with pytest.raises(RuntimeError, match=r"unscale_\(optimizer\) first"):
        sc.found_inf(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(optimizer\) first"):
        sc.mark_non_finite(opt, torch.tensor(True))
    before = sc.loss_finite
    with pytest.raises(TypeError, match="0-d bool tensor"):
        sc.loss_finite = 1.0
    with pytest.raises(TypeError, match="0-d bool tensor"):
        sc.loss_finite = torch.tensor([True])
    assert sc.loss_finite is before  # a refused value changes nothing
    x, y, _ = _batch(0)
    sc.begin_step()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    sc.unscale_(opt)
    sc.abort_step()  # a step that raised: the half-done unscale_ is forgotten
    with pytest.raises(RuntimeError, match=r"unscale_\(optimizer\) first"):
        sc.found_inf(opt)
    assert sc.loss_finite is not None and bool(sc.loss_finite)


def _begun(config=None):
    """A scaler with one step begun and its backward done: (scaler, model, optimizer, loss)."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    sc = ut.GradScaler(config or DynamicLossScale(), device=DEV)
    scale = sc.begin_step()
    x, y, _ = _batch(0)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    (loss * scale).backward()
    sc.record_loss(loss.detach())
    return sc, model, opt, loss


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
def test_the_step_calls_refuse_a_wrong_order_and_change_nothing(fused):
    """What the breaker found: a second apply_step stepped again, a second begin_step applied
    gradients still times the scale, end_step without a step moved the counter, a float flag in
    mark_non_finite stepped a fused optimizer on a reported skip, and a copy mid-step lost the
    loss flag. Each is refused before anything changes."""
    import copy

    config = DynamicLossScale() if fused else DynamicLossScale(hysteresis=2)
    sc, model, opt, loss = _begun(config)
    with pytest.raises(RuntimeError, match="a step is in progress"):
        sc.begin_step()
    sc.unscale_(opt)
    with pytest.raises(TypeError, match="0-d bool tensor"):
        sc.mark_non_finite(opt, torch.tensor(0.5))
    with pytest.raises(RuntimeError, match="only between steps"):
        copy.deepcopy(sc)
    if fused:
        with pytest.raises(RuntimeError, match="inside a fused step"):
            sc.loss_finite = torch.tensor(False)
    before = [p.detach().clone() for p in model.parameters()]
    sc.apply_step(opt)
    after = [p.detach().clone() for p in model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    with pytest.raises(RuntimeError, match="already"):
        sc.apply_step(opt)
    assert all(torch.equal(a, p) for a, p in zip(after, model.parameters(), strict=True))
    grads_finite = None if fused else sc.found_inf(opt) == 0
    sc.end_step(grads_finite, None if fused else sc.loss_finite)
    state = sc.state
    with pytest.raises(RuntimeError, match="found no step"):
        ut.GradScaler(config, device=DEV).end_step(torch.tensor(True), torch.tensor(True))
    copy.deepcopy(sc)  # between steps: fine
    assert sc.state == state


def test_record_loss_takes_a_scalar_floating_tensor():
    sc = ut.GradScaler(DynamicLossScale(), device=DEV)
    sc.begin_step()
    for bad in (torch.ones(8, 2), 1.0, torch.tensor(3)):
        with pytest.raises(TypeError, match="0-d floating tensor"):
            sc.record_loss(bad)
