"""What a skipped step does to a learning-rate schedule (``train_step(schedule_counts=...)``), the
same in every backend: with infs injected at steps 0, 7 and 8, the learning-rate sequence is the
one written here, for each choice."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import require_backend

from unimp import mixed_precision

INF = float("inf")
SKIPPED = (0, 7, 8)
# the schedule 0.5 ** n (exact in float32 and float64), n = the schedule's step count after step i
EXPECTED_EXPONENTS = {
    "applied": [0, 1, 2, 3, 4, 5, 6, 6, 6, 7, 8, 9],  # skipped steps do not count
    "attempted": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],  # every step counts
}


def _torch(counts):
    import torch

    mp = mixed_precision("mixed_float16", backend="torch", device="cpu")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    step = mp.train_step(model, opt, lambda m, x: m(x).float().pow(2).mean(), scheduler=sched,
                         schedule_counts=counts)
    return lambda x: step(torch.as_tensor(x)), lambda: opt.param_groups[0]["lr"]


def _tensorflow(counts):
    import keras

    mp = mixed_precision("mixed_float16", backend="tensorflow")
    with mp.autocast():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    schedule = keras.optimizers.schedules.ExponentialDecay(1.0, decay_steps=1, decay_rate=0.5)
    model, opt = mp.prepare(model, keras.optimizers.SGD(schedule))
    import tensorflow as tf

    step = mp.train_step(model, opt, lambda m, x: tf.reduce_mean(tf.cast(m(x), tf.float32) ** 2),
                         schedule_counts=counts)
    return step, lambda: float(schedule(opt.inner_optimizer.iterations))


def _jax(counts):
    import jax
    import jax.numpy as jnp
    import optax

    mp = mixed_precision("mixed_float16", backend="jax")
    schedule = optax.exponential_decay(1.0, transition_steps=1, decay_rate=0.5)
    params = {"w": jnp.ones((2, 1), jnp.float32)}
    step = mp.train_step(lambda p, x: jnp.mean((x @ p["w"]) ** 2), optax.sgd(schedule), params,
                         schedule_counts=counts)

    def lr():
        counts_ = [x for path, x in jax.tree_util.tree_leaves_with_path(step.opt_state)
                   if getattr(path[-1], "name", None) == "count"]
        return float(schedule(counts_[0]))

    return step, lr


BUILD = {"torch": _torch, "tensorflow": _tensorflow, "jax": _jax}


@pytest.mark.parametrize("counts", list(EXPECTED_EXPONENTS))
def test_learning_rate_sequence_with_infs_at_0_7_8(backend, counts):
    require_backend(backend)
    step, lr = BUILD[backend](counts)
    seen, applied = [], []
    for i in range(12):
        x = np.full((4, 2), INF if i in SKIPPED else 0.1, np.float32)
        applied.append(step(x).applied)
        seen.append(lr())
    assert applied == [i not in SKIPPED for i in range(12)]
    assert seen == [0.5**n for n in EXPECTED_EXPONENTS[counts]]


def test_bad_schedule_counts_is_a_value_error(backend):
    require_backend(backend)
    with pytest.raises(ValueError, match="schedule_counts must be 'applied' or 'attempted'"):
        BUILD[backend]("skipped")
