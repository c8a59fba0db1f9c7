"""torch backend, ``casting``: what torch adds to the one casting rule (mapping types kept) and
module mode's master weights. The rule itself (floating leaves only, every backend) is in
tests/conformance/test_casting_conformance.py."""


import torch

import unimp
import unimp.backends.torch as ut
from backends.torch.helpers import (
    DEV,
    _assert_bitwise,
    _batch,
    _loss,
    _mlp,
)


def test_cast_tree_keeps_mapping_types():
    from collections import OrderedDict, defaultdict
    from types import MappingProxyType

    od = ut.cast_tree(OrderedDict(a=torch.ones(1)), "bf16")
    dd = ut.cast_tree(defaultdict(list, a=torch.ones(1)), "bf16")
    frozen = ut.cast_tree(MappingProxyType({"a": torch.ones(1)}), "bf16")
    assert type(od) is OrderedDict and type(dd) is defaultdict and dd.default_factory is list
    assert od["a"].dtype == dd["a"].dtype == frozen["a"].dtype == torch.bfloat16


def test_module_mode_masters_start_exact():
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ut.MixedPrecision(unimp.get_recipe("O2"), device=DEV).prepare(model, opt)
    for b, m in zip(before, ut.master_params(opt), strict=True):
        _assert_bitwise(b, m.detach())


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


def _norm_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)
    )
    with torch.no_grad():
        model[1].weight.fill_(0.1234567)
        model[2].running_var.fill_(1e5)
    return model


def test_module_mode_never_rounds_float32_state_through_half():
    # NVIDIA/apex PR #144 kind: casting the whole model to float16 and the norms back rounded
    # 0.1234567 to 0.12347412 and made a running_var of 1e5 inf (evaluation NaN)
    model = _norm_model()
    ln_weight = model[1].weight.detach().clone()
    bn_state = {k: v.clone() for k, v in model[2].state_dict().items()}
    mp = unimp.mixed_precision("O2", backend="torch", device="cpu")
    model, _ = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model[1].weight.dtype == torch.float32
    assert torch.equal(model[1].weight, ln_weight)  # bitwise: 0.1234567 stays
    assert float(model[1].weight.detach()[0]) == float(torch.tensor(0.1234567, dtype=torch.float32))
    for k, v in model[2].state_dict().items():
        assert v.dtype == bn_state[k].dtype and torch.equal(v, bn_state[k]), k
    assert model[0].weight.dtype == torch.float16
    model.eval()
    assert torch.isfinite(model(torch.randn(3, 4))).all()


def test_module_mode_checkpoint_loaded_before_or_after_prepare_is_the_same_model():
    ckpt = _norm_model().state_dict()
    mp = unimp.mixed_precision("O2", backend="torch", device="cpu")
    before = _norm_model()
    with torch.no_grad():
        for p in before.parameters():
            p.add_(1.0)  # something else, then the checkpoint
    before.load_state_dict(ckpt)
    before, opt_b = mp.prepare(before, torch.optim.SGD(before.parameters(), lr=0.1))
    after = _norm_model()
    with torch.no_grad():
        for p in after.parameters():
            p.add_(1.0)
    after, opt_a = mp.prepare(after, torch.optim.SGD(after.parameters(), lr=0.1))
    after.load_state_dict(ckpt)
    sb, sa = before.state_dict(), after.state_dict()
    assert sb.keys() == sa.keys()
    for k in sb:
        assert sb[k].dtype == sa[k].dtype and torch.equal(sb[k], sa[k]), k
    for pb, pa in zip(before.parameters(), after.parameters(), strict=True):
        assert pb.dtype == pa.dtype and torch.equal(pb, pa)
    masters_b = [p.detach() for g in opt_b.param_groups for p in g["params"]]
    masters_a = [p.detach() for g in opt_a.param_groups for p in g["params"]]
    for mb, ma in zip(masters_b, masters_a, strict=True):
        assert torch.equal(mb, ma)
    x = torch.randn(3, 4)
    before.eval(), after.eval()
    assert torch.equal(before(x), after(x))
