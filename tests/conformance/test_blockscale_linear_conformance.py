"""The block-scaled linear layer (unimp.blockscale_linear's rule: MXFP8, block FP8, NVFP4,
MXFP4) run forward and backward on every backend's tensors gives the NumPy reference's y, dx and
dW bit for bit: the functional matmul in both weight layouts (eagerly, and compiled by XLA on
JAX and TensorFlow), and each framework's layer (torch ``BlockScaledLinear``, Keras
``BlockScaledDense``, flax ``Dense`` with ``block_scaled_dot_general``). ``nvfp4`` includes the
random Hadamard transform of the weight-gradient GEMM's operands (float32 inputs of 24-bit
significands here: its float32 sums are inexact, and alike everywhere by their fixed order).

Why bit for bit holds for the GEMMs too: the quantized operands are the same bits in every
framework (test_blockscale_conformance.py), and the inputs here make each GEMM's float32 sums
exact, so no framework's summation order can change them: every operand value has at most 6
significant bits (E4M3 times a power of two: 4; NVFP4's ``q * s_block``, its tensor scales
applied to the GEMM's result: 6), the magnitudes span a few binades ([0.25, 2.625] and their
quantized values), and ``K``, ``N`` and ``M`` are at most 256 (checked: every float64 sum is
a float32). Elsewhere the last bits of a GEMM depend on the framework's summation order, as
for any float32 matmul.
TensorFlow's graphs without XLA are not promised (see test_blockscale_conformance.py)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import require_backend
from kits import float_bits as _bits
from kits import native as _native

from unimp import blockscale_linear as bl

RULES = list(bl.BLOCK_LINEAR_RULES)
M, K, N = 128, 128, 256  # block FP8 needs every GEMM axis a multiple of 128
SEED, STEP = 3, 5


def _operand(shape, seed):
    rng = np.random.default_rng(seed)
    a = (rng.choice([-1.0, 1.0], shape) * rng.uniform(0.25, 2.0, shape)).astype(np.float32)
    a.flat[100] = -2.625  # the tensor's amax: NVFP4's global scale 2688 / 2.625 = 1024
    a.reshape(-1)[:32] = 0.0  # a zero block (the first row's first 32 of x and g)
    a.reshape(-1)[40] = -0.0
    return a


def _inputs():
    return _operand((M, K), 0), _operand((K, N), 1), _operand((M, N), 2)


def _reference(rule, layout):
    x, w, g = _inputs()
    w_l = w if layout == "in_out" else np.ascontiguousarray(w.T)
    return (x, w_l, g), bl.block_linear_reference(x, w_l, g, rule, layout, SEED, STEP)


def _assert_bits(got, want):
    for name, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        a = np.asarray(a, np.float32)
        assert a.shape == b.shape, name
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=name)


def _run_matmul(backend, rule, layout, compiled):
    """(y, dx, dw) of the backend's ``block_scaled_matmul``, as NumPy."""
    mod = require_backend(backend)
    del mod
    (x, w, g), _ = _reference(rule, layout)
    if backend == "torch":
        import torch

        from unimp.backends.torch.blockscale import block_scaled_matmul

        xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
        y = block_scaled_matmul(xt, wt, rule, layout, SEED, STEP)
        y.backward(torch.tensor(g))
        return y.detach().numpy(), xt.grad.numpy(), wt.grad.numpy()
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        from unimp.backends.jax.blockscale import block_scaled_matmul

        def run(a, b, c, step):
            y, vjp = jax.vjp(lambda a_, b_: block_scaled_matmul(a_, b_, rule, layout, SEED, step), a, b)
            return (y, *vjp(c))

        fn = jax.jit(run) if compiled else run
        return tuple(np.asarray(v) for v in fn(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), jnp.int32(STEP)))
    import tensorflow as tf

    from unimp.backends.tensorflow.blockscale import block_scaled_matmul

    def run(a, b, c):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            y = block_scaled_matmul(a, b, rule, layout, SEED, STEP)
        return (y, *tape.gradient(y, [a, b], output_gradients=c))

    fn = tf.function(run, jit_compile=True) if compiled else run
    return tuple(v.numpy() for v in fn(tf.constant(x), tf.constant(w), tf.constant(g)))


@pytest.mark.parametrize("layout", bl.LAYOUTS)
@pytest.mark.parametrize("rule", RULES)
def test_matmul_forward_and_backward_are_the_reference_bit_for_bit(backend, rule, layout):
    _, want = _reference(rule, layout)
    _assert_bits(_run_matmul(backend, rule, layout, compiled=False), want)


@pytest.mark.parametrize("rule", [r for r in RULES if r != "nvfp4_no_rht"])  # nvfp4's ops less the transform
@pytest.mark.parametrize("backend", ["tensorflow", "jax"])  # XLA's compilation; torch runs eagerly
def test_matmul_compiled_by_xla_is_the_reference_bit_for_bit(backend, rule):
    _, want = _reference(rule, "in_out")
    _assert_bits(_run_matmul(backend, rule, "in_out", compiled=True), want)


@pytest.mark.parametrize("rule", RULES)
def test_the_inputs_make_every_gemm_exact(rule):
    """The premise of bit for bit across summation orders (module docstring): every GEMM's
    float64 sum is a float32 (so exact), and the outputs are not trivial."""
    sums = []

    class Float64Sums(bl.NumpyLinearOps):
        @staticmethod
        def matmul(a, b):
            exact = np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))
            np.testing.assert_array_equal(exact.astype(np.float32).astype(np.float64), exact)
            sums.append(exact)
            return exact.astype(np.float32)

    (x, w, g), (y, dx, dw) = _reference(rule, "in_out")
    with np.errstate(all="ignore"):
        y64, saved = bl.linear_forward(Float64Sums, x, w, rule)
        bits = None
        if bl.block_linear_rule(rule).stochastic("gradient"):
            from unimp import rounding

            bits = bl.gradient_bits(rounding.NumpyOps, SEED, STEP, M, N)
        dx64, dw64 = bl.linear_backward(Float64Sums, saved, g, rule, "in_out", bits)
    assert len(sums) == 3
    for name, a32, a64 in (("y", y, y64), ("dx", dx, dx64), ("dw", dw, dw64)):
        np.testing.assert_array_equal(a32, a64, err_msg=name)
    assert np.count_nonzero(y != x @ w) > y.size // 2  # quantization did change the product


def _run_layer(backend, rule):
    """(y, dx, dw) of the framework's layer with the kernel ``w`` (in, out) and no bias, dw in
    the kernel layout; trained once, so the stochastic rounding's step is 0."""
    require_backend(backend)
    x, w, g = _inputs()
    if backend == "torch":
        import torch

        from unimp.backends.torch.blockscale import BlockScaledLinear

        layer = BlockScaledLinear(K, N, bias=False, rule=rule, seed=SEED)
        with torch.no_grad():
            layer.weight.copy_(torch.tensor(w.T))
        xt = torch.tensor(x, requires_grad=True)
        y = layer(xt)
        y.backward(torch.tensor(g))
        assert int(layer.block_step) == 1
        return y.detach().numpy(), xt.grad.numpy(), layer.weight.grad.numpy().T
    if backend == "tensorflow":
        import tensorflow as tf

        from unimp.backends.tensorflow.blockscale import BlockScaledDense

        layer = BlockScaledDense(N, use_bias=False, rule=rule, seed=SEED)
        layer.build((None, K))
        layer.kernel.assign(w)
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = layer(xt, training=True)
        dx, dw = tape.gradient(y, [xt, layer.kernel.value], output_gradients=tf.constant(g))
        assert int(layer.block_step.numpy()) == 1
        return y.numpy(), dx.numpy(), dw.numpy()
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from unimp.backends.jax.blockscale import block_scaled_dot_general

    dense = nn.Dense(N, use_bias=False, dot_general=block_scaled_dot_general(rule, SEED, 0))
    params = {"params": {"kernel": jnp.asarray(w)}}
    y, vjp = jax.vjp(lambda p, a: dense.apply(p, a), params, jnp.asarray(x))
    dp, dx = vjp(jnp.asarray(g))
    return np.asarray(y), np.asarray(dx), np.asarray(dp["params"]["kernel"])


@pytest.mark.parametrize("rule", RULES)
def test_each_frameworks_layer_is_the_reference_bit_for_bit(backend, rule):
    x, w, g = _inputs()
    want = bl.block_linear_reference(x, w, g, rule, "in_out", SEED, 0)
    _assert_bits(_run_layer(backend, rule), want)


def test_stochastic_rounding_follows_the_seed_and_step(backend):
    """NVFP4's gradients: another step gives other bits (dW differs), the same step the same."""
    require_backend(backend)
    (x, w, g), (_, _, dw) = _reference("nvfp4", "in_out")
    other = bl.block_linear_reference(x, w, g, "nvfp4", "in_out", SEED, STEP + 1)[2]
    assert not np.array_equal(other, dw)
    got = _run_matmul(backend, "nvfp4", "in_out", compiled=False)[2]
    np.testing.assert_array_equal(_bits(got), _bits(dw))


def _matmul_of(backend):
    if backend == "torch":
        from unimp.backends.torch.blockscale import block_scaled_matmul
    elif backend == "jax":
        from unimp.backends.jax.blockscale import block_scaled_matmul
    else:
        from unimp.backends.tensorflow.blockscale import block_scaled_matmul
    return block_scaled_matmul


def test_a_batch_that_does_not_split_into_blocks_is_refused_naming_the_fix(backend):
    """Where a backward pass follows: its weight-gradient GEMM blocks along the batch rows."""
    require_backend(backend)
    mm = _matmul_of(backend)
    x = np.ones((16, 64), np.float32)  # M = 16: MXFP8's weight-gradient GEMM blocks along it by 32
    w = np.ones((64, 32), np.float32)
    with pytest.raises(ValueError, match=r"M \(the batch rows.*is 16, not a multiple of 32.*pad it"):
        if backend == "torch":
            import torch

            mm(torch.tensor(x, requires_grad=True), torch.tensor(w), "mxfp8")
        elif backend == "jax":
            import jax

            jax.vjp(lambda a: mm(a, w, "mxfp8"), x)
        else:
            mm(_native(backend, x), _native(backend, w), "mxfp8")


def test_inference_runs_the_forward_gemm_alone_on_any_batch(backend):
    """No gradient taken (torch without requires_grad, JAX undifferentiated, TensorFlow
    backward=False as Keras's training=False): any number of rows, the reference's forward
    values bit for bit, and TensorFlow refuses a gradient through it naming the fix."""
    require_backend(backend)
    mm = _matmul_of(backend)
    x, w, g = _inputs()
    x = x[:37]  # 37 rows: no multiple of any block
    y, _ = bl.linear_forward(bl.NumpyLinearOps, x, w, "nvfp4", backward=False)
    kw = {"backward": False} if backend == "tensorflow" else {}
    got = mm(_native(backend, x), _native(backend, w), "nvfp4", **kw)
    np.testing.assert_array_equal(_bits(np.asarray(got)), _bits(y))
    if backend == "tensorflow":
        import tensorflow as tf

        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            out = mm(xt, tf.constant(w), "nvfp4", backward=False)
        with pytest.raises(ValueError, match="ran with backward=False.*backward=True"):
            tape.gradient(out, xt)
