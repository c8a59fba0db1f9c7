"""unimp keeps its facts about a user's objects in one attribute, ``_unimp`` (unimp.attached):
after ``prepare`` and training steps the user's model, its layers and its optimizer carry no
other unimp attribute. JAX's user objects are pytrees and optax transformations, which take no
attributes: there is nothing to stamp."""

from __future__ import annotations

import kits
import pytest

import unimp
from unimp.attached import ATTRIBUTE, peek


def _user_objects(run) -> dict[str, object]:
    if run.backend == "torch":
        out = {f"module {n or '<model>'}": m for n, m in run.model.named_modules()}
        return out | {"optimizer": run.opt}
    out = {f"layer {layer.name}": layer for layer in run.model.layers} | {"model": run.model}
    return out | {"inner optimizer": run.opt.inner_optimizer}


@pytest.mark.parametrize("recipe", ["mixed_float16", "mixed_float16;*:float32"])
def test_at_most_one_unimp_attribute_on_a_users_object(backend, recipe):
    if backend == "jax":
        pytest.skip("jax: the user's objects are pytrees and optax transformations (no attributes)")
    run = kits.build(backend, recipe)
    for i in range(3):
        run.step(kits.batch(i, poison=float("inf") if i == 1 else 1.0))  # one skipped step
    found = {
        name: sorted(a for a in vars(obj) if "unimp" in a.lower() and a != ATTRIBUTE)
        for name, obj in _user_objects(run).items()
    }
    assert not {k: v for k, v in found.items() if v}, found
    assert peek(run.model, "prepared") is True  # the facts are there, in the one attribute


def test_a_users_own_unimp_attribute_is_refused_before_anything_changes(backend):
    if backend == "jax":
        pytest.skip("jax: the user's objects are pytrees and optax transformations (no attributes)")
    mp = unimp.mixed_precision("O2" if backend == "torch" else "mixed_float16", backend=backend)
    if backend == "torch":
        import torch

        model = torch.nn.Sequential(torch.nn.Linear(3, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = [p.detach().clone() for p in model.parameters()]
    else:
        import keras

        with mp.autocast():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        opt = keras.optimizers.SGD(0.1)
        before = [w.copy() for w in model.get_weights()]
    model._unimp = {"mine": 1}
    with pytest.raises(TypeError, match="has an attribute '_unimp' of its own .*rename that attribute"):
        mp.prepare(model, opt)
    assert model._unimp == {"mine": 1}
    after = [p.detach() for p in model.parameters()] if backend == "torch" else model.get_weights()
    assert all((a == b).all() for a, b in zip(before, after, strict=True))
    if backend == "torch":  # O2 casts the model to float16: not done
        assert all(p.dtype == torch.float32 for p in model.parameters())
