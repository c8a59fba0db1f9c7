"""Tensor statistics are the same in every backend (``UNIMP_TEST_BACKENDS``): each backend's
``tensor_stats`` against ``unimp.stats.reference_stats`` on synthetic tensors (counts exactly,
magnitudes to 1e-6 relative), right values written as literals, and one model, weights and batch
giving the same gradient and activation statistics through every backend's ``train_step``.

The model's numbers are chosen so every float32 operation in it is exact (small integers times
a power of two per hidden unit): each framework computes bitwise the same tensors as NumPy,
whatever its summation order, so the statistics must match exactly.
"""

from __future__ import annotations

import doctest
import functools
import importlib
import math

import kits
import numpy as np
import pytest
from conftest import require_backend

from unimp import StaticLossScale, get_recipe, mixed_precision
from unimp.blockscale_linear import BLOCK_LINEAR_RULES
from unimp.blockscale_presets import quantization_error
from unimp.stats import (
    BLOCK_FORMATS,
    COUNT_FIELDS,
    TensorStats,
    block_layout,
    merge_block_sums,
    reference_stats,
)

POWERS = np.array([2.0**-k for k in range(41)], np.float32)
BF16_OVERFLOW = (2 - 2.0**-8) * 2.0**127


# -- each backend's arrays ----------------------------------------------------------------------


def _tensor(backend, x, dtype="float32"):
    """``x`` (float32 NumPy) as the backend's tensor of ``dtype``."""
    mod = require_backend(backend)
    if backend == "torch":
        import torch

        return torch.from_numpy(np.array(x, np.float32)).to(mod.to_dtype(dtype))
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.cast(tf.constant(np.array(x, np.float32)), mod.to_dtype(dtype))
    import jax.numpy as jnp

    return jnp.asarray(np.array(x, np.float32)).astype(mod.to_dtype(dtype))


def _numpy(backend, t):
    if backend == "torch":
        return t.detach().float().cpu().numpy()
    return np.asarray(t).astype(np.float32) if backend == "jax" else t.numpy().astype(np.float32)


def _device_scale(backend, s):
    """A float32 scalar on the device, as the loss scale is in a step."""
    return _tensor(backend, np.float32(s))


def _stats(backend, t, scale):
    mod = require_backend(backend)
    counts, mags = mod.tensor_stats(t, scale)
    return TensorStats.from_arrays(
        int(np.size(_numpy(backend, t))),
        float(np.float32(_numpy(backend, scale) if not isinstance(scale, float) else scale)),
        _numpy(backend, counts) if backend != "torch" else counts.cpu().numpy(),
        _numpy(backend, mags),
    )


def _daz(backend):
    """Whether the backend reads float32 subnormals as zero here (TensorFlow and XLA on CPU)."""
    counts, _ = require_backend(backend).tensor_stats(_tensor(backend, [2.0**-130]))
    c = counts.cpu().numpy() if backend == "torch" else np.asarray(counts)
    return int(c[COUNT_FIELDS.index("zeros")]) == 1


def assert_same(got: TensorStats, want: TensorStats) -> None:
    assert got.size == want.size and got.scale == want.scale
    assert dict(got.counts) == dict(want.counts)
    for name in ("amax", "min_nonzero"):
        g, w = getattr(got, name), getattr(want, name)
        if math.isnan(w) or math.isinf(w) or w == 0:
            assert (math.isnan(g) and math.isnan(w)) or g == w, name
        else:
            assert g == pytest.approx(w, rel=1e-6), name


# -- synthetic tensors --------------------------------------------------------------------------

_rng = np.random.default_rng(0)
CASES = {
    "powers": POWERS,
    "float16-overflow-edge": np.array([65519, 65520, 65504, 65505, -65520, 7], np.float32),
    "bfloat16-overflow-edge": np.array(
        [np.nextafter(np.float32(BF16_OVERFLOW), np.float32(0)), BF16_OVERFLOW, 3.4e38, 1.0],
        np.float32,
    ),
    "zeros-inf-nan": np.array([0, -0.0, np.inf, -np.inf, np.nan, 1, -2.5], np.float32),
    "all-zero": np.zeros((3, 4), np.float32),
    "empty": np.zeros((0,), np.float32),
    "wide-random": (
        _rng.normal(size=(40, 25)) * 10.0 ** _rng.uniform(-12, 6, size=(40, 25))
    ).astype(np.float32),
    # one NaN among 4,096 (XLA's CPU reduce-max dropped it in reductions this large)
    "nan-in-a-large-tensor": np.where(np.arange(4096) == 1234, np.nan, np.linspace(-3, 5, 4096)).astype(np.float32).reshape(64, 64),
}
SCALES = [1.0, 2.0**15, 3.0, 2.0**-3]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("scale", SCALES)
def test_tensor_stats_equal_reference(backend, case, scale):
    x = CASES[case]
    t = _tensor(backend, x)
    assert_same(_stats(backend, t, scale), reference_stats(x, scale))


def test_a_compiled_statistics_step_keeps_the_nan_of_a_large_tensor(backend):
    """As eagerly (``nan-in-a-large-tensor`` above), under XLA too: ``jax.jit`` and
    ``tf.function(jit_compile=True)``, where XLA's CPU reduce-max drops a NaN (TensorFlow from
    16 elements on); torch's amax keeps it (eager here, as its statistics steps run)."""
    mod = require_backend(backend)
    x = CASES["nan-in-a-large-tensor"]
    fn = mod.tensor_stats
    if backend == "jax":
        import jax

        fn = jax.jit(fn)
    elif backend == "tensorflow":
        import tensorflow as tf

        fn = tf.function(fn, jit_compile=True)
    _, mags = fn(_tensor(backend, x))
    assert math.isnan(float(_numpy(backend, mags)[0]))


@pytest.mark.parametrize("case", ["powers", "wide-random", "zeros-inf-nan"])
def test_a_device_scale_gives_the_same(backend, case):
    x = CASES[case]
    got = _stats(backend, _tensor(backend, x), _device_scale(backend, 2.0**15))
    assert_same(got, reference_stats(x, 2.0**15))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_input_tensors(backend, dtype):
    # float16: its subnormals (2**-24 ..) are float32 normals; bfloat16: kept at or above
    # 2**-126 (below, XLA and TensorFlow on CPU read float32 subnormals as zero)
    low = 24 if dtype == "float16" else 40
    x = np.concatenate([POWERS[: low + 1], [65504.0, -3.0, 0.0, np.inf, np.nan]]).astype(np.float32)
    t = _tensor(backend, x, dtype)
    as_read = _numpy(backend, t)  # the tensor's own values, rounded to the dtype
    assert_same(_stats(backend, t, 2.0**10), reference_stats(as_read, 2.0**10))


def test_powers_of_two_right_values(backend):
    # the known answer: one value per power of two from 2**-40 to 2**0
    t = _tensor(backend, POWERS)
    one, big = _stats(backend, t, 1.0), _stats(backend, t, 2.0**15)
    assert one.counts["float16_flush"] == 16 and one.counts["float16_subnormal"] == 10
    assert big.counts["float16_flush"] == 1 and big.counts["float16_overflow"] == 0
    edge = _stats(backend, _tensor(backend, [65519.0, 65520.0]), 1.0)
    assert edge.counts["float16_overflow"] == 1
    assert one.amax == 1.0 and one.min_nonzero == 2.0**-40


def test_tensor_stats_counts_in_int32_and_magnitudes_in_float32(backend):
    module = require_backend(backend)
    x = kits.native(backend, [0.0, 2.0**-30, -3.0, np.inf], "float64")  # JAX: float32 (no x64)
    counts, mags = module.tensor_stats(x, np.float32(2.0**10))
    assert (kits.dtype_name(counts.dtype), kits.dtype_name(mags.dtype)) == ("int32", "float32")
    assert dict(zip(COUNT_FIELDS, _numpy(backend, counts).astype(int).tolist(), strict=True))["nonfinite"] == 1
    _, mags = module.tensor_stats(kits.native(backend, [1.0, 1.0], "float64"), np.float32(4.0))
    assert _numpy(backend, mags).tolist() == [1.0, 1.0]  # amax, min_nonzero


def test_tensor_stats_refuses_integers_and_bad_scales(backend):
    module = require_backend(backend)
    for dtype in ("int32", "int64"):
        with pytest.raises(TypeError, match="tensor_stats needs a floating (tensor|array)"):
            module.tensor_stats(kits.native(backend, [1, 2, 3], dtype))
    for scale in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            module.tensor_stats(kits.native(backend, [1.0, 2.0]), scale)


DOCUMENTED = {"torch": ("tensor_stats",), "tensorflow": ("tensor_stats",), "jax": ("tensor_stats", "observe")}


def test_the_stats_docstring_examples_run(backend):
    require_backend(backend)
    module = importlib.import_module(f"unimp.backends.{backend}.stats")
    for name in DOCUMENTED[backend]:
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        for test in doctest.DocTestFinder().find(getattr(module, name), globs=vars(module)):
            runner.run(test)
        assert runner.failures == 0 and runner.tries > 0, name


def test_float32_subnormals_follow_the_documented_rule(backend):
    x = np.array([2.0**-127, 2.0**-133, 2.0**-134, 2.0**-140, 2.0**-126, 1.0], np.float32)
    got = _stats(backend, _tensor(backend, x), 1.0)
    if _daz(backend):  # read as zero: zeros, not bfloat16 subnormals or flushes
        want = reference_stats(np.where(np.abs(x) < 2.0**-126, 0, x), 1.0)
    else:
        want = reference_stats(x, 1.0)
        assert want.counts["bfloat16_subnormal"] == 2 and want.counts["bfloat16_flush"] == 2
    assert_same(got, want)
    assert backend != "torch" or not _daz(backend)  # torch keeps subnormals, as NumPy


# -- one model through every train_step -----------------------------------------------------------
# x (8, 4) -> l1 Dense 8 -> act ReLU -> l2 Dense 3 -> out;  loss = mean_b sum_k out * c.
# Hidden unit j lives at 2**E[j]: l1's column j is small integers times 2**E[j] and l2's row j
# small integers times 2**-E[j], so every product and partial sum in the forward and backward
# pass is an integer times one power of two: exact in float32 in any order.

E = np.array([-38, -27, -12, 0, 4, 10, 14, 16])
SCALE = 2.0**10


def _model_numbers():
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, (8, 4)).astype(np.float32)
    w1 = (rng.integers(-3, 4, (4, 8)) * 2.0**E).astype(np.float32)
    b1 = (rng.integers(-2, 3, 8) * 2.0**E).astype(np.float32)
    w2 = (rng.integers(-3, 4, (8, 3)) * 2.0 ** -E[:, None]).astype(np.float32)
    b2 = rng.integers(-2, 3, 3).astype(np.float32)
    c = rng.integers(-3, 4, (8, 3)).astype(np.float32)
    return {"w1": w1, "b1": b1, "w2": w2, "b2": b2}, x, c


def _expected(x_scale=1.0):
    w, x, c = _model_numbers()
    x = x * np.float32(x_scale)
    pre = x.astype(np.float64) @ w["w1"] + w["b1"]
    act = np.maximum(pre, 0)
    out = act @ w["w2"] + w["b2"]
    d_out = c / 8.0
    d_act = d_out @ w["w2"].T
    d_pre = d_act * (pre > 0)
    grads = {
        "l1/kernel": x.T @ d_pre,
        "l1/bias": d_pre.sum(0),
        "l2/kernel": act.T @ d_out,
        "l2/bias": d_out.sum(0),
    }
    acts = {"l1": pre, "act": act, "l2": out}
    for v in (*grads.values(), *acts.values()):  # every value is exact in float32
        assert np.array_equal(v, v.astype(np.float32))
    return grads, acts


def _torch_step(recipe, w, stats_every, **options):
    from collections import OrderedDict

    import torch

    mp = mixed_precision(recipe, backend="torch", device="cpu")
    model = torch.nn.Sequential(
        OrderedDict(l1=torch.nn.Linear(4, 8), act=torch.nn.ReLU(), l2=torch.nn.Linear(8, 3))
    )
    with torch.no_grad():
        for name in ("l1", "l2"):
            i = name[1]
            getattr(model, name).weight.copy_(torch.from_numpy(w[f"w{i}"].T.copy()))
            getattr(model, name).bias.copy_(torch.from_numpy(w[f"b{i}"]))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def loss_fn(m, b):
        return (m(b[0]) * b[1]).sum(1).mean()

    step = mp.train_step(model, opt, loss_fn, stats_every=stats_every, **options)
    names = {"l1.weight": "l1/kernel", "l1.bias": "l1/bias", "l2.weight": "l2/kernel", "l2.bias": "l2/bias"}
    def convert(b):  # a batch (x, c), or a list of micro-batches
        return [convert(m) for m in b] if isinstance(b, list) else tuple(torch.from_numpy(a) for a in b)

    return (lambda b: step(convert(b))), names, {n: n for n in ("l1", "act", "l2")}


def _tensorflow_step(recipe, w, stats_every, **options):
    import keras
    import tensorflow as tf

    mp = mixed_precision(recipe, backend="tensorflow")
    with mp.autocast():
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(8, name="l1"),
                keras.layers.ReLU(name="act"),
                keras.layers.Dense(3, name="l2"),
            ],
            name="mlp",
        )
    model.get_layer("l1").set_weights([w["w1"], w["b1"]])
    model.get_layer("l2").set_weights([w["w2"], w["b2"]])

    def loss_fn(m, b):
        return tf.reduce_mean(tf.reduce_sum(m(b[0]) * b[1], axis=1))

    step = mp.train_step(model, keras.optimizers.SGD(0.0), loss_fn, stats_every=stats_every, **options)
    # one naming rule: from the model down without the model's own name ("mlp/l1/kernel" is
    # Keras's variable.path), the names JAX gives the same tensors
    assert model.trainable_variables[0].path == "mlp/l1/kernel"
    names = {n: n for n in ("l1/kernel", "l1/bias", "l2/kernel", "l2/bias")}
    return step, names, {n: n for n in ("l1", "act", "l2")}


def _jax_step(recipe, w, stats_every, **options):
    import jax
    import jax.numpy as jnp
    import optax

    from unimp.backends.jax import observe

    mp = mixed_precision(recipe, backend="jax")

    def loss_fn(p, b):
        pre = observe("l1", b[0] @ p["l1"]["kernel"] + p["l1"]["bias"])
        act = observe("act", jax.nn.relu(pre))
        out = observe("l2", act @ p["l2"]["kernel"] + p["l2"]["bias"])
        return jnp.mean(jnp.sum(out * b[1], axis=1))

    params = {
        "l1": {"kernel": jnp.asarray(w["w1"]), "bias": jnp.asarray(w["b1"])},
        "l2": {"kernel": jnp.asarray(w["w2"]), "bias": jnp.asarray(w["b2"])},
    }
    step = mp.train_step(loss_fn, optax.sgd(0.0), params, stats_every=stats_every, **options)
    names = {n: n for n in ("l1/kernel", "l1/bias", "l2/kernel", "l2/bias")}
    return step, names, {n: n for n in ("l1", "act", "l2")}


BUILDERS = {"torch": _torch_step, "tensorflow": _tensorflow_step, "jax": _jax_step}


@functools.cache
def _model_stats(backend, stats_every=1):
    """The results of three steps of the model (built once per backend for the tests below)."""
    require_backend(backend)
    w, x, c = _model_numbers()
    recipe = get_recipe("float32", loss_scale=StaticLossScale(SCALE))
    step, grad_names, act_names = BUILDERS[backend](recipe, w, stats_every)
    results = [step((x, c)) for _ in range(3)]
    return results, grad_names, act_names


def test_the_same_model_gives_the_same_gradient_statistics(backend):
    (r, *_), grad_names, _ = _model_stats(backend)
    grads, _ = _expected()
    got = {grad_names[k]: v for k, v in r.stats.gradients.items()}
    assert set(got) == set(grads)
    for name, g in grads.items():
        assert_same(got[name], reference_stats(g, SCALE))
    # the case is not trivial: something flushes, is subnormal and overflows in float16
    for field in ("zeros", "float16_overflow", "float16_subnormal", "float16_flush"):
        assert sum(v.counts[field] for v in got.values()) > 0, field
    assert r.stats.step == 0


def test_the_same_model_gives_the_same_activation_statistics(backend):
    (r, *_), _, act_names = _model_stats(backend)
    _, acts = _expected()
    got = {act_names[k]: v for k, v in r.stats.activations.items() if k in act_names}
    assert set(got) == set(acts)
    for name, a in acts.items():
        assert_same(got[name], reference_stats(a, 1.0))
    pre = got["l1"]
    assert pre.counts["float16_overflow"] > 0 and pre.counts["float16_flush"] > 0
    assert got["act"].counts["zeros"] > 0  # ReLU's exact zeros
    assert got["act"].size == 64 and got["l2"].size == 24


def test_statistics_come_on_steps_0_k_2k(backend):
    require_backend(backend)
    w, x, c = _model_numbers()
    recipe = get_recipe("float32", loss_scale=StaticLossScale(SCALE))
    step, _, _ = BUILDERS[backend](recipe, w, 3)
    got = [step((x, c)).stats for _ in range(7)]
    assert [s is not None for s in got] == [True, False, False, True, False, False, True]
    assert [s.step for s in got if s is not None] == [0, 3, 6]


def test_gradient_statistics_are_unscaled_and_taken_before_clipping(backend):
    # static scale 2**16, gradient (3, 4), clipped to norm 1: the statistics see (3, 4)
    recipe = get_recipe("float32", loss_scale=StaticLossScale(2.0**16))
    run = kits.build_linear(backend, recipe, w=[0.0, 0.0], lr=1.0, max_grad_norm=1.0, stats_every=1)
    r = run.step(kits.linear_batch([3.0, 4.0]))
    ((_, g),) = r.stats.gradients.items()
    assert (g.amax, g.min_nonzero, g.scale) == (4.0, 3.0, 65536.0)  # not clipped to (0.6, 0.8)
    assert g.counts["float16_overflow"] == 2  # 3 * 2**16 and 4 * 2**16 overflow float16
    assert r.grad_norm == 5.0
    assert r.stats.activations == {}  # the loss reads the weight and calls no layer


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_bad_stats_every_is_refused_before_anything_is_built(backend, value):
    require_backend(backend)
    mp = mixed_precision("mixed_float16", backend=backend)
    with pytest.raises(ValueError, match=r"stats_every must be None \(no statistics\) or an int >= 1"):
        mp.train_step("not a model", "not an optimizer", None, stats_every=value)  # checked first


# -- the block formats' quantization error (stats_formats) ----------------------------------------

_blocks = np.random.default_rng(5)
BLOCK_CASES = {
    # whole blocks, so quantization_error of the tensor itself is the reference: seven normal
    # rows and one 1e-37 below them, where MXFP8's round-up byte is 0, a block Transformer
    # Engine leaves unscaled (all of it rounds to 0), and NVFP4's E4M3 block scale is 0 too
    "normal-and-a-tiny-row": np.concatenate(
        [_blocks.standard_normal((7, 256)), 1e-37 * (1 + _blocks.random((1, 256)))]
    ).astype(np.float32),
    # a last axis of 50 (padded to 128) and magnitudes over nine decades, none subnormal
    "wide-and-ragged": (_blocks.standard_normal((2, 3, 50)) * 10.0 ** _blocks.uniform(-6, 3, (2, 3, 50))).astype(np.float32),
    "zeros-inf-nan": np.array([[0.0, np.inf, -2.0, np.nan] + [0.5] * 28, [1.0] * 32], np.float32),
    "empty": np.zeros((0, 40), np.float32),
}


def _padded(x):
    rows, cols, padded = block_layout(x.shape)
    return np.pad(np.abs(x).reshape(rows, cols), ((0, 0), (0, padded - cols)))


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_block_format_statistics_equal_quantization_error(backend, case):
    """Every backend's ``tensor_stats(x, formats=...)`` on its own tensors (JAX's compiled, as
    its steps run it): the underflow counts of the reference exactly, the sums to float32
    rounding, and the shares the NumPy ``quantization_error`` of the rule's preset gives for
    the (zero-padded) tensor."""
    x = BLOCK_CASES[case]
    module = require_backend(backend)
    fn = functools.partial(module.tensor_stats, scale=1.0, formats=BLOCK_FORMATS)
    if backend == "jax":  # compiled once (eagerly, JAX compiles each op of the rule on its own)
        import jax

        fn = jax.jit(fn)
    counts, mags = fn(_tensor(backend, x))
    got = TensorStats.from_arrays(x.size, 1.0, _numpy(backend, counts) if backend != "torch" else counts.cpu().numpy(),
                                  _numpy(backend, mags), BLOCK_FORMATS)
    want = reference_stats(x, 1.0, BLOCK_FORMATS)
    assert_same(got, want)
    assert got.formats == BLOCK_FORMATS
    for name, value in want.sums.items():
        assert got.sums[name] == pytest.approx(value, rel=2e-6, abs=1e-30), name
    if x.size == 0:
        return
    for fmt in BLOCK_FORMATS:
        rule = BLOCK_LINEAR_RULES[fmt]
        ref = quantization_error(_padded(x), rule.preset, "activation", rule.format("activation"))
        assert got.underflow(fmt) == pytest.approx(float(ref.underflow), rel=1e-6), fmt
        assert got.relative_mse(fmt) == pytest.approx(float(ref.relative_mse), rel=1e-5), fmt
    if case == "normal-and-a-tiny-row":
        # the tiny row is lost in MXFP8 and NVFP4 (beside FP4's usual few %), kept in block FP8;
        # the normal rows' error: about 7e-4 with FP8's 3 mantissa bits, about 1e-2 in FP4
        assert got.underflow("mxfp8") == 1 / 8 and got.underflow("fp8_block") == 0
        assert got.underflow("nvfp4") > 1 / 8 + 0.02 and got.underflow("mxfp4") > 0.03
        assert 5e-4 < got.relative_mse("mxfp8") < 1e-3 and 5e-3 < got.relative_mse("nvfp4") < 2e-2


@pytest.mark.slow
def test_block_format_statistics_through_every_train_step(backend):
    """``train_step(stats_every=1, stats_formats=..., grad_accum_steps=2)`` on the exact model,
    micro-batches ``x`` and ``4x``: each gradient (the exact mean of the two) carries the
    reference's block statistics, and each layer's outputs of the two micro-batches are merged
    by the one rule (:func:`unimp.stats.merge_block_sums`: counts add, sums in the larger unit)."""
    require_backend(backend)
    w, x, c = _model_numbers()
    formats = ("mxfp8", "nvfp4")
    recipe = get_recipe("float32", loss_scale=StaticLossScale(SCALE))
    step, grad_names, _ = BUILDERS[backend](recipe, w, 1, stats_formats=["mxfp8", "nvfp4"], grad_accum_steps=2)
    r = step([(x, c), (x * 4, c)])
    (grads1, acts1), (grads4, acts4) = _expected(), _expected(4.0)
    for name, g in r.stats.gradients.items():
        mean = (grads1[grad_names[name]] + grads4[grad_names[name]]) / 2
        assert np.array_equal(mean, mean.astype(np.float32))  # exact in float32, in any order
        assert_same(g, reference_stats(mean.T if backend == "torch" else mean, SCALE, formats))  # torch: (out, in)
    assert sum(g.counts["nvfp4_underflow"] for g in r.stats.gradients.values()) > 0
    for name in acts1:
        one, two = reference_stats(acts1[name], 1.0, formats), reference_stats(acts4[name], 1.0, formats)
        got = r.stats.activations[name]
        assert got.size == 2 * one.size and got.formats == formats
        for f in formats:
            assert got.counts[f"{f}_underflow"] == one.counts[f"{f}_underflow"] + two.counts[f"{f}_underflow"]
            u, sums = merge_block_sums(
                np.float32(one.sums["block_unit"]), np.float32([one.sums[f"{f}_error"], one.sums[f"{f}_energy"]]),
                np.float32(two.sums["block_unit"]), np.float32([two.sums[f"{f}_error"], two.sums[f"{f}_energy"]]),
                np.where,
            )  # fmt: skip
            assert got.sums["block_unit"] == float(u) and one.sums["block_unit"] != float(u)
            assert [got.sums[f"{f}_error"], got.sums[f"{f}_energy"]] == pytest.approx(sums.tolist(), rel=2e-6, abs=1e-30)


def test_bad_stats_formats_are_refused_before_anything_is_built(backend):
    require_backend(backend)
    mp = mixed_precision("mixed_bfloat16", backend=backend)
    with pytest.raises(ValueError, match=r"unknown block format 'mxfp9' .*choose among mxfp8, fp8_block, nvfp4, mxfp4\. Did you mean 'mxfp8'"):
        mp.train_step("not a model", "not an optimizer", None, stats_every=1, stats_formats=["mxfp9"])
    with pytest.raises(ValueError, match=r"stats_formats=\['nvfp4'\] is taken on statistics steps: give stats_every=k"):
        mp.train_step("not a model", "not an optimizer", None, stats_formats="nvfp4")
