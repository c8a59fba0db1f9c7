"""unimp.blockscale_linear, the block-scaled linear layer's rule (no framework): which operand
each GEMM quantizes along which axis, the two copies quantized from the high-precision tensor,
the weight's one copy under a 2-D tile, the refusals."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from unimp import blockscale_linear as bl
from unimp import rounding
from unimp.blockscale_presets import block_quantize_dequantize

OPS = bl.NumpyLinearOps


def _rand(shape, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 2.0 ** rng.integers(-6, 6, shape)).astype(np.float32)


def test_docstring_examples_run():
    result = doctest.testmod(bl, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0


def test_the_gemm_table_blocks_each_operand_along_its_gemms_reduction_axis():
    reduction = {"forward": "K", "input_grad": "N", "weight_grad": "M"}
    assert len(bl.GEMMS) == 6
    for op in bl.GEMMS:
        assert op.along == reduction[op.gemm]
    assert {(op.operand, op.along) for op in bl.GEMMS} == {
        ("x", "K"), ("x", "M"), ("w", "K"), ("w", "N"), ("g", "N"), ("g", "M")}


def test_mxfp8_forward_is_rowwise_x_times_w_blocked_along_k():
    """y = Q(x blocked along K) @ Q(W blocked along K), W (K, N) blocked down its columns."""
    x, w = _rand((64, 64), 0), _rand((64, 32), 1)
    y, saved = bl.linear_forward(OPS, x, w, "mxfp8")
    qx = block_quantize_dequantize(x, "transformer_engine_mxfp8")
    qw = block_quantize_dequantize(w.T.copy(), "transformer_engine_mxfp8", "weight").T
    np.testing.assert_array_equal(y, qx @ qw)
    # the columnwise copies come from x and W themselves, and differ from the rowwise ones
    np.testing.assert_array_equal(saved.x_m, block_quantize_dequantize(x.T.copy(), "transformer_engine_mxfp8").T)
    assert not np.array_equal(saved.x_m, qx)
    np.testing.assert_array_equal(saved.w_n, block_quantize_dequantize(w, "transformer_engine_mxfp8", "weight"))
    assert not np.array_equal(saved.w_n, qw)


def test_block_fp8_weight_has_one_copy_for_both_gemms():
    x, w = _rand((128, 128), 2), _rand((128, 256), 3)
    _, saved = bl.linear_forward(OPS, x, w, "fp8_block")
    q = block_quantize_dequantize(w, "transformer_engine_block_fp8", "weight")
    np.testing.assert_array_equal(saved.w_n, q)
    np.testing.assert_array_equal(bl.quantize_along(OPS, w, "fp8_block", "weight", 0), q)  # the square tile


def test_backward_quantizes_the_gradient_twice_from_itself():
    x, w, g = _rand((64, 64), 4), _rand((64, 32), 5), _rand((64, 32), 6)
    _, saved = bl.linear_forward(OPS, x, w, "mxfp8")
    dx, dw = bl.linear_backward(OPS, saved, g, "mxfp8")
    qg_n = block_quantize_dequantize(g, "transformer_engine_mxfp8", "gradient")
    qg_m = block_quantize_dequantize(g.T.copy(), "transformer_engine_mxfp8", "gradient").T
    np.testing.assert_array_equal(dx, qg_n @ saved.w_n.T)
    np.testing.assert_array_equal(dw, saved.x_m.T @ qg_m)


@pytest.mark.parametrize("rule", list(bl.BLOCK_LINEAR_RULES))
def test_both_layouts_give_the_same_values(rule):
    """torch's (out, in) weight gives the same y and dx, and dW transposed, as (in, out); sums
    made exact by small-significand inputs so that the matmul order cannot differ."""
    rng = np.random.default_rng(7)
    x, w, g = (rng.choice([-1.0, 1.0], s) * rng.choice([0.25, 0.5, 1.0, 1.5], s) for s in
               ((128, 128), (128, 256), (128, 256)))
    x, w, g = (a.astype(np.float32) for a in (x, w, g))
    a = bl.block_linear_reference(x, w, g, rule, "in_out", seed=1)
    b = bl.block_linear_reference(x, w.T.copy(), g, rule, "out_in", seed=1)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[2], b[2].T)


def test_nvfp4_rounds_gradients_stochastically_from_the_seed():
    x, w, g = _rand((32, 32), 8), _rand((32, 32), 9), _rand((32, 32), 10)
    y0, dx0, dw0 = bl.block_linear_reference(x, w, g, "nvfp4", seed=0)
    y1, dx1, dw1 = bl.block_linear_reference(x, w, g, "nvfp4", seed=1)
    np.testing.assert_array_equal(y0, y1)  # the forward pass rounds to nearest
    assert not np.array_equal(dx0, dx1) and not np.array_equal(dw0, dw1)
    np.testing.assert_array_equal(dw0, bl.block_linear_reference(x, w, g, "nvfp4", seed=0)[2])
    _, saved = bl.linear_forward(OPS, x, w, "nvfp4")
    with pytest.raises(ValueError, match="rounds gradients stochastically: pass bits=gradient_bits"):
        bl.linear_backward(OPS, saved, g, "nvfp4")
    bits = bl.gradient_bits(rounding.NumpyOps, 0, 0, 32, 32)
    assert bits[0].shape == (32, 32) and not np.array_equal(bits[0], bits[1].T)


def test_rules_follow_transformer_engines_recipes():
    r = bl.BLOCK_LINEAR_RULES
    assert [r["mxfp8"].tile(t) for t in ("activation", "weight", "gradient")] == [(1, 32)] * 3
    assert [r["fp8_block"].tile(t) for t in ("activation", "weight", "gradient")] == [(1, 128), (128, 128), (1, 128)]
    assert [r["nvfp4"].tile(t) for t in ("activation", "weight", "gradient")] == [(1, 16), (16, 16), (1, 16)]
    assert [r["nvfp4"].stochastic(t) for t in ("activation", "weight", "gradient")] == [False, False, True]
    assert r["mxfp8"].formats == ("float8_e4m3fn",) * 3  # MXFP8BlockScaling's default Format.E4M3
    assert r["mxfp4"].format("gradient") == "float4_e2m1fn"


@pytest.mark.parametrize(("rule", "shape", "message"), [
    ("mxfp8", (16, 64, 32), r"M \(the batch rows.*is 16, not a multiple of 32"),
    ("fp8_block", (128, 64, 128), r"K \(in features\) is 64, not a multiple of 128"),
    ("nvfp4", (16, 16, 24), r"N \(out features\) is 24, not a multiple of 16"),
])
def test_sizes_that_do_not_split_are_refused_naming_the_fix(rule, shape, message):
    m, k, n = shape
    with pytest.raises(ValueError, match=message + ".*pad it"):
        bl.linear_forward(OPS, np.ones((m, k), np.float32), np.ones((k, n), np.float32), rule)


def test_bad_names_are_refused_with_the_closest_match():
    with pytest.raises(ValueError, match="Did you mean 'mxfp8'"):
        bl.block_linear_rule("mxfp9")
    assert bl.block_linear_rule("fp8-block").name == "fp8_block"
    with pytest.raises(TypeError, match="a block-scaled linear rule is a name"):
        bl.block_linear_rule(3)
    with pytest.raises(ValueError, match="unknown weight layout 'kn'"):
        bl.linear_forward(OPS, np.ones((32, 32), np.float32), np.ones((32, 32), np.float32), "mxfp8", "kn")
    with pytest.raises(ValueError, match="axis must be 0"):
        bl.quantize_along(OPS, np.ones((32, 32), np.float32), "mxfp8", "activation", 2)


def test_nvfp4_gemms_apply_the_tensor_scales_to_their_result():
    """Transformer Engine's NVFP4 GEMM (cublaslt_gemm.cu): the matmul of q * s_block, times
    alpha = amax_a * amax_b / (6 * 6 * 448 * 448) from the two tensor maxima."""
    from unimp.blockscale import nvfp4_block_values, nvfp4_gemm_alpha, nvfp4_global_scale

    x, w = _rand((32, 64), 11), _rand((64, 48), 12)
    y, saved = bl.linear_forward(OPS, x, w, "nvfp4")
    qx = nvfp4_block_values(x)
    qw = nvfp4_block_values(w, (16, 16))  # the 16x16 weight tile: one copy
    alpha = nvfp4_gemm_alpha(np.abs(x).max(), np.abs(w).max())
    np.testing.assert_array_equal(y, (qx @ qw) * alpha)
    np.testing.assert_array_equal(saved.w_n, qw)
    # the weight-gradient GEMM's scale: x's amax after the Hadamard transform (TE's post-RHT
    # amax), x's own without it
    from unimp.blockscale import random_hadamard_transform

    assert saved.amax_x == np.abs(random_hadamard_transform(x.T.copy())).max() != np.abs(x).max()
    assert bl.linear_forward(OPS, x, w, "nvfp4_no_rht")[1].amax_x == np.abs(x).max()
    # within NVFP4's error of the dequantized product, and never the plain one
    deq = block_quantize_dequantize(x, "transformer_engine_nvfp4") @ block_quantize_dequantize(
        w, "transformer_engine_nvfp4", "weight")
    np.testing.assert_allclose(y, deq, rtol=1e-5, atol=1e-6 * np.abs(deq).max())
    assert float(nvfp4_gemm_alpha(np.float32(2688.0), np.float32(2688.0))) == 1.0
    # alpha is not the product of the two decode scales 1 / S_enc: they part in the last bit
    a, b = np.float32(63.73247), np.float32(27.051693)
    assert nvfp4_gemm_alpha(a, b) == np.float32(0.00023861443)
    assert (np.float32(1) / nvfp4_global_scale(a)) * (np.float32(1) / nvfp4_global_scale(b)) == np.float32(0.0002386144)


def test_nvfp4_puts_the_weight_gradient_operands_alone_through_the_hadamard_transform():
    """Transformer Engine's NVFP4BlockScaling: x's and g's columnwise copies (the weight-gradient
    GEMM's) go through the RHT along M before quantization, their GEMM scale from the
    transformed tensors' amax; the forward and input-gradient GEMMs are untouched. In exact
    arithmetic dW is unchanged (T orthogonal); quantized, an outlier-heavy input's dW differs."""
    from unimp.blockscale import nvfp4_block_values, nvfp4_gemm_alpha, random_hadamard_transform

    assert bl.block_linear_rule("nvfp4").hadamard and not bl.block_linear_rule("nvfp4_no_rht").hadamard
    # exact arithmetic: small integers, so the transform (multiples of 1/4 below 2**5) is exact
    rng = np.random.default_rng(13)
    xi, gi = (rng.integers(-3, 4, s).astype(np.float32) for s in ((64, 32), (64, 48)))
    tx, tg = random_hadamard_transform(xi.T.copy()), random_hadamard_transform(gi.T.copy())
    assert not np.array_equal(tx, xi.T)
    np.testing.assert_array_equal(tx.astype(np.float64) @ tg.T.astype(np.float64),
                                  xi.T.astype(np.float64) @ gi.astype(np.float64))

    # quantized: one value in a hundred 100 times larger
    def outliers(shape, seed):
        r = np.random.default_rng(seed)
        a = r.standard_normal(shape)
        return (a * np.where(r.random(shape) < 0.01, 100.0, 1.0)).astype(np.float32)

    m, k, n, seed = 256, 64, 32, 5
    x, w, g = outliers((m, k), 14), outliers((k, n), 15), outliers((m, n), 16)
    y, dx, dw = bl.block_linear_reference(x, w, g, "nvfp4", seed=seed)
    y0, dx0, dw0 = bl.block_linear_reference(x, w, g, "nvfp4_no_rht", seed=seed)
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(dx, dx0)
    assert np.count_nonzero(dw != dw0) > dw.size // 2
    # dW, composed by hand: Q(T x^T), Q(T g^T) rounded stochastically with the column bits
    tx, tg = random_hadamard_transform(x.T.copy()), random_hadamard_transform(g.T.copy())
    col_bits = bl.gradient_bits(rounding.NumpyOps, seed, 0, m, n)[1]
    qx = nvfp4_block_values(tx)
    qg = nvfp4_block_values(tg, rounding="stochastic", bits=col_bits)
    alpha = nvfp4_gemm_alpha(np.abs(tx).max(), np.abs(tg).max())
    assert np.abs(tx).max() < np.abs(x).max() / 3  # the outliers spread over their 16 rows
    np.testing.assert_array_equal(dw, (qx @ np.ascontiguousarray(qg.T)) * alpha)
    exact = x.astype(np.float64).T @ g.astype(np.float64)
    for d in (dw, dw0):  # both within NVFP4's error of the exact product
        assert np.linalg.norm(d - exact) / np.linalg.norm(exact) < 0.3
