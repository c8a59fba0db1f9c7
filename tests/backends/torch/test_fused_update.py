"""torch backend: the fused loss-scale update (``torch._amp_update_scale_`` plus in-place ops)
against the NumPy reference, bit for bit, step by step; and where it must not be used."""


import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import unimp.backends.torch as ut
from unimp.backends.torch.overflow import flags_from_bools
from unimp.backends.torch.scaling import fused_rule, update_in_place
from unimp.loss_scale import DynamicLossScale, NoLossScale, StaticLossScale, update

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)

factors = st.one_of(st.sampled_from([2.0, 1.5, 1.25, 3.0, 1.1, 1.0001]), st.floats(1.0001, 8.0))
backoffs = st.one_of(st.sampled_from([0.5, 0.7, 0.25, 0.9, 0.999]), st.floats(0.01, 0.999))
mins = st.one_of(st.none(), st.sampled_from([1.0, 0.3, 2.0**-14, 7.0]), st.floats(F32_TINY, 1e3))
maxs = st.one_of(st.none(), st.sampled_from([F32_MAX / 8, 2.0**24, 65536.0, 1e30]), st.floats(1.0, F32_MAX / 8))


@st.composite
def configs(draw):
    lo, hi = draw(mins), draw(maxs)
    floor = F32_TINY if lo is None else lo
    top = F32_MAX if hi is None else hi
    assume(floor <= top)
    # start anywhere in range, often at the floor or the cap (where the clamp decides)
    init = draw(st.one_of(st.sampled_from([floor, top]), st.floats(floor, top)))
    try:
        cfg = DynamicLossScale(
            init_scale=init, growth_factor=draw(factors), backoff_factor=draw(backoffs),
            growth_interval=draw(st.integers(1, 5)), min_scale=lo, max_scale=hi,
        )  # fmt: skip
    except ValueError:
        assume(False)
    assume(fused_rule(cfg))
    return cfg


# (grads_finite, loss_finite): clean, overflow, forward overflow, both non-finite
events = st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=30)


def _state(cfg):
    s = cfg.initial_state()
    return (
        torch.tensor(float(s.scale), dtype=torch.float32),
        torch.tensor(int(s.counter), dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),  # [consecutive_skips, total_skips]
    )


def _update(cfg, scale, counter, skips, gf, lf, out=None, ints=False):
    """One fused update; the skip counters after it as a snapshot (a report's). ``ints``: the
    flags as the train step hands them (int32 0 / 1 and ``[skipped, 1]``), else bools."""
    overflow, skipped, loss_inf = flags_from_bools(
        torch.tensor(gf), torch.tensor(lf), torch.zeros(()) if out is None else out
    )
    one = None
    if ints:  # as the train step: [skipped, 1] int32, skipped a view of it (one addcmul)
        one = torch.stack([skipped.int(), torch.tensor(1, dtype=torch.int32)])
        skipped, loss_inf = one[0], loss_inf.int()
    update_in_place(
        cfg, scale, counter, skips, skips[0], loss_inf=loss_inf, overflow=overflow, skipped=skipped, skipped_one=one
    )
    return tuple(skips.clone().unbind())


def _check_steps(cfg, flags, ints=False):
    scale, counter, skips = held = _state(cfg)
    ref = cfg.initial_state()
    out = torch.zeros((), dtype=torch.float32)
    reports = []
    for i, (gf, lf) in enumerate(flags):
        consecutive, total = _update(cfg, scale, counter, skips, gf, lf, out, ints)
        ref = update(cfg, ref, gf, lf)
        reports.append(((int(consecutive), int(total)), consecutive, total))
        assert (int(consecutive), int(total)) == tuple(skips.tolist())
        got = (scale.numpy().view(np.uint32), int(counter), int(consecutive), int(total))
        want = (np.float32(ref.scale).view(np.uint32), int(ref.counter), int(ref.consecutive_skips),
                int(ref.total_skips))  # fmt: skip
        assert got == want, f"step {i} ({gf=}, {lf=}): fused {got}, reference {want} ({cfg})"
    assert all(t is h for t, h in zip((scale, counter, skips), held, strict=True))
    # each step's report keeps its values: later updates change the state, not the snapshots
    assert all((int(c), int(t)) == values for values, c, t in reports)


@settings(max_examples=300, deadline=None)
@given(configs(), events, st.booleans())
def test_fused_update_equals_the_reference_bit_for_bit(cfg, flags, ints):
    _check_steps(cfg, flags, ints)


@pytest.mark.parametrize(
    "cfg",
    [
        DynamicLossScale(init_scale=1.0, growth_factor=1.5, backoff_factor=0.7, growth_interval=1, min_scale=1.0),
        DynamicLossScale(
            init_scale=F32_MAX / 2, growth_factor=1.5, backoff_factor=0.7, growth_interval=1,
            min_scale=None, max_scale=None,
        ),  # fmt: skip
        DynamicLossScale(init_scale=3.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=2, max_scale=100.0),
        # 3 * float32(1.1) is 3.3000002 in float32 where 3 * 1.1 (float64) rounds to 3.3: the
        # kernel's float64 product is right only with float32 factors (the config rounds them)
        DynamicLossScale(init_scale=3.0, growth_factor=1.1, backoff_factor=0.3, growth_interval=1, min_scale=0.01),
        StaticLossScale(128.0),
        NoLossScale(),
    ],
    ids=["floor-non-dyadic", "growth-to-inf-kept", "cap-non-dyadic", "float32-factors", "static", "none"],
)
@pytest.mark.parametrize("ints", [False, True], ids=["bool-flags", "int32-flags"])
def test_fused_update_corners(cfg, ints):
    # overflow at the floor, growth past the float32 max, growth past the cap, forward overflow
    # on the growth step
    flags = [(False, True), (True, True), (True, True), (True, False), (True, True), (False, False)] * 3
    _check_steps(cfg, flags, ints)


def test_forward_overflow_on_the_growth_step_neither_grows_nor_counts():
    cfg = DynamicLossScale(init_scale=8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    scale, counter, skips = _state(cfg)
    for gf, lf in [(True, True), (False, False), (True, False)]:
        _update(cfg, scale, counter, skips, gf, lf)
    assert (float(scale), int(counter), skips.tolist()) == (8.0, 1, [2, 2])


@pytest.mark.parametrize(
    "cfg",
    [
        DynamicLossScale(hysteresis=2),
        DynamicLossScale(overflow_tolerance=0.5),
        DynamicLossScale(floor_action="warn"),
        DynamicLossScale(delayed_first_growth=True),
        # a growth from max_scale overflows to inf: the reference caps it, torch keeps the scale
        DynamicLossScale(init_scale=1.0, growth_factor=2.0, max_scale=F32_MAX),
    ],
    ids=["hysteresis", "tolerance", "floor-action", "delayed-growth", "inf-growth-capped"],
)
def test_configs_the_kernel_cannot_follow_keep_the_reference(cfg):
    assert not fused_rule(cfg)


def test_the_inf_growth_guard_is_needed():
    # what the guard avoids: at max_scale = float32 max, torch's kernel keeps the scale on an
    # inf growth where the reference caps it at max_scale (the same value here, but a scale
    # below max_scale whose growth overflows would differ)
    cfg = DynamicLossScale(
        init_scale=F32_MAX / 1.5, growth_factor=2.0, growth_interval=1, max_scale=F32_MAX
    )
    scale, counter = torch.tensor(np.float32(F32_MAX / 1.5)), torch.tensor(0, dtype=torch.int32)
    torch._amp_update_scale_(scale, counter, torch.zeros(()), 2.0, 0.5, 1)
    ref = update(cfg, cfg.initial_state(), True)
    assert float(ref.scale) == F32_MAX and float(scale) == float(np.float32(F32_MAX / 1.5))


# the train step on the fused path against the same step forced onto the reference path:
# clean steps, a gradient overflow, a forward overflow (NaN input: NaN loss), both in a row
EVENTS = ["ok", "grads", "ok", "loss", "loss", "ok", "ok", "grads", "ok", "ok"]


def _trajectory(recipe, cfg, optimizer, reference, monkeypatch):
    import unimp
    from backends.torch.helpers import _batch, _loss, _mlp

    if reference:
        monkeypatch.setattr("unimp.backends.torch.scaling.fused_rule", lambda config: False)
    mp = ut.MixedPrecision(unimp.get_recipe(recipe, loss_scale=cfg), device="cpu")
    model = _mlp()
    step = mp.train_step(model, optimizer(model.parameters()), _loss)
    rows = []
    for i, event in enumerate(EVENTS):
        x, y, _ = _batch(i)
        if event == "loss":
            x[0, 0] = float("nan")
        r = step((x, y, event == "grads"))
        raw = r.raw
        # the documented contract: raw holds the step's device values (tensors), on either path
        assert all(isinstance(raw[k], torch.Tensor) for k in raw if k != "grad_norm")
        rows.append((
            r.as_dict(), raw["scale"].item(), int(step.scaler._counter),
            tuple(raw[k].dtype for k in ("applied", "loss_finite", "grads_finite", "consecutive_skips")),
        ))  # fmt: skip
    monkeypatch.undo()
    return rows, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "recipe,cfg",
    [
        ("mixed_float16", DynamicLossScale(init_scale=2.0**10, growth_factor=1.5, backoff_factor=0.7,
                                           growth_interval=2, min_scale=1.0, max_scale=2.0**12)),
        ("mixed_bfloat16", NoLossScale()),
        ("float32", StaticLossScale(3.0)),
    ],
    ids=["dynamic-non-dyadic", "none", "static"],
)  # fmt: skip
@pytest.mark.parametrize("opt", ["adam_fused", "sgd"])
def test_train_step_fused_path_equals_the_reference_path(recipe, cfg, opt, monkeypatch):
    optimizer = {
        "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    }[opt]
    fused, fused_params = _trajectory(recipe, cfg, optimizer, False, monkeypatch)
    ref, ref_params = _trajectory(recipe, cfg, optimizer, True, monkeypatch)
    assert repr(fused) == repr(ref)  # repr: a NaN loss equals itself
    assert [r[0]["applied"] for r in fused] == [e == "ok" for e in EVENTS]
    assert [r[0]["loss_finite"] for r in fused] == [e != "loss" for e in EVENTS]
    for a, b in zip(fused_params, ref_params, strict=True):
        assert torch.equal(a, b)


def test_inverse_scale_is_torchs_float64_reciprocal_bit_for_bit():
    # unscale_'s one op (float64 1.0 / float32 scale, into float32) against torch.amp's
    # GradScaler.unscale_: self._scale.double().reciprocal().float()
    rng = np.random.default_rng(0)
    bits = rng.integers(0x00800000, 0x7F800000, size=20000, dtype=np.uint32)  # normal floats
    scales = torch.from_numpy(np.concatenate([bits.view(np.float32), np.float32([1.5, 3.0, 65536.0])]))
    ours = torch.empty_like(scales)
    torch.div(torch.tensor(1.0, dtype=torch.float64), scales, out=ours)
    want = scales.double().reciprocal().float()
    assert torch.equal(ours.view(torch.int32), want.view(torch.int32))


def test_step_reports_keep_their_values_when_read_after_later_steps():
    import unimp
    from backends.torch.helpers import _batch, _loss, _mlp

    cfg = DynamicLossScale(init_scale=2.0**10, growth_factor=1.5, backoff_factor=0.7, growth_interval=2)
    mp = ut.MixedPrecision(unimp.get_recipe("mixed_float16", loss_scale=cfg), device="cpu")
    model = _mlp()
    step = mp.train_step(model, torch.optim.Adam(model.parameters(), lr=1e-2, fused=True), _loss)
    results = []
    for i, event in enumerate(EVENTS):
        x, y, _ = _batch(i)
        if event == "loss":
            x[0, 0] = float("nan")
        results.append(step((x, y, event == "grads")))
    # nothing read until every step ran: each report is its own step's
    got = [(r.applied, r.loss_finite, r.grads_finite, r.consecutive_skips, r.total_skips) for r in results]
    want, run, total = [], 0, 0
    for e in EVENTS:
        run, total = (run + 1, total + 1) if e != "ok" else (0, total)
        want.append((e == "ok", e != "loss", e == "ok", run, total))
    assert got == want
    state, scales = cfg.initial_state(), []
    for e in EVENTS:  # the scale each step used, by the reference rule
        scales.append(float(state.scale))
        state = update(cfg, state, e == "ok", e != "loss")
    assert [r.scale for r in results] == scales


def test_reading_one_raw_value_derives_no_other():
    from torch.utils._python_dispatch import TorchDispatchMode

    import unimp
    from backends.torch.helpers import _batch, _loss, _mlp

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    mp = ut.MixedPrecision(unimp.get_recipe("mixed_float16"), device="cpu")
    model = _mlp()
    step = mp.train_step(model, torch.optim.Adam(model.parameters(), fused=True), _loss)
    x, y, _ = _batch(0)
    r = step((x, y, False))
    with Count():
        raw = r.raw
        loss = raw["loss"]
    assert Count.ops == 0 and isinstance(loss, torch.Tensor)
    with Count():
        applied = raw["applied"]  # derived on the device when read: a few ops, no sync
    assert 0 < Count.ops <= 3 and applied.dtype == torch.bool and bool(applied)


@pytest.mark.parametrize("loss_inf", [0.0, 1.0])
@pytest.mark.parametrize("grads_inf", [0.0, 1.0])
def test_skip_flags_are_max_and_backoff_in_one_op(loss_inf, grads_inf):
    sc = ut.GradScaler(DynamicLossScale(), device="cpu")
    loss_flag, grads_flag, skip, overflow = sc._zero_flags()
    loss_flag.fill_(loss_inf)
    grads_flag.fill_(grads_inf)
    sc._skip_flags()
    # exactly 1.0 / 0.0: torch's fused optimizers skip on found_inf == 1 only
    assert (skip.item(), overflow.item()) == (max(loss_inf, grads_inf), grads_inf * (1.0 - loss_inf))


def test_raw_is_a_plain_dict_of_device_values(tmp_path):
    # raw was a dict before it became lazy: code written for the dict (copy, |, pop, values,
    # dict(), {**}, torch.save with torch.load's weights_only default) keeps working, sees
    # tensors only, and a key read twice gives the same tensor (derived once)
    import pickle

    import unimp
    from backends.torch.helpers import _batch, _loss, _mlp

    mp = ut.MixedPrecision(unimp.get_recipe("mixed_float16"), device="cpu")
    model = _mlp()
    step = mp.train_step(model, torch.optim.Adam(model.parameters(), fused=True), _loss)
    x, y, _ = _batch(0)
    r = step((x, y, False))
    raw = r.raw
    assert isinstance(raw, dict) and raw["scale"] is raw["scale"]
    tensors = {k: v for k, v in r.raw.items() if k != "grad_norm"}
    assert all(type(v) is torch.Tensor for v in tensors.values()), tensors
    for view in (dict(r.raw), {**r.raw}, r.raw.copy(), r.raw | {}, pickle.loads(pickle.dumps(r.raw))):
        assert isinstance(view, dict) and not isinstance(view, type(raw)) and sorted(view) == sorted(raw)
        assert all(type(view[k]) is torch.Tensor for k in tensors)
    path = tmp_path / "raw.pt"
    torch.save(r.raw, path)
    back = torch.load(path)  # weights_only=True: plain containers of tensors only
    assert isinstance(back, dict) and back["scale"].item() == r.scale and bool(back["applied"]) == r.applied
    popped = r.raw
    assert type(popped.pop("scale")) is torch.Tensor and "scale" not in popped and "scale" in r.raw
    assert r.raw == r.raw.copy() and "scale" in repr(r.raw)
