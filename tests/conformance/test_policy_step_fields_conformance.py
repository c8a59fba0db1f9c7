"""The policy's whole-step fields on every backend: the matmul precision is set for unimp's step and
``mp.autocast()`` and nothing leaks; ``accum_dtype`` is the dtype ``grad_accum_steps`` sums in."""

from __future__ import annotations

import importlib

import kits
import ml_dtypes
import numpy as np
import precision_kit
import pytest
from conftest import require_backend

# ------------------------------------------------------------------ matmul precision


def _setting(backend: str):
    """The framework's global setting(s) the table drives, read with its own current API."""
    return precision_kit.setting(backend)


def _expected(backend: str, name: str):
    return precision_kit.expected(backend, name)


@pytest.mark.parametrize("name", ["highest", "high", "medium"])
def test_autocast_sets_the_precision_and_restores_it(backend, name):
    mp = kits.mixed_precision(f"p=f32,c=bf16,o=f32,matmul={name}", backend=backend)
    before = _setting(backend)
    with mp.autocast():
        assert _setting(backend) == _expected(backend, name)
    assert _setting(backend) == before
    with pytest.raises(RuntimeError, match="boom"), mp.autocast():
        raise RuntimeError("boom")
    assert _setting(backend) == before


def test_no_precision_changes_nothing(backend):
    mp = kits.mixed_precision("mixed_bfloat16", backend=backend)
    before = _setting(backend)
    with mp.autocast():
        assert _setting(backend) == before


def _recording_step(backend: str, recipe: str, seen: list, fail: bool):
    """A one-weight train step whose loss_fn records the framework's setting (when it runs:
    each call in torch, at trace time in TensorFlow and JAX) and raises when ``fail``."""
    mp = kits.mixed_precision(recipe, backend=backend)

    def record():
        seen.append(_setting(backend))
        if fail:
            raise RuntimeError("boom in loss_fn")

    if backend == "torch":
        import torch

        model = torch.nn.Linear(2, 1)

        def loss_fn(m, x):
            record()
            return m(x).sum()

        return mp.train_step(model, torch.optim.SGD(model.parameters(), 0.1), loss_fn), torch.ones(3, 2)
    if backend == "tensorflow":
        import keras

        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])

        def loss_fn(m, x):
            record()
            return keras.ops.sum(m(x))

        return mp.train_step(model, keras.optimizers.SGD(0.1), loss_fn), np.ones((3, 2), np.float32)
    import jax.numpy as jnp
    import optax

    def loss_fn(p, x):
        record()
        return jnp.sum(x @ p["w"])

    params = {"w": np.ones((2, 1), np.float32)}
    return mp.train_step(loss_fn, optax.sgd(0.1), params), np.ones((3, 2), np.float32)


@pytest.mark.parametrize("name", ["highest", "high"])
def test_train_step_runs_under_the_precision_and_leaks_nothing(backend, name):
    before = _setting(backend)
    seen: list = []
    step, batch = _recording_step(backend, f"p=f32,matmul={name}", seen, fail=False)
    assert step(batch).applied
    assert seen[0] == _expected(backend, name)  # in force inside the step
    assert _setting(backend) == before  # and gone after it
    seen.clear()
    step, batch = _recording_step(backend, f"p=f32,matmul={name}", seen, fail=True)
    with pytest.raises(RuntimeError, match="boom in loss_fn"):
        step(batch)
    assert seen == [_expected(backend, name)]
    assert _setting(backend) == before  # restored after an exception too


def test_jax_step_is_traced_under_the_precision():
    require_backend("jax")  # JAX-only check: the precision must be in force at trace time
    import jax
    import jax.numpy as jnp
    import optax

    from unimp import mixed_precision

    seen = []

    def loss_fn(p, b):
        seen.append(jax.config.jax_default_matmul_precision)
        return jnp.sum(p["w"] @ b)

    mp = mixed_precision("p=f32,matmul=highest", backend="jax")
    step = mp.train_step(loss_fn, optax.sgd(0.1), {"w": np.ones((2, 2), np.float32)})
    step(np.ones((2,), np.float32))
    step(np.ones((2,), np.float32))
    assert seen == ["float32"] and step.traces == 1  # traced once, under "float32"
    assert jax.config.jax_default_matmul_precision is None


# ------------------------------------------------------------------ accumulation dtype

K = 64  # micro-batches; a power of two, so dividing by K is exact in every order


def _micro_gradients() -> list[np.ndarray]:
    """64 gradients around 1e-3 (4 elements each), float32: the linear kit's gradient is ``c``."""
    i = np.arange(K, dtype=np.float64)[:, None]
    j = np.arange(4, dtype=np.float64)[None, :]
    return list((1e-3 * (1.0 + 0.013 * i + 0.29 * j)).astype(np.float32))


def _bf16_window_mean(grads: list[np.ndarray]) -> np.ndarray:
    """The reference rule, step by step: each gradient rounded to bfloat16, added to the
    bfloat16 sum (which starts at exact zero) and the sum rounded to bfloat16 after every
    addition, then the mean taken in float32. The sums stay below 2**-3 and the addends above
    2**-10, so each float32 addition is exact and the only rounding is bfloat16's."""
    acc = np.zeros(4, ml_dtypes.bfloat16)
    for g in grads:
        acc = (acc.astype(np.float32) + g.astype(ml_dtypes.bfloat16).astype(np.float32)).astype(
            ml_dtypes.bfloat16
        )
    return acc.astype(np.float32) / np.float32(K)


@pytest.mark.slow  # 64 micro-batches (TensorFlow traces them unrolled): ~15 s per backend
def test_bfloat16_accumulation_loses_the_low_bits_it_must(backend):
    grads = _micro_gradients()
    window = [kits.linear_batch(g.tolist()) for g in grads]
    run = kits.build_linear(backend, "p=f32,accum=bf16", w=[0.0] * 4, lr=1.0, grad_accum_steps=K)
    assert run.step(window).applied
    expected = -_bf16_window_mean(grads)
    np.testing.assert_array_equal(run.w(), expected)  # bitwise: the backend rounds as the rule
    exact = -np.mean(np.stack(grads).astype(np.float64), axis=0)
    # what bfloat16 loses here (computed by the rule above, written literally): each addition to
    # a sum in [2**-4, 2**-3) rounds to a multiple of its unit in the last place, 2**-11
    # (~4.9e-4, half a typical addend), so the mean of 64 gradients ~1e-3 ends +0.68%, -0.34%,
    # -0.29% and +2.4% off the exact mean: the low bits lost are not averaged out.
    rel = (expected - exact) / exact
    np.testing.assert_allclose(rel, [0.006788, -0.003398, -0.002944, 0.024170], atol=2e-6)


@pytest.mark.slow
def test_float32_accumulation_matches_the_float32_reference(backend):
    grads = _micro_gradients()
    window = [kits.linear_batch(g.tolist()) for g in grads]
    ref = kits.build_linear(backend, "float32", w=[0.0] * 4, lr=1.0, grad_accum_steps=K)
    f32 = kits.build_linear(backend, "p=f32,accum=f32", w=[0.0] * 4, lr=1.0, grad_accum_steps=K)
    ref.step(window)
    f32.step(window)
    np.testing.assert_array_equal(f32.w(), ref.w())
    total = np.zeros(4, np.float32)
    for g in grads:  # float32, in order, from exact zeros
        total = total + g
    if backend == "tensorflow":
        # Grappler folds the unrolled float32 additions into one AddN, whose summation order is
        # its own: the same in the float32 reference (checked bitwise above), within 1e-6 here
        np.testing.assert_allclose(f32.w(), -(total / np.float32(K)), rtol=1e-6)
    else:
        np.testing.assert_array_equal(f32.w(), -(total / np.float32(K)))


def test_current_matmul_precision_reads_the_framework(backend):
    module = importlib.import_module(f"unimp.backends.{backend}")
    with module.matmul_precision("highest"):
        current = module.current_matmul_precision()
    flavour = precision_kit.flavour(backend)
    assert current == {"api": precision_kit.API[flavour], **precision_kit.expected(backend, "highest")}
    with pytest.raises(ValueError, match="'highest', 'high', 'medium'"), module.matmul_precision("tf32"):
        pass
