"""torch backend, ``stats``: ``tensor_stats`` of sparse tensors and ``train_step(...,
stats_every=k)`` (hooks only on statistics steps, the plain steps' ops unchanged, no sync, names,
accumulation over shared modules, checkpointed modules). The values against the reference,
unscaled gradients, the dtypes, the refusals and the docstring examples (every backend) are in
tests/conformance/test_stats_conformance.py."""


from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import unimp
import unimp.backends.torch as ut
from backends.torch.helpers import DEV, _batch, _loss, _mlp
from benchmarks._kit_torch import count_host_reads
from unimp.stats import COUNT_FIELDS, StepStats


class _CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched while inside."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _step(stats_every=None, recipe="mixed_float16", **kw):
    mp = ut.MixedPrecision(recipe, device=DEV)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return mp.train_step(model, opt, _loss, stats_every=stats_every, **kw), model


def _ops_of_second_step(stats_every):
    step, _ = _step(stats_every)
    step(_batch(0))  # step 0: the statistics step when stats_every is set
    with _CountOps() as counter:
        step(_batch(1))
    return counter.ops


def test_plain_steps_dispatch_the_same_ops():
    without, with_option = _ops_of_second_step(None), _ops_of_second_step(5)
    assert sum(without.values()) > 50  # the counter sees the step
    assert with_option == without


def test_a_statistics_step_adds_ops_and_no_hook_stays():
    step, model = _step(2)
    with _CountOps() as counter:
        step(_batch(0))
    plain = _ops_of_second_step(None)
    assert sum(counter.ops.values()) > sum(plain.values())
    assert all(not m._forward_hooks for m in model.modules())


def test_steps_do_not_read_the_device_until_stats_is_read():
    step, _ = _step(2, skip="guard")  # SGD with momentum: sync-free only with the guard
    step(_batch(0))  # momentum buffers are created on the first step
    with count_host_reads() as reads:
        results = [step(_batch(i, bad=(i == 4))) for i in range(1, 5)]  # calls 1..4: 2, 4 stats
    assert reads == {}
    with count_host_reads() as reads:
        s = results[1].stats  # the first read reads the device
    assert sum(reads.values()) > 0 and isinstance(s, StepStats) and s.step == 2
    assert [r.stats is not None for r in results] == [False, True, False, True]
    assert results[3].stats.gradients["3.weight"].counts["nonfinite"] > 0  # the skipped step's


def test_names_are_torchs_and_layers_are_leaves():
    step, model = _step(1)
    s = step(_batch(0)).stats
    assert list(s.gradients) == [n for n, _ in model.named_parameters()]
    assert list(s.activations) == ["0", "1", "2", "3"]  # Linear, LayerNorm, ReLU, Linear
    assert s.activations["0"].size == 8 * 16 and s.activations["3"].size == 8 * 3
    r = step(_batch(1))
    assert r.stats.gradients["0.weight"].scale == r.scale == 32768.0  # the step's loss scale
    assert s.activations["0"].scale == 1.0


def test_module_mode_names_the_masters_after_the_model():
    mp = ut.MixedPrecision(unimp.get_recipe("mixed_float16", cast_mode="module"), device=DEV)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mp.prepare(model, opt)
    hooks = {id(m): len(m._forward_hooks) for m in model.modules()}
    step = mp.train_step(model, opt, _loss, stats_every=1)
    s = step(_batch(0)).stats
    assert list(s.gradients) == [n for n, _ in model.named_parameters()]
    assert {id(m): len(m._forward_hooks) for m in model.modules()} == hooks  # unimp's kept


def test_accumulation_and_shared_modules_take_every_output():
    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.pair = _Pair()

        def forward(self, x):
            a, b = self.pair(self.lin(self.lin(x)))
            return (a + b).sum()

    mp = ut.MixedPrecision("float32", device=DEV)
    model = Shared()
    step = mp.train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b),
        grad_accum_steps=2, stats_every=1,
    )
    s = step([torch.ones(3, 4), torch.ones(3, 4)]).stats
    assert s.activations["lin"].size == 2 * 2 * 12  # called twice on each of 2 micro-batches
    assert set(s.activations) == {"lin", "pair.0", "pair.1"} and s.activations["pair.1"].size == 24


class _Pair(torch.nn.Module):
    def forward(self, x):
        return x, x * 2


def test_a_failed_statistics_step_is_not_counted_and_removes_its_hooks():
    step, model = _step(2)

    def bad(m, b):
        m(b[0])
        raise RuntimeError("boom")

    step.loss_fn = bad
    with pytest.raises(RuntimeError, match="boom"):
        step(_batch(0))
    assert step.calls == 0 and all(not m._forward_hooks for m in model.modules())
    step.loss_fn = _loss
    assert step(_batch(0)).stats is not None and step.calls == 1


def test_tensor_stats_of_a_sparse_tensor_count_it_densely():
    dense = torch.tensor([[0.0, 2.0**-30], [0.0, 0.0]])
    c, m = ut.tensor_stats(dense.to_sparse(), 1.0)
    want = dict(zip(COUNT_FIELDS, ut.tensor_stats(dense)[0].tolist(), strict=True))
    assert dict(zip(COUNT_FIELDS, c.tolist(), strict=True)) == want and want["zeros"] == 3


def test_checkpointed_layers_are_counted_once():
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return checkpoint(self.lin, x, use_reentrant=True).sum()

    mp = ut.MixedPrecision("float32", device=DEV)
    model = Net()
    step = mp.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b), stats_every=1)
    s = step(torch.ones(3, 4, requires_grad=True)).stats
    assert s.activations["lin"].size == 12
