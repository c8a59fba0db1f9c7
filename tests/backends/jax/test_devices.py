"""jax backend, ``devices``: version, device parsing and placement, device_info."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import unimp.backends.jax as ujax
from backends.jax.helpers import _affine_loss


def test_device_info_lists_every_jax_device():
    # the keys, the recommended recipe and framework_version: tests/conformance/test_backend_api.py
    assert len(ujax.device_info()) == len(jax.devices())


def test_device_commits_the_step_state_and_batches_there():
    mp = ujax.MixedPrecision("mixed_float16", device="cpu")
    assert mp.device == jax.devices("cpu")[0]
    step = mp.train_step(_affine_loss, optax.sgd(0.1), {"w": np.ones(2, np.float32), "b": np.float32(0.0)})
    step(np.ones(2, np.float32))  # a host batch is put on the device
    step(jnp.ones(2))
    leaves = jax.tree_util.tree_leaves((step.params, step.opt_state, step.loss_scale))
    assert all(x.committed and x.devices() == {mp.device} for x in leaves)
    assert step.traces == 1
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    with pytest.raises(ValueError, match="device= and mesh="):
        mp.train_step(_affine_loss, optax.sgd(0.1), {"w": jnp.ones(2)}, axis_name="data", mesh=mesh)
    with pytest.raises(ValueError, match="not a device unimp reads"):
        ujax.MixedPrecision("mixed_float16", device="abacus")
