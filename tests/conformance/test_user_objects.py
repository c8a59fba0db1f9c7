"""unimp keeps its facts about a user's objects in one attribute, ``_unimp`` (unimp.attached):
after ``prepare`` and training steps the user's model, its layers and its optimizer carry no
other unimp attribute. JAX's user objects are pytrees and optax transformations, which take no
attributes: there is nothing to stamp."""

from __future__ import annotations

import kits
import pytest

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
