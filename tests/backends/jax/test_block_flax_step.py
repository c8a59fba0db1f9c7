"""jax backend, ``blockscale``: the flax path of a block-scaled recipe whose gradients round
stochastically (``nvfp4``) draws fresh random bits each step: ``mp.module_kwargs(path, step=)``
takes the step, and without it the Dense keeps a step counter in flax's
``_overwrite_with_gradient`` collection (as the float8 states are kept), advanced by its
"gradient"; the same seed and step give the same bits."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import unimp
from unimp.backends.jax.blockscale import block_scaled_matmul

WIDTH = 128  # NVFP4's 16x16 weight tiles and 1x16 blocks, the batch rows too


@pytest.fixture(scope="module")
def setup():
    mp = unimp.mixed_precision("nvfp4", backend="jax")
    mp.fp8_layers(["fc0", "fc1", "fc2"])  # the first and last stay out: fc1 runs NVFP4
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32))
    g = jnp.asarray(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32))  # the output's gradient
    return mp, x, g


@pytest.mark.slow
def test_each_step_rounds_afresh_and_the_same_step_reproduces(setup):
    mp, x, g = setup
    assert mp.module_kwargs("fc1", step=3).keys() == {"dtype", "param_dtype", "dot_general"}

    # an explicit step, traced through the model's call (as a train step's count would be)
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, step):
            return nn.Dense(WIDTH, name="fc1", **mp.module_kwargs("fc1", step=step))(x)

    net = Net()
    v = net.init(jax.random.PRNGKey(0), x, 0)
    kernel = v["params"]["fc1"]["kernel"]
    grad = jax.jit(jax.grad(lambda v, s: jnp.sum(net.apply(v, x, s).astype(jnp.float32) * g)))
    one, two, again = (np.asarray(grad(v, jnp.int32(s))["params"]["fc1"]["kernel"]) for s in (1, 2, 1))
    assert grad._cache_size() == 1  # one compilation: the step is an argument, not a constant
    assert not np.array_equal(one, two)  # fresh bits at another step
    np.testing.assert_array_equal(one, again)  # the same seed and step: bit for bit
    # the bits of block_scaled_matmul at that step (the Dense multiplies in bfloat16)
    direct = jax.jit(jax.grad(lambda w: jnp.sum(block_scaled_matmul(
        x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), "nvfp4", "in_out", 0, 1).astype(jnp.float32) * g)))
    np.testing.assert_array_equal(one, np.asarray(direct(kernel)))

    # no step: the Dense keeps a counter in _overwrite_with_gradient, whose "gradient" is the next
    kwargs = mp.module_kwargs("fc1")
    assert "dot_general_cls" in kwargs and "dot_general" not in kwargs
    dense = nn.Dense(WIDTH, **kwargs)
    v0 = dense.init(jax.random.PRNGKey(0), x)
    assert v0["_overwrite_with_gradient"]["BlockDotGeneral_0"]["step"].dtype == jnp.float32
    v0 = {**v0, "params": {**v0["params"], "kernel": kernel}}
    counted = jax.jit(jax.grad(lambda v: jnp.sum(dense.apply(v, x).astype(jnp.float32) * g)))
    g0 = counted(v0)  # at step 0
    v1 = {**v0, "_overwrite_with_gradient": g0["_overwrite_with_gradient"]}  # as TrainState overwrites it
    g1 = counted(v1)
    steps = [float(d["_overwrite_with_gradient"]["BlockDotGeneral_0"]["step"]) for d in (v0, g0, g1)]
    assert steps == [0.0, 1.0, 2.0]
    k0, k1 = (np.asarray(d["params"]["kernel"]) for d in (g0, g1))
    assert not np.array_equal(k0, k1)  # steps 0 and 1 round differently
    np.testing.assert_array_equal(k1, one)  # the counter's step 1 is the explicit step 1, bit for bit
    y = dense.apply(v1, x)  # the forward pass alone reads the counter
    assert y.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))


def test_rules_that_round_to_nearest_take_no_counter():
    mp = unimp.mixed_precision("mxfp8", backend="jax")
    mp.fp8_layers(["fc0", "fc1", "fc2"])
    assert mp.module_kwargs("fc1").keys() == mp.module_kwargs("fc1", step=5).keys() == {"dtype", "param_dtype", "dot_general"}
