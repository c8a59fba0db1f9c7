"""Dtype traces in every backend: the right values of the issue, on the compare models."""

from __future__ import annotations

import functools
import importlib

import numpy as np
import pytest
from conftest import BACKENDS, require_backend

from unimp.compare.run import CompareConfig
from unimp.compare.trace import trace_compare_model
from unimp.trace import HALF_DTYPES, OPS, Trace

COMPUTE = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}
HIDDEN = {"mlp": ("l1", "matmul"), "cnn": ("conv", "conv")}


@functools.cache
def _trace(backend: str, model: str, recipe: str) -> Trace:
    cfg = CompareConfig(recipe=recipe, backends=(backend,), model=model, batch_size=16)
    return trace_compare_model(cfg, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", ["mlp", "cnn"])
@pytest.mark.parametrize("recipe", ["mixed_float16", "mixed_bfloat16"])
def test_hidden_layer_runs_in_the_compute_dtype_forward_and_backward(backend, model, recipe):
    require_backend(backend)
    t = _trace(backend, model, recipe)
    layer, op = HIDDEN[model]
    for phase in ("forward", "backward"):
        ops = t.select(layer=layer, op=op, phase=phase)
        assert ops, f"no {op} in layer {layer} ({phase}): {t.summary()['by_layer']}"
        assert {r.compute for r in ops} == {COMPUTE[recipe]}
    # the output layer too: every framework computes it in the compute dtype and casts its
    # result to the output dtype (float32) afterwards
    assert {r.compute for r in t.select(layer="l2", op="matmul", phase="forward")} == {COMPUTE[recipe]}


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_loss_is_computed_in_float32(backend):
    require_backend(backend)
    t = _trace(backend, "mlp", "mixed_float16")
    loss = [r for r in t if r.phase == "forward" and r.op in ("cross_entropy", "log_softmax")]
    assert loss, "no cross-entropy op found"
    assert {r.compute for r in loss if r.counted} == {"float32"}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_a_float32_recipe_runs_no_half_precision_op(backend, model):
    require_backend(backend)
    t = _trace(backend, model, "float32")
    half = [r for r in t if set(r.inputs + r.outputs) & set(HALF_DTYPES)]
    assert half == []
    assert t.casts() == [] or all(set(c.outputs) <= {"float32", "float64"} for c in t.casts())


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_casts_are_listed(backend):
    require_backend(backend)
    t = _trace(backend, "mlp", "mixed_float16")
    casts = t.casts()
    into_half = [c for c in casts if c.outputs[0] == "float16" and c.inputs[0] == "float32"]
    assert into_half, "the float32 weights / inputs are cast to float16 somewhere"
    # and the logits come back to float32 (the output dtype) before the loss
    forward = [r for r in t if r.phase == "forward"]
    first_loss = next(i for i, r in enumerate(forward) if r.op in ("cross_entropy", "log_softmax"))
    back = [r for r in forward[:first_loss] if r.op == "cast" and r.inputs[0] == "float16"]
    assert back and back[-1].outputs[0] == "float32"
    assert t.summary()["casts"] == len(casts) > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_native_names_map_into_the_shared_vocabulary(backend):
    require_backend(backend)
    module = importlib.import_module(f"unimp.backends.{backend}.trace")
    assert set(module._NATIVE.values()) <= set(OPS)
    assert all(op in OPS for op, _ in module.NOTES.items())
    t = _trace(backend, "mlp", "mixed_float16")
    assert {r.phase for r in t} == {"forward", "backward", "update"}
    assert all(r.framework == backend for r in t)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mp_trace_of_a_plain_function(backend):
    be = require_backend(backend)
    mp = be.MixedPrecision("mixed_bfloat16")
    x = np.ones((2, 3), np.float32)
    w = np.ones((3, 4), np.float32)
    if backend == "torch":
        import torch

        fn, args = (lambda a, b: mp.cast_to_compute(a) @ mp.cast_to_compute(b)), (torch.tensor(x), torch.tensor(w))
    elif backend == "tensorflow":
        import tensorflow as tf

        fn, args = (lambda a, b: tf.matmul(mp.cast_to_compute(a), mp.cast_to_compute(b))), (tf.constant(x), tf.constant(w))
    else:
        import jax.numpy as jnp

        fn, args = (lambda a, b: mp.cast_to_compute(a) @ mp.cast_to_compute(b)), (jnp.asarray(x), jnp.asarray(w))
    t = mp.trace(fn, *args)
    (mm,) = t.select(op="matmul")
    assert mm.compute == "bfloat16" and mm.phase == "forward"
    assert len([c for c in t.casts() if c.outputs == ("bfloat16",)]) == 2
    assert "bfloat16" in t.recipe


@pytest.mark.parametrize("backend", BACKENDS)
def test_tracing_a_step_changes_nothing(backend):
    """torch runs the step under the dispatch mode and puts everything back; TensorFlow and JAX
    trace it without running or compiling it again."""
    require_backend(backend)
    import unimp.compare.trace as ct

    cfg = CompareConfig(recipe="mixed_float16", backends=(backend,), model="mlp", batch_size=16)
    spec, batch = ct._spec(cfg, ct.get_recipe("mixed_float16"), backend)
    runner = importlib.import_module(f"unimp.compare.runner_{backend}")
    mp, step, convert = runner.build(spec)
    b = convert(batch)
    step(b)  # one real step first: state to compare against, a compiled step to keep
    before = _state(backend, step)
    t = mp.trace(step, b)
    assert len(t) > 0
    after = _state(backend, step)
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)


def _state(backend, step):
    if backend == "torch":
        out = {f"p:{n}": p.detach().numpy().copy() for n, p in step.model.named_parameters()}
        for i, s in enumerate(step.optimizer.state.values()):
            out.update({f"o{i}:{k}": np.asarray(v).copy() for k, v in s.items()})
        out.update({f"ls:{k}": np.asarray(v) for k, v in step.scaler.state_dict()["state"].items()})
        return out
    if backend == "tensorflow":
        out = {f"v:{v.path}": v.numpy().copy() for v in step.model.variables}
        out["traces"] = np.asarray(step.tracing_count())
        return out
    import jax

    leaves = jax.tree_util.tree_leaves((step.params, step.opt_state, step.loss_scale))
    out = {f"l{i}": np.asarray(x).copy() for i, x in enumerate(leaves)}
    out["traces"] = np.asarray(step.traces)
    return out


@pytest.mark.parametrize("recipe", ["mixed_float16", "O2"])
def test_torch_training_after_a_trace_equals_an_untraced_twin(recipe):
    """Review finding: module mode (O2), the scheduler, dropout's random state and the
    statistics step all came out of a trace changed; now a traced step trains on exactly as an
    untraced one, and the trace is of a plain step."""
    require_backend("torch")
    import torch

    import unimp

    def build():
        torch.manual_seed(0)
        mp = unimp.mixed_precision(recipe, backend="torch")
        m = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.ReLU(), torch.nn.Linear(8, 2)
        )
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        r = mp.prepare(m, opt)
        m, opt = r if isinstance(r, tuple) else (r, opt)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1 / (1 + e))
        step = mp.train_step(
            m, opt, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]).float(), b[1]),
            scheduler=sched, grad_accum_steps=2, stats_every=1,
        )  # fmt: skip
        return mp, m, step

    g = torch.Generator().manual_seed(1)
    batch = [(torch.randn(3, 4, generator=g), torch.tensor([0, 1, 1]))] * 2
    torch.manual_seed(5)
    _, m1, s1 = build()
    first = [s1(batch).loss for _ in range(3)]
    torch.manual_seed(5)
    mp2, m2, s2 = build()
    t = mp2.trace(s2, batch)
    second = [s2(batch).loss for _ in range(3)]
    assert first == second
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters(), strict=True))
    # both micro-batches' losses are forward ops; no statistics op was recorded
    assert [r.phase for r in t if r.op == "cross_entropy"] == ["forward", "backward"] * 2
    assert not [r for r in t if r.native in ("aten.amin", "aten.amax")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_micro_batch_forward_is_forward(backend):
    """Review finding: with grad_accum_steps > 1 the second micro-batch's ops were labelled
    update (torch) or backward (TensorFlow)."""
    require_backend(backend)
    import unimp.compare.trace as ct

    cfg = CompareConfig(recipe="mixed_float16", backends=(backend,), model="mlp", batch_size=16)
    spec, batch = ct._spec(cfg, ct.get_recipe("mixed_float16"), backend)
    spec.step_options = lambda: {"grad_accum_steps": 2}
    mp, step, convert = importlib.import_module(f"unimp.compare.runner_{backend}").build(spec)
    b = convert(batch)
    t = mp.trace(step, [b, b])
    # JAX accumulates with lax.scan: one program whose body, listed once, runs per micro-batch
    n = 1 if backend == "jax" else 2
    assert len(t.select(layer="l1", op="matmul", phase="forward")) == n
    assert len(t.select(layer="l2", op="matmul", phase="forward")) == n
