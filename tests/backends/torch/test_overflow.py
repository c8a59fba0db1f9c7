"""torch backend, ``overflow``: all_finite, selecting and replica agreement."""


import torch

import unimp.backends.torch as ut


def test_all_finite():
    assert bool(ut.all_finite({"a": torch.ones(3), "n": torch.tensor([1])}))
    assert not bool(ut.all_finite([torch.ones(2), torch.tensor([1.0, float("nan")])]))
    assert bool(ut.all_finite({"only_ints": torch.tensor([1])}))
