"""``prepare`` takes and returns the same shapes in every backend: ``prepare(model)`` gives the
model (JAX: the parameters) alone, ``prepare(model, optimizer)`` the pair, as Apex's
``amp.initialize`` does."""

from __future__ import annotations

import numpy as np
import pytest

import unimp


def _native(backend: str, mp):
    """A fresh model (JAX: a parameter pytree) and optimizer of ``backend``."""
    if backend == "torch":
        import torch

        model = torch.nn.Linear(3, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)
    if backend == "tensorflow":
        import keras

        with mp.autocast():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        return model, keras.optimizers.SGD(0.1)
    import optax

    return {"w": np.ones((3, 2), np.float32)}, optax.sgd(0.1)


def test_prepare_returns_the_model_alone_or_the_pair(backend):
    mp = unimp.mixed_precision("mixed_float16", backend=backend)
    model, _ = _native(backend, mp)
    alone = mp.prepare(model)
    assert not isinstance(alone, tuple)
    if backend == "jax":
        assert set(alone) == {"w"}
    else:
        assert alone is model
    model, opt = _native(backend, mp)
    pair = mp.prepare(model, opt)
    assert isinstance(pair, tuple) and len(pair) == 2
    assert backend == "jax" or pair[0] is model


def test_every_half_precision_name_prepares_as_written(backend):
    """The pure-half names come with the loss scale their origin gives them (none for
    Lightning's ``16-true`` and a bare dtype, Apex ``O3`` static 1.0), so ``prepare`` takes
    them without a ``loss_scale=`` option; the mixed names keep their dynamic scale."""
    kinds = {"16-true": "none", "float16": "none", "half": "none", "O3": "static",
             "mixed_float16": "dynamic", "16-mixed": "dynamic", "bf16-true": "none"}  # fmt: skip
    for name, kind in kinds.items():
        recipe = unimp.get_recipe(name)
        assert recipe.loss_scale.kind == kind, name
        assert kind != "static" or recipe.loss_scale.scale == 1.0
        mp = unimp.mixed_precision(recipe, backend=backend)
        model, opt = _native(backend, mp)
        pair = mp.prepare(model, opt)  # raised for the pure float16 names before
        assert isinstance(pair, tuple) and len(pair) == 2, name


def test_a_loss_scale_on_float16_parameters_is_refused_in_every_backend(backend):
    """float16 parameters get float16 gradients, which cannot be unscaled safely: a recipe
    that asks for a loss scale on them is refused by ``prepare`` in every backend (torch
    alone refused it; Keras and JAX ran it), naming the parameters, with nothing changed; a
    static 1.0 (Apex O3) is allowed."""
    mp = unimp.mixed_precision(unimp.get_recipe("16-true", loss_scale="dynamic"), backend=backend)
    model, opt = _native(backend, mp)
    with pytest.raises(ValueError, match=r"float16 parameters would get float16 gradients.*loss_scale='none'"):
        mp.prepare(model, opt)
    if backend == "torch":
        assert all(p.dtype.is_floating_point and str(p.dtype) == "torch.float32" for p in model.parameters())
    o3 = unimp.mixed_precision(unimp.get_recipe("16-true", loss_scale=1.0), backend=backend)
    model, opt = _native(backend, o3)
    assert len(o3.prepare(model, opt)) == 2
