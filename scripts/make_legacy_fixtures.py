"""Writes the objects a user may have saved with an older unimp into ``tests/data/legacy/``.

Run once, with the code of the release whose objects must keep loading (these files were written
before the backends became packages, at commit a22b164); ``tests/test_legacy_objects.py`` loads
them with the current code. Do not re-run it to "fix" a failing load: the point of the files is
that they were written by the old code.

    python scripts/make_legacy_fixtures.py

Writes:
    torch_gradscaler.pkl      a pickled unimp GradScaler after 3 clean steps and one overflow
    keras_lso_model.keras     a Keras model compiled with unimp's LossScaleOptimizer, after fit
    jax_loss_scale.pkl        a pickled jax DynamicLossScale pytree and a loss_scaling opt_state
    expected.json             the values the loads must give (written from the live objects)
"""

from __future__ import annotations

import json
import os
import pickle
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np

import unimp
from unimp.loss_scale import DynamicLossScale

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "legacy")


def torch_scaler(expected: dict) -> None:
    import torch

    from unimp.backends.torch import GradScaler

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(DynamicLossScale(init_scale=1024.0, growth_interval=2), device="cpu")
    for bad in (False, False, False, True):
        opt.zero_grad()
        loss = model(torch.ones(4, 3)).sum() * (float("inf") if bad else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    with open(os.path.join(OUT, "torch_gradscaler.pkl"), "wb") as f:
        pickle.dump(scaler, f)
    expected["torch_gradscaler"] = scaler.state_dict()


def keras_model(expected: dict) -> None:
    import keras

    mp = unimp.mixed_precision("mixed_float16", backend="tensorflow", device="cpu")
    keras.utils.set_random_seed(0)
    with mp.autocast():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model, opt = mp.prepare(model, keras.optimizers.SGD(0.01), loss="mse")
    x = np.linspace(-1, 1, 24, dtype="float32").reshape(8, 3)
    y = np.ones((8, 1), "float32")
    model.fit(x, y, epochs=1, batch_size=4, verbose=0)
    model.save(os.path.join(OUT, "keras_lso_model.keras"))
    expected["keras_lso_model"] = {
        "state_dict": model.optimizer.state_dict(),
        "predict": model.predict(x, verbose=0).astype("float64").ravel().tolist(),
        "x": x.tolist(),
    }


def jax_pytree(expected: dict) -> None:
    import jax.numpy as jnp
    import optax

    from unimp.backends import jax as ujax

    ls = ujax.DynamicLossScale.from_config(DynamicLossScale(init_scale=256.0, growth_interval=3))
    for ok in (True, True, True, False, True):
        ls = ls.adjust(jnp.array(ok))
    opt = ujax.loss_scaling(optax.sgd(0.1), ls)
    state = opt.init({"w": jnp.ones(2)})
    with open(os.path.join(OUT, "jax_loss_scale.pkl"), "wb") as f:
        pickle.dump({"loss_scale": ls, "opt_state": state}, f)
    expected["jax_loss_scale"] = ls.state_dict()


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    expected: dict = {"written_by": f"unimp {unimp.__version__}"}
    torch_scaler(expected)
    keras_model(expected)
    jax_pytree(expected)
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
    print("wrote", sorted(os.listdir(OUT)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
