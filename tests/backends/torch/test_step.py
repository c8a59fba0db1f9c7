"""torch backend, ``step``: the train step (clipping, accumulation, skips, state, syncs, bad input)."""


import contextlib
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
from unimp.loss_scale import DynamicLossScale, StaticLossScale


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


def test_a_step_called_under_no_grad_trains_as_outside_it():
    # an evaluation loop's torch.no_grad() around the call: "element 0 of tensors does not
    # require grad" before; a training step turns gradients on for itself, as Lightning does
    def run(no_grad):
        torch.manual_seed(0)
        mp = ut.MixedPrecision("mixed_bfloat16", device=DEV)
        model = _mlp()
        step = mp.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss)
        with torch.no_grad() if no_grad else contextlib.nullcontext():
            r = step(_batch(0))
            assert torch.is_grad_enabled() is not no_grad  # the caller's mode, put back
        return bool(r.applied), [p.detach().clone() for p in model.parameters()]

    (applied, params), (applied_ref, ref) = run(True), run(False)
    assert applied and applied_ref
    assert all(torch.equal(a, b) for a, b in zip(params, ref, strict=True))


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


@pytest.mark.parametrize(
    ("opt_name", "skip", "syncs"),
    [
        ("adamw_fused", "auto", 0),  # torch's native found_inf path: never a sync
        ("sgd_momentum", "guard", 0),  # the copy-and-select guard: never a sync
        ("sgd_plain", "guard", 0),
        ("sgd_momentum", "auto", 1),  # one host read before optimizer.step(), as torch.amp
        ("sgd_plain", "auto", 1),
    ],
)
def test_step_syncs_as_its_skip_mode_says(opt_name, skip, syncs, monkeypatch):
    mp = ut.MixedPrecision("mixed_float16", device=DEV)
    model = _mlp()
    opt = SKIP_OPTS[opt_name](model.parameters())
    step = mp.train_step(model, opt, _loss, max_grad_norm=1.0, skip=skip)
    step(_batch(0))  # creates the optimizer state (the one step that may sync)
    reads = []
    real_bool = torch.Tensor.__bool__

    def counted(t):
        reads.append(1)
        return real_bool(t)

    def no_sync(*a, **k):
        raise AssertionError("host sync during a step")

    for name in ("item", "__float__", "__int__", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    monkeypatch.setattr(torch.Tensor, "__bool__", counted)
    results = [step(_batch(i, bad=(i == 2))) for i in range(1, 4)]
    monkeypatch.undo()
    assert len(reads) == 3 * syncs
    assert [r.applied for r in results] == [True, False, True]


def test_skip_modes_give_bitwise_the_same_training():
    # the host-decided skip and the sync-free guard: the same parameters and optimizer state
    mp = ut.MixedPrecision("mixed_float16", device=DEV)
    out = {}
    for skip in ("auto", "guard"):
        torch.manual_seed(0)
        model = _mlp()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        step = mp.train_step(model, opt, _loss, skip=skip)
        for i in range(4):
            step(_batch(i, bad=(i == 1)))
        out[skip] = [p.detach().clone() for p in model.parameters()] + [
            v.clone() for st in opt.state.values() for v in st.values()]
    assert all(torch.equal(a, b) for a, b in zip(out["auto"], out["guard"], strict=True))
    with pytest.raises(ValueError, match="skip must be 'auto'.*or 'guard'"):
        mp.train_step(_mlp(), torch.optim.SGD(_mlp().parameters(), lr=0.1), _loss, skip="never")


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


def test_loss_of_shape_1_is_refused_like_the_other_backends():
    mp = ut.MixedPrecision("mixed_float16", device="cpu")
    model = torch.nn.Linear(2, 1)
    step = mp.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).sum().reshape(1))
    with pytest.raises(ValueError, match="0-d"):
        step(torch.ones(1, 2))


@pytest.mark.parametrize("max_norm", [100.0, 1.0])
def test_sparse_gradient_norm_counts_repeated_ids_once(max_norm):
    # Embedding(4, 2, sparse=True), ids [1, 1, 2], loss sum(2 * emb(ids)): the gradient has rows
    # 1 -> (4, 4) and 2 -> (2, 2), norm sqrt(40) = 6.3246; the uncoalesced entries (three rows of
    # (2, 2)) gave sqrt(24) = 4.899
    torch.manual_seed(0)
    emb = torch.nn.Embedding(4, 2, sparse=True)
    w0 = emb.weight.detach().clone()
    mp = unimp.mixed_precision("float32", loss_scale=DynamicLossScale(init_scale=1024.0),
                               backend="torch", device="cpu")
    step = mp.train_step(emb, torch.optim.SGD(emb.parameters(), lr=1.0),
                         lambda m, ids: (2 * m(ids)).sum(), max_grad_norm=max_norm)
    r = step(torch.tensor([1, 1, 2]))
    assert r.applied
    assert r.grad_norm == pytest.approx(40**0.5, rel=1e-6)
    applied_norm = float(torch.linalg.vector_norm(w0 - emb.weight.detach()))
    assert applied_norm == pytest.approx(min(max_norm, 40**0.5), rel=1e-6)


def test_skip_guard_covers_persistent_buffers_not_caches():
    from unimp.backends.torch.step import _forward_state

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model.register_buffer("rotary_cache", torch.ones(1000), persistent=False)
    kept = {id(b) for b, _ in _forward_state(model)}
    assert kept == {id(model[1].running_mean), id(model[1].running_var), id(model[1].num_batches_tracked)}


@pytest.mark.parametrize("counts", ["applied", "attempted"])
def test_no_scheduler_before_optimizer_warning_when_the_first_step_is_skipped(counts):
    # pytorch/pytorch#44511: torch.amp.GradScaler skips optimizer.step() on an overflow, so a
    # scheduler stepped after a skipped first step warns; unimp's skip (on the host, or on the
    # device with skip="guard") counts as the step taken
    def loop(scaler, x):
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        scaler.scale(model(x).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        return sched.get_last_lr()

    inf = torch.full((4, 2), float("inf"))
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step\(\)"):
        loop(torch.amp.GradScaler("cpu"), inf)  # torch's own: the warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loop(ut.GradScaler(device="cpu"), inf) == [0.5]
        mp = unimp.mixed_precision("mixed_float16", backend="torch", device="cpu")
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        step = mp.train_step(model, opt, lambda m, x: m(x).float().pow(2).mean(), scheduler=sched,
                             schedule_counts=counts)
        assert step(inf).applied is False and step(torch.full((4, 2), 0.1)).applied is True
    assert sched.get_last_lr() == [0.5 if counts == "applied" else 0.25]


@pytest.mark.parametrize("recipe", ["mixed_bfloat16", "fp8"])
def test_steps_inside_the_users_autocast_block_train_as_outside_it(recipe):
    """torch's autocast keeps its low-precision copy of each weight for the life of the
    outermost autocast block (NVIDIA/apex#132): four steps inside one ``with mp.autocast():``
    gave the first step's loss four times. The step knows it changed the weights: inside the
    block it trains exactly as outside it (the float8 layers' backward too, which ran its
    float32 GEMMs in bfloat16 when called inside the block)."""

    def run(inside):
        torch.manual_seed(0)
        mp = ut.MixedPrecision(recipe, device=DEV)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
            torch.nn.Linear(16, 2),
        ).to(DEV)  # fmt: skip
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model, opt = mp.prepare(model, opt)
        step = mp.train_step(model, opt, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]).float(), b[1]))
        g = torch.Generator().manual_seed(1)
        b = (torch.randn(16, 4, generator=g).to(DEV), torch.randint(0, 2, (16,), generator=g).to(DEV))
        with mp.autocast() if inside else torch.autocast(DEV.split(":")[0], enabled=False):
            losses = [step(b).loss for _ in range(4)]
        return losses, [p.detach().clone() for p in model.parameters()]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", unimp.fp8.FP8EmulationWarning)
        (outside, w_out), (inside, w_in) = run(False), run(True)
    assert len(set(outside)) == 4  # the loss moves from step to step
    assert inside == outside
    assert all(torch.equal(a, b) for a, b in zip(w_in, w_out, strict=True))


def test_a_step_that_raises_after_the_backward_leaves_nothing_behind():
    """An error in the unscale (float16 gradients) or in the optimizer's own step (Adam on a
    sparse gradient) left the scaled ``.grad`` values and the BatchNorm buffers of the failed
    step behind: the whole step before its update is undone, as a failing ``loss_fn`` is."""
    mp = ut.MixedPrecision("mixed_float16", device=DEV)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.BatchNorm1d(2)).to(DEV).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = mp.train_step(model, opt, lambda m, b: m(b.half()).float().mean())
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    scale = step.state_dict()
    for _ in range(2):  # the second call fails the same way: no half-done unscale_ is left
        with pytest.raises(ValueError, match="float16"):
            step(torch.randn(3, 4, device=DEV))
        assert all(p.grad is None for p in model.parameters())
        assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())
        assert step.state_dict() == scale

    emb = torch.nn.Embedding(5, 2, sparse=True).to(DEV)
    adam = torch.optim.Adam(emb.parameters(), lr=0.1)
    sparse = ut.MixedPrecision("mixed_bfloat16", device=DEV).train_step(
        emb, adam, lambda m, b: m(b).float().sum()
    )
    with pytest.raises(RuntimeError, match="sparse"):
        sparse(torch.tensor([1, 2], device=DEV))
    assert emb.weight.grad is None


def test_an_empty_half_parameter_is_finite_and_checks_nothing():
    # the breaker's case: _foreach_norm refuses an empty tensor, after the optimizer had stepped
    import unimp

    model = torch.nn.Linear(4, 1)
    model.extra = torch.nn.Parameter(torch.zeros(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = unimp.mixed_precision("bfloat16", backend="torch", device="cpu")
    model, opt = mp.prepare(model, opt)
    step = mp.train_step(model, opt, lambda m, b: m(b).float().pow(2).mean() + m.extra.float().sum())
    r = step(torch.ones(2, 4))
    assert r.applied and r.params_finite is True
