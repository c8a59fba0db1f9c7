"""torch backend, ``overrides``: covered modules under their own policy in autocast and module mode."""


import copy

import pytest
import torch

import unimp
import unimp.backends.torch as ut
from unimp.attached import peek


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(4, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def forward(self, x):
        return self.head(self.norm(self.l1(x)))


def _dtypes(net, x, mp):
    seen = {}
    for name in ("l1", "head.0", "head.2"):
        net.get_submodule(name).register_forward_hook(
            lambda m, a, o, name=name: seen.__setitem__(name, o.dtype)
        )
    with mp.autocast():
        out = net(x)
    return seen, out


def test_layer_paths_are_module_names():
    assert ut.layer_paths(_Net()) == ["l1", "norm", "head", "head.0", "head.1", "head.2"]


@pytest.mark.parametrize("value", ["float32", "bfloat16"])
def test_autocast_mode_runs_the_covered_module_in_its_dtype(value):
    mp = ut.MixedPrecision(f"mixed_float16;head:{value}", device="cpu")
    net = _Net()
    mp.prepare(net)
    seen, out = _dtypes(net, torch.randn(3, 4), mp)
    want = getattr(torch, value)
    assert seen == {"l1": torch.float16, "head.0": want, "head.2": want}
    assert out.dtype == torch.float32 and all(p.dtype == torch.float32 for p in net.parameters())
    copied = copy.deepcopy(net)  # the wrapper travels with the copy, not the original
    assert copied.head.forward.module is copied.head


def test_module_mode_holds_the_covered_module_in_its_dtype_without_masters():
    mp = unimp.mixed_precision(unimp.get_recipe("mixed_float16;head:float32", cast_mode="module"),
                               backend="torch", device="cpu")  # fmt: skip
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = mp.prepare(net, opt)
    assert net.l1.weight.dtype == torch.float16 and net.head[0].weight.dtype == torch.float32
    seen, out = _dtypes(net, torch.randn(3, 4), mp)
    # computes in float32 inside; hands the model's compute dtype on
    assert seen["head.0"] == torch.float32 and seen["l1"] == torch.float16
    out.float().sum().backward()
    opt.step()
    masters = opt._unimp.master.pairs
    assert {id(p) for p, _ in masters} == {id(net.l1.weight), id(net.l1.bias)}


def test_a_float32_model_can_run_one_module_in_bfloat16():
    mp = ut.MixedPrecision("float32;head/0:bfloat16", device="cpu")  # as unimp trace names it
    assert mp.mode == "autocast"
    net = _Net()
    mp.prepare(net)
    t = mp.trace(net, torch.randn(3, 4), model=net)
    layers = ("l1", "head/0", "head/2")
    computes = {name: {r.compute for r in t.select(layer=name, op="matmul")} for name in layers}
    assert computes == {"l1": {"float32"}, "head/0": {"bfloat16"}, "head/2": {"float32"}}


def test_a_conflict_changes_nothing():
    mp = ut.MixedPrecision("mixed_float16;head*:float32;*.2:bfloat16", device="cpu")
    net = _Net()
    with pytest.raises(ValueError, match=r"conflict at 'head.2'"):
        mp.prepare(net)
    assert "forward" not in vars(net) and "forward" not in vars(net.head)
    assert not peek(net, "prepared", False)


def test_autocast_mode_refuses_an_override_with_other_parameters():
    with pytest.raises(ValueError, match=r"overrides\['head'\] keeps parameters in bfloat16.*module"):
        ut.MixedPrecision("mixed_float16;head:params=bfloat16", device="cpu")


def test_train_step_applies_the_overrides_to_a_model_not_prepared():
    mp = ut.MixedPrecision("mixed_bfloat16;head:float32", device="cpu")
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = mp.train_step(net, opt, lambda m, b: m(b).float().pow(2).mean())
    assert isinstance(net.head.forward, ut.overrides._OverrideForward)
    step(torch.randn(3, 4))
    mp.train_step(net, opt, lambda m, b: m(b).float().pow(2).mean())  # applied once
    assert isinstance(net.head.forward.forward, type(net.l1.forward))
