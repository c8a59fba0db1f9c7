

import json
import os
import subprocess
import sys

import pytest
import torch

import unimp
from unimp.compat import apex as apex_mod
from unimp.compat.apex import amp

pytestmark = pytest.mark.backend("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def fresh_amp(monkeypatch):
    monkeypatch.setattr(apex_mod, "_STATE", {"scalers": [], "mp": None, "optimizers": []})


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )


def _model_opt(opt_level, **kw):
    model = _net()
    return amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level, **kw)


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)


def _iteration(model, opt, seed=0, overflow=False, delay_unscale=False, zero=True):
    if zero:
        opt.zero_grad()
    x, y = _data(seed)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, opt, delay_unscale=delay_unscale) as scaled:
        scaled.backward()
        if overflow:
            model[3].weight.grad[0, 0] = float("inf")
    return loss


def test_amp_is_the_module():
    assert amp is apex_mod and callable(amp.initialize) and callable(amp.scale_loss)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_o1_o2_dtypes(opt_level):
    model, opt = _model_opt(opt_level)
    assert isinstance(model, torch.nn.Module)
    out = model(_data()[0])
    assert out.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in amp.master_params(opt))
    if opt_level == "O2":
        assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32
        assert {id(p) for p in amp.master_params(opt)}.isdisjoint({id(p) for p in model[0].parameters()})
    else:
        assert all(p.dtype == torch.float32 for p in model.parameters())


def test_initialize_returns_the_structure_given():
    models = [_net(), _net(1)]
    opts = [torch.optim.SGD(models[0].parameters(), lr=0.1)]
    ms, os_ = amp.initialize(models, opts, opt_level="O1")
    assert isinstance(ms, list) and len(ms) == 2 and isinstance(os_, list)
    m = amp.initialize(_net(), opt_level="O1")
    assert isinstance(m, torch.nn.Module)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_training_reduces_the_loss(opt_level):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=opt_level)
    first = _iteration(model, opt).item()
    opt.step()
    for _ in range(15):
        loss = _iteration(model, opt)
        opt.step()
    assert loss.item() < 0.8 * first


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_overflow_skips_the_next_step_bitwise(opt_level):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=opt_level)
    _iteration(model, opt)
    opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    masters = [p.detach().clone() for p in amp.master_params(opt)]
    bufs = {id(p): s["momentum_buffer"].clone() for p, s in opt.state.items()}
    _iteration(model, opt, seed=1, overflow=True)
    opt.step()
    for a, b in zip(model.parameters(), params, strict=True):
        assert torch.equal(a.detach(), b)
    for a, b in zip(amp.master_params(opt), masters, strict=True):
        assert torch.equal(a.detach(), b)
    for p, s in opt.state.items():
        assert torch.equal(s["momentum_buffer"], bufs[id(p)])
    assert amp.state_dict()["loss_scaler0"]["state"] == {"scale": 32768.0, "counter": 0, "consecutive_skips": 1, "total_skips": 1, "hysteresis_used": 0, "overflows_since_rescale": 0, "steps_since_rescale": 0, "floor_hits": 0}
    _iteration(model, opt, seed=2)
    opt.step()  # the skip lasts one step only
    assert not torch.equal(model[0].weight.detach(), params[0])


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_apex_scale_sequence_matches_reference(opt_level):
    flags = [False, True, True, False, False, True, True, True]
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, min_loss_scale=2.0**14, max_loss_scale=2.0**17)
    scaler = apex_mod._STATE["scalers"][0]
    scaler._config = scaler.config.replace(growth_interval=2)
    scales = []
    for i, ok in enumerate(flags):
        _iteration(model, opt, seed=i, overflow=not ok)
        opt.step()
        scales.append(amp.state_dict()["loss_scaler0"]["state"]["scale"])
    cfg = unimp.DynamicLossScale.preset("apex", min_scale=2.0**14, max_scale=2.0**17, growth_interval=2)
    assert scales == [float(s.scale) for s in unimp.simulate(cfg, flags)]
    assert scales == [32768.0, 32768.0, 65536.0, 32768.0, 16384.0, 16384.0, 32768.0, 32768.0]


def test_delay_unscale_accumulates_the_sum():
    ref = _net()
    x0, y0 = _data(0)
    x1, y1 = _data(1)
    (torch.nn.functional.cross_entropy(ref(x0), y0) + torch.nn.functional.cross_entropy(ref(x1), y1)).backward()
    expected = ref[0].weight.grad.clone()
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", loss_scale=128.0)
    opt.zero_grad()
    _iteration(model, opt, seed=0, delay_unscale=True, zero=False)
    assert model[0].weight.grad.abs().max() > 10 * expected.abs().max()  # still scaled
    _iteration(model, opt, seed=1, zero=False)
    torch.testing.assert_close(model[0].weight.grad, expected, rtol=2e-2, atol=1e-3)


def test_state_dict_round_trip_and_apex_format():
    model, opt = _model_opt("O1")
    _iteration(model, opt, overflow=True)
    opt.step()
    sd = json.loads(json.dumps(amp.state_dict()))
    assert list(sd) == ["loss_scaler0"] and sd["loss_scaler0"]["state"]["total_skips"] == 1
    amp.load_state_dict(sd)
    assert amp.state_dict() == sd
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 2005}})
    assert amp.state_dict()["loss_scaler0"]["state"] == {"scale": 1024.0, "counter": 5, "consecutive_skips": 0, "total_skips": 0, "hysteresis_used": 0, "overflows_since_rescale": 0, "steps_since_rescale": 0, "floor_hits": 0}


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(opt_level="o2"), ValueError, "capital O"),
        (dict(opt_level="O2", keep_batchnorm_fp32=False), ValueError, "keep_batchnorm_fp32"),
        (dict(opt_level="O2", master_weights=False), ValueError, "master_weights"),
        (dict(opt_level="O1", loss_scale="auto"), ValueError, "dynamic"),
        (dict(opt_level="O1", cast_model_type=torch.float16), TypeError, "cast_model_type"),
        (dict(opt_level="O1", num_losses=0), ValueError, "num_losses must be an int >= 1"),
        (dict(opt_level="O1", num_losses=True), ValueError, "num_losses must be an int >= 1"),
    ],
)
def test_initialize_bad_input(kwargs, exc, match):
    model = _net()
    with pytest.raises(exc, match=match):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert apex_mod._STATE["scalers"] == [] and model[0].weight.dtype == torch.float32


def test_o2_needs_the_optimizer():
    with pytest.raises(ValueError, match="one model and its one optimizer"):
        amp.initialize(_net(), opt_level="O2")


@pytest.mark.parametrize("call", ["scale_loss", "state_dict", "load_state_dict"])
def test_use_before_initialize_raises(call):
    with pytest.raises(RuntimeError, match="initialize"):
        if call == "scale_loss":
            with amp.scale_loss(torch.ones(()), None):
                pass
        elif call == "state_dict":
            amp.state_dict()
        else:
            amp.load_state_dict({})


def test_bad_state_dict_changes_nothing():
    _model_opt("O1")
    before = amp.state_dict()
    with pytest.raises(ValueError):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0}})
    assert amp.state_dict() == before


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_example_script_runs(opt_level):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "apex_o2.py"), "--opt-level", opt_level, "--steps", "12"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "final loss" in out.stdout
    with open(os.path.join(ROOT, "examples", "apex_o2.py")) as f:
        src = f.read()
    assert "from unimp.compat.apex import amp  # was: from apex import amp" in src


def test_scale_loss_refuses_an_optimizer_not_initialized():
    model, opt = _model_opt("O1")
    stranger = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not passed to amp.initialize"):
        with amp.scale_loss(model(_data()[0]).sum(), stranger):
            pass
    assert all(p.grad is None for p in model.parameters())


def _scalar_model(opt_level, **kw):
    model = torch.nn.Module()
    model.p = torch.nn.Parameter(torch.ones(()))
    return amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level, **kw)


def _master(opt):
    return next(iter(amp.master_params(opt)))


# Apex's amp.scale_loss (apex/amp/handle.py, _process_optimizer.py): the gradients present when a
# block starts are stashed, the block's own gradients unscaled and the stash added back
@pytest.mark.parametrize("opt_level, loss_scale", [("O1", None), ("O2", 1024.0)])
def test_two_backward_passes_sum_into_one_step(opt_level, loss_scale):
    model, opt = _scalar_model(opt_level, loss_scale=loss_scale)
    opt.zero_grad()
    for k in (3.0, 5.0):
        with amp.scale_loss(k * model.p, opt) as scaled:
            scaled.backward()
    assert torch.equal(_master(opt).grad, torch.tensor(8.0))  # 3 + 5, not 5.0000458
    opt.step()
    torch.testing.assert_close(_master(opt).detach(), torch.tensor(0.2))  # not 0.4999954
    assert amp.state_dict()["loss_scaler0"]["state"]["total_skips"] == 0


def test_overflow_in_the_second_pass_skips_the_step_and_halves_once():
    model, opt = _scalar_model("O1")
    opt.zero_grad()
    with amp.scale_loss(3.0 * model.p, opt) as scaled:
        scaled.backward()
    with amp.scale_loss(5e34 * model.p, opt) as scaled:  # finite loss, 5e34 * 2**16 overflows
        scaled.backward()
    with amp.scale_loss(2.0 * model.p, opt) as scaled:  # a clean pass after it checks 2 only
        scaled.backward()
    opt.step()
    assert torch.equal(model.p.detach(), torch.tensor(1.0))
    state = amp.state_dict()["loss_scaler0"]["state"]
    assert (state["scale"], state["total_skips"]) == (32768.0, 1)


def test_overflow_in_the_first_pass_skips_the_step_and_halves_once():
    model, opt = _scalar_model("O1")
    opt.zero_grad()
    with amp.scale_loss(5e34 * model.p, opt) as scaled:
        scaled.backward()
    with amp.scale_loss(5.0 * model.p, opt) as scaled:  # its own gradient is finite
        scaled.backward()
    opt.step()
    assert torch.equal(model.p.detach(), torch.tensor(1.0))
    assert amp.state_dict()["loss_scaler0"]["state"]["scale"] == 32768.0  # the second pass checks 5 only
    opt.zero_grad()
    with amp.scale_loss(5.0 * model.p, opt) as scaled:
        scaled.backward()
    opt.step()  # the skip lasts one step only
    torch.testing.assert_close(model.p.detach(), torch.tensor(0.5))


def test_apex_gradient_accumulation_over_iterations():
    # Apex's "Gradient accumulation across iterations": loss / iters_to_accumulate in each
    model, opt = _scalar_model("O1")
    opt.zero_grad()
    for _ in range(2):
        loss = 4.0 * model.p
        with amp.scale_loss(loss / 2, opt) as scaled:
            scaled.backward()
    assert torch.equal(model.p.grad, torch.tensor(4.0))  # not 2.5000229
    opt.step()
    torch.testing.assert_close(model.p.detach(), torch.tensor(0.6))


def test_delay_unscale_after_an_unscaled_pass():
    model, opt = _scalar_model("O1")
    opt.zero_grad()
    for k, delay in ((3.0, False), (5.0, True), (2.0, False)):
        with amp.scale_loss(k * model.p, opt, delay_unscale=delay) as scaled:
            scaled.backward()
    assert torch.equal(model.p.grad, torch.tensor(10.0))  # 3 is not unscaled a second time

def test_a_failed_block_leaves_the_gradients_as_they_were():
    model, opt = _scalar_model("O1")
    opt.zero_grad()
    with amp.scale_loss(3.0 * model.p, opt) as scaled:
        scaled.backward()
    with pytest.raises(KeyError):
        with amp.scale_loss(5.0 * model.p, opt) as scaled:
            scaled.backward()
            raise KeyError("in the user's block")
    assert torch.equal(model.p.grad, torch.tensor(3.0))
    with amp.scale_loss(5.0 * model.p, opt) as scaled:
        scaled.backward()
    assert torch.equal(model.p.grad, torch.tensor(8.0))


def test_a_failed_block_with_a_non_finite_loss_does_not_skip_the_next_step():
    # the user bails out of a block whose loss is inf: scale() had recorded the loss check,
    # which the failed block takes back (Apex keeps nothing of it)
    model, opt = _scalar_model("O1")
    opt.zero_grad()
    with pytest.raises(RuntimeError):
        with amp.scale_loss(float("inf") * model.p, opt):
            raise RuntimeError("non-finite loss: skip this batch")
    with amp.scale_loss(3.0 * model.p, opt) as scaled:
        scaled.backward()
    opt.step()
    assert torch.allclose(model.p.detach(), torch.tensor(0.7)) and amp.state_dict()["loss_scaler0"]["state"]["total_skips"] == 0


def test_scale_loss_doctest():
    import doctest

    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(apex_mod.scale_loss, "scale_loss", globs=vars(apex_mod).copy()):
        runner.run(test)
    assert runner.summarize(verbose=False) == (0, 7)


def test_o3_with_adam_warns_of_half_optimizer_state():
    # issue 28 item 13: the shim passes the optimizer to the check, as mp.prepare(model, adam) does
    model = _net()
    with pytest.warns(unimp.HalfOptimizerStateWarning):
        amp.initialize(model, torch.optim.Adam(model.parameters()), opt_level="O3")


def test_o3_with_adam_over_two_models_warns_of_half_optimizer_state():
    a, b = _net(0), _net(1)
    opt = torch.optim.Adam([*a.parameters(), *b.parameters()])
    with pytest.warns(unimp.HalfOptimizerStateWarning):
        amp.initialize([a, b], opt, opt_level="O3")


# --- several losses, models and optimizers (issue 35 item 4: as Apex supports them)


def _two_losses(bad_loss_id=None):
    """Two models, two optimizers, two losses (Apex's "Multiple models/optimizers/losses"):
    loss 0 trains ``a`` with ``opt_a``, loss 1 trains ``b`` with ``opt_b``; the loss named by
    ``bad_loss_id`` overflows."""
    a, b = _net(0), _net(1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    [a, b], [opt_a, opt_b] = amp.initialize([a, b], [opt_a, opt_b], opt_level="O1", num_losses=2)
    x, y = _data()
    for loss_id, (model, opt) in enumerate([(a, opt_a), (b, opt_b)]):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
            scaled.backward()
            if loss_id == bad_loss_id:
                model[3].weight.grad[0, 0] = float("inf")
    before = [[p.detach().clone() for p in m.parameters()] for m in (a, b)]
    opt_a.step()
    opt_b.step()
    moved = [any(not torch.equal(p, q) for p, q in zip(m.parameters(), old, strict=True)) for m, old in zip((a, b), before, strict=True)]
    return moved, amp.state_dict()


def test_num_losses_keeps_one_scaler_per_loss():
    moved, sd = _two_losses(bad_loss_id=1)
    assert list(sd) == ["loss_scaler0", "loss_scaler1"]
    assert moved == [True, False]  # loss 1 overflowed: only its optimizer skips
    assert sd["loss_scaler0"]["state"]["scale"] == 65536.0 and sd["loss_scaler0"]["state"]["total_skips"] == 0
    assert sd["loss_scaler1"]["state"]["scale"] == 32768.0 and sd["loss_scaler1"]["state"]["total_skips"] == 1
    moved, sd = _two_losses()
    assert moved == [True, True] and sd["loss_scaler1"]["state"]["scale"] == 65536.0


def test_two_losses_through_one_optimizer_sum_and_skip_once():
    # one model, two losses with their own scalers, one step: an overflow in loss 1 skips it
    model = _net()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", num_losses=2)
    x, y = _data()
    for bad in (None, 1):
        opt.zero_grad()
        for loss_id in (0, 1):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
                scaled.backward()
                if loss_id == bad:
                    model[3].weight.grad[0, 0] = float("inf")
        if bad is None:  # the sum of the two unscaled gradients, each the same loss's
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            single = model[0].weight.grad.clone()
            opt.zero_grad()
            for loss_id in (0, 1):
                with amp.scale_loss(torch.nn.functional.cross_entropy(model(x), y), opt, loss_id=loss_id) as s:
                    s.backward()
            torch.testing.assert_close(model[0].weight.grad, 2 * single)
        before = model[0].weight.detach().clone()
        opt.step()
        assert torch.equal(model[0].weight, before) == (bad == 1)
    sd = amp.state_dict()
    assert [sd[k]["state"]["total_skips"] for k in sd] == [0, 1]


@pytest.mark.parametrize("loss_id", [2, -1, True, "0", 1.0])
def test_scale_loss_refuses_a_loss_id_out_of_range(loss_id):
    model, opt = _model_opt("O1", num_losses=2)
    loss = torch.nn.functional.cross_entropy(model(_data()[0]), _data()[1])
    with pytest.raises(ValueError, match=r"loss_id must be an int in \[0, 2\)"):
        with amp.scale_loss(loss, opt, loss_id=loss_id):
            pass
    assert model[0].weight.grad is None


def test_load_state_dict_by_loss_scaler_as_apex():
    _model_opt("O1", num_losses=2)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 512.0, "unskipped": 3}, "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0}})
    sd = amp.state_dict()
    assert (sd["loss_scaler0"]["state"]["scale"], sd["loss_scaler0"]["state"]["counter"]) == (512.0, 3)
    assert sd["loss_scaler1"]["state"]["scale"] == 8.0
    with pytest.warns(UserWarning, match="holds 1 loss scaler"):  # fewer entries: loaded in order
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0}})
    assert amp.state_dict()["loss_scaler0"]["state"]["scale"] == 4.0
    assert amp.state_dict()["loss_scaler1"]["state"]["scale"] == 8.0
    before = amp.state_dict()
    with pytest.raises(ValueError, match="unexpected key"):
        amp.load_state_dict({"loss_scaler0": before["loss_scaler0"], "scaler": {}})
    with pytest.raises(ValueError, match="loss_scale' and 'unskipped'"):  # the second is bad: the first is not loaded
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}, "loss_scaler1": {"loss_scale": 2.0}})
    assert amp.state_dict() == before


def test_o2_refuses_two_models_naming_o1():
    a, b = _net(0), _net(1)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="several models or optimizers run in O1"):
        amp.initialize([a, b], opt, opt_level="O2")
    assert a[0].weight.dtype == torch.float32 and apex_mod._STATE["scalers"] == []


def test_o3_with_two_adam_optimizers_warns_for_each():
    a, b = _net(0), _net(1)
    opts = [torch.optim.Adam(a.parameters()), torch.optim.Adam(b.parameters())]
    with pytest.warns(unimp.HalfOptimizerStateWarning) as record:
        amp.initialize([a, b], opts, opt_level="O3")
    assert len([w for w in record if issubclass(w.category, unimp.HalfOptimizerStateWarning)]) == 2


def test_loss_id_may_be_any_integer_type():
    # Apex indexes a list with it: a NumPy integer works there
    import numpy as np

    model, opt = _model_opt("O1", num_losses=2)
    x, y = _data()
    with amp.scale_loss(torch.nn.functional.cross_entropy(model(x), y), opt, loss_id=np.int64(1)) as scaled:
        scaled.backward()
    opt.step()
    assert amp.state_dict()["loss_scaler1"]["state"]["total_skips"] == 0
