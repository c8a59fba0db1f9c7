"""JAX: a train step with everything on (float8 states, statistics, the step log, donated
buffers) compiles once per program and shape through applied and skipped steps (issue 31).

It found two faults: the user's weak-typed params (``jnp.full(shape, 0.5)``) came back strong
from the first call, which compiled again; and with ``donate=True`` a result's skip counters
were the new loss-scale state's buffers, deleted by the next call (reading an earlier result,
or the step log's close, raised "Array has been deleted")."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

import unimp
from unimp import fp8


def test_float8_statistics_and_log_compile_once_through_skipped_steps_with_donation(tmp_path):
    mp = unimp.mixed_precision("fp8-delayed", backend="jax")
    mp.fp8_layers(["first", "a", "last"])  # "a" in float8
    params = {"a": jnp.full((4, 4), 0.5), "last": jnp.full((4, 2), 0.25)}

    def forward(p, st, x):
        h = mp.fp8_matmul(st, "a", x, p["a"])
        return jnp.sum((h @ p["last"]).astype(jnp.float32) ** 2)

    def loss_fn(p, st, x):
        new = jax.grad(lambda s: forward(jax.lax.stop_gradient(p), s, x))(st)
        return forward(p, st, x), new

    log = tmp_path / "steps.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        step = mp.train_step(loss_fn, optax.sgd(0.01), params, model_state=mp.fp8_states(),
                             stats_every=3, log=str(log), donate=True)  # fmt: skip
        bad = {2, 5}  # a NaN input (float8 saturates an inf): a NaN loss, the step skipped
        batches = [jnp.full((2, 4), np.nan if i in bad else 0.1 * (i + 1), jnp.float32) for i in range(9)]
        results = [step(x) for x in batches[:2]]  # both programs compiled (calls 0 and 1)
        with jax.transfer_guard_device_to_host("disallow"):
            results += [step(x) for x in batches[2:]]
        applied = [bool(r.applied) for r in results]
    assert step.traces == 2  # the plain step and the statistics step, once each
    assert applied == [i not in bad for i in range(9)]
    # every result stays readable after later steps donated the state it came from
    assert [r.total_skips for r in results] == [0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert [r.stats is not None for r in results] == [i % 3 == 0 for i in range(9)]
    step.close()
    assert len(log.read_text().splitlines()) >= 9
