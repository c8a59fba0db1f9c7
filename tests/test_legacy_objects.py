"""Objects saved by an older unimp still load: a pickled torch GradScaler, a ``.keras`` model
compiled with unimp's LossScaleOptimizer, a pickled JAX loss-scale pytree and optax state.

The files in ``tests/data/legacy/`` were written by ``scripts/make_legacy_fixtures.py`` with the
code from before the backends became packages (single modules ``unimp/backends/<fw>.py``);
the values below are the ones that code saved.
"""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
from conftest import require_backend

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "legacy")


def _expected(key):
    with open(os.path.join(DATA, "expected.json")) as f:
        return json.load(f)[key]


def test_torch_gradscaler_pickle_loads_and_steps():
    ut = require_backend("torch")
    import torch

    with open(os.path.join(DATA, "torch_gradscaler.pkl"), "rb") as f:
        scaler = pickle.load(f)
    assert type(scaler) is ut.GradScaler
    # 3 clean steps at interval 2 grow 1024 -> 2048, then a non-finite loss: skipped, scale kept
    assert scaler.state_dict()["state"] == {
        "scale": 2048.0, "counter": 1, "consecutive_skips": 1, "total_skips": 1
    }
    assert scaler.state_dict() == _expected("torch_gradscaler")
    # and it still works: one clean step completes the growth window
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(4, 3)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 4096.0


def test_keras_model_with_unimp_optimizer_loads():
    utf = require_backend("tensorflow")
    import keras

    exp = _expected("keras_lso_model")
    model = keras.models.load_model(os.path.join(DATA, "keras_lso_model.keras"))
    assert isinstance(model.optimizer, utf.LossScaleOptimizer)
    assert model.optimizer.loss_scale_config.init_scale == 32768.0
    assert model.optimizer.loss_scale_config.growth_interval == 2000
    assert model.optimizer.inner_optimizer.__class__.__name__ == "SGD"
    pred = model.predict(np.asarray(exp["x"], "float32"), verbose=0).ravel()
    np.testing.assert_allclose(pred, exp["predict"], rtol=1e-6)
    # the model trains on after loading, through unimp's optimizer
    model.fit(np.asarray(exp["x"], "float32"), np.ones((8, 1), "float32"), batch_size=4, verbose=0)
    assert float(model.optimizer.loss_scale) == 32768.0


def test_jax_loss_scale_pickle_loads_and_adjusts():
    ujax = require_backend("jax")
    import jax.numpy as jnp

    with open(os.path.join(DATA, "jax_loss_scale.pkl"), "rb") as f:
        saved = pickle.load(f)
    ls = saved["loss_scale"]
    assert type(ls) is ujax.DynamicLossScale
    assert ls.state_dict()["state"] == {
        "scale": 256.0, "counter": 1, "consecutive_skips": 0, "total_skips": 1
    }
    assert ls.state_dict() == _expected("jax_loss_scale")
    assert float(ls.adjust(jnp.array(True)).adjust(jnp.array(True)).loss_scale) == 512.0
    inner = ujax.get_loss_scale(saved["opt_state"])
    assert type(saved["opt_state"]) is ujax.LossScaleOptState
    assert float(inner.loss_scale) == 256.0


@pytest.mark.parametrize("name", ["torch_gradscaler.pkl", "keras_lso_model.keras", "jax_loss_scale.pkl"])
def test_fixture_present(name):
    assert os.path.getsize(os.path.join(DATA, name)) > 0
