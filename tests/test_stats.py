"""The framework-free definition of tensor statistics (``unimp.stats``), its NumPy reference
with right values written as literals, the ``stats_every`` rule and ``StepResult.stats``."""

from __future__ import annotations

import ast
import doctest
import json
import math
import pathlib

import numpy as np
import pytest
from conftest import step_raw

import unimp
from unimp import StepResult
from unimp.stats import (
    BLOCK_FORMATS,
    COUNT_FIELDS,
    LIMITS,
    THRESHOLDS,
    StepStats,
    TensorStats,
    check_formats,
    count_fields,
    magnitude_fields,
    merge_block_sums,
    reference_stats,
)
from unimp.step import check_stats_every

POWERS = [2.0**-k for k in range(41)]  # one value per power of two, 2**-40 .. 2**0
BF16_OVERFLOW = (2 - 2.0**-8) * 2.0**127


# -- the reference, right values -----------------------------------------------------------


def test_powers_of_two_at_scale_1():
    s = reference_stats(POWERS, 1.0)
    # float16: 2**-25 and below round to 0 (k = 25..40: 16 values), 2**-15 .. 2**-24 are
    # subnormal (10 values), nothing overflows
    assert s.counts["float16_flush"] == 16
    assert s.counts["float16_subnormal"] == 10
    assert s.counts["float16_overflow"] == 0
    assert s.fraction("float16_flush") == 16 / 41
    # bfloat16 has float32's range: all normal
    assert [s.counts[f"bfloat16_{k}"] for k in ("overflow", "subnormal", "flush")] == [0, 0, 0]
    assert s.counts["zeros"] == 0 and s.counts["nonfinite"] == 0
    assert s.amax == 1.0 and s.min_nonzero == 2.0**-40 and s.size == 41
    assert s.headroom("float16") == math.log2(65504.0)


def test_powers_of_two_at_scale_2_pow_15():
    s = reference_stats(POWERS, 2.0**15)
    assert s.counts["float16_flush"] == 1  # only 2**-40 * 2**15 = 2**-25
    assert s.counts["float16_subnormal"] == 10  # 2**-26 .. 2**-35
    assert s.counts["float16_overflow"] == 0  # 2**15 < 65520
    assert s.amax == 1.0 and s.scale == 2.0**15  # magnitudes are unscaled
    assert s.headroom("float16") == pytest.approx(math.log2(65504.0 / 2.0**15))
    assert reference_stats(POWERS, 2.0**16).counts["float16_overflow"] == 1  # 2**16 >= 65520


def test_float16_overflow_boundary():
    s = reference_stats([65519.0, 65520.0], 1.0)
    assert s.counts["float16_overflow"] == 1  # 65519 rounds to 65504, 65520 to inf
    assert reference_stats([65519.0], 1.0).counts["float16_overflow"] == 0
    assert reference_stats([65504.0], 1.0).headroom("float16") == 0.0
    assert reference_stats([65520.0], 1.0).headroom("float16") < 0


def test_float16_subnormal_and_flush_boundaries():
    tiny = 2.0**-14  # float16's smallest normal
    s = reference_stats([tiny, tiny - 2.0**-25, tiny - 2.0**-24, 2.0**-24, 2.0**-25, 2.0**-26])
    # tiny - 2**-25 rounds up to tiny (normal); tiny - 2**-24 is the largest subnormal;
    # 2**-24 the smallest; 2**-25 rounds (to even) to 0
    assert s.counts["float16_subnormal"] == 2
    assert s.counts["float16_flush"] == 2


def test_bfloat16_boundaries():
    below = float(np.nextafter(np.float32(BF16_OVERFLOW), np.float32(0)))
    s = reference_stats([below, BF16_OVERFLOW, 3.4e38], 1.0)
    assert s.counts["bfloat16_overflow"] == 2
    assert s.counts["float16_overflow"] == 3
    sub = reference_stats([2.0**-126, 2.0**-127, 2.0**-133, 2.0**-134, 2.0**-140])
    assert sub.counts["bfloat16_subnormal"] == 2  # 2**-127, 2**-133
    assert sub.counts["bfloat16_flush"] == 2  # 2**-134 (half the smallest subnormal), 2**-140
    assert sub.counts["float16_flush"] == 5


def test_zeros_inf_nan():
    s = reference_stats([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.0, -2.5])
    assert s.counts["zeros"] == 2
    assert s.counts["nonfinite"] == 3
    assert s.counts["float16_overflow"] == 2 and s.counts["bfloat16_overflow"] == 2  # the infs
    assert s.counts["float16_flush"] == 0  # zeros are not flushed, NaN is not counted
    assert math.isnan(s.amax) and s.min_nonzero == 1.0
    assert math.isnan(s.headroom("float16"))
    inf = reference_stats([float("inf"), 1.0])
    assert inf.amax == math.inf and inf.headroom("bfloat16") == -math.inf


def test_empty_and_all_zero():
    e = reference_stats(np.zeros((0, 3), np.float32))
    assert e.size == 0 and e.amax == 0.0 and e.min_nonzero == math.inf
    assert e.fraction("zeros") == 0.0 and e.headroom("float16") == math.inf
    z = reference_stats(np.zeros(5))
    assert z.counts["zeros"] == 5 and z.fraction("zeros") == 1.0 and z.min_nonzero == math.inf


def test_half_inputs_are_read_exactly():
    x16 = np.array([2.0**-24, 65504.0, 1.0], np.float16)  # a float16 subnormal stays one
    s = reference_stats(x16)
    assert s.counts["float16_subnormal"] == 1 and s.counts["float16_flush"] == 0
    assert s.min_nonzero == 2.0**-24


@pytest.mark.parametrize("scale", [0, -1.0, float("inf"), float("nan"), True, "2", None])
def test_reference_rejects_bad_scales(scale):
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        reference_stats([1.0], scale)


def test_thresholds_are_the_limits_as_float32():
    for t, lim in LIMITS.items():
        assert THRESHOLDS[t] == (lim.overflow_at, lim.subnormal_below, lim.flush_at)
        assert all(float(np.float32(c)) == c for c in THRESHOLDS[t])
    assert COUNT_FIELDS[:2] == ("zeros", "nonfinite") and len(COUNT_FIELDS) == 8


# -- the records ------------------------------------------------------------------------------


def test_records_round_trip_through_json():
    g = reference_stats(POWERS, 2.0**15)
    a = reference_stats([0.0, float("inf"), 3.0])
    s = StepStats(4, {"l1/kernel": g}, {"l1": a})
    d = json.loads(json.dumps(s.to_dict()))
    assert StepStats.from_dict(d) == s
    assert d["gradients"]["l1/kernel"]["fractions"]["float16_flush"] == 1 / 41
    assert d["gradients"]["l1/kernel"]["headroom"]["float16"] == pytest.approx(0.9992954, abs=1e-7)


def test_from_arrays_keeps_the_given_order():
    counts, mags = np.arange(8, dtype=np.int32), np.array([2.0, 0.5], np.float32)
    entry = (8, 1.0, counts, mags)
    s = StepStats.from_arrays(3, {"b": entry, "a": entry, "c": entry}, {}, order=(["c", "b"], []))
    assert list(s.gradients) == ["c", "b", "a"] and s.step == 3
    assert s.gradients["a"] == TensorStats(8, 1.0, 2.0, 0.5, dict(zip(COUNT_FIELDS, range(8), strict=True)))
    with pytest.raises(ValueError, match="expected 8 counts"):
        TensorStats.from_arrays(8, 1.0, counts[:3], mags)


def test_unknown_names_say_what_exists():
    s = reference_stats([1.0])
    with pytest.raises(KeyError, match="float16_flush"):
        s.fraction("fp16_flush")
    with pytest.raises(KeyError, match="float16, bfloat16"):
        s.headroom("float8")


# -- the block formats' quantization error -----------------------------------------------------


def test_block_formats_are_the_block_recipes_rules():
    from unimp.blockscale_linear import BLOCK_LINEAR_RULES
    from unimp.recipe import BLOCK_RECIPES

    assert BLOCK_FORMATS == tuple(BLOCK_RECIPES.values()) and set(BLOCK_FORMATS) <= set(BLOCK_LINEAR_RULES)
    assert check_formats(["FP8-block", "mxfp4"]) == ("fp8_block", "mxfp4") and check_formats(()) == ()
    with pytest.raises(ValueError, match=r"unknown block format 'nvfp8'.*choose among mxfp8, fp8_block, nvfp4, mxfp4\. Did you mean"):
        check_formats("nvfp8")
    with pytest.raises(ValueError, match="'mxfp8' is given twice"):
        check_formats(["mxfp8", "mxfp8"])
    with pytest.raises(TypeError, match="formats must be a block format name or a list of them"):
        check_formats(8)


def test_block_statistics_right_values():
    # one MXFP8 block (E4M3, scale rounded up): amax 449 scales by 2, so 0.0005 (0.00025 scaled)
    # is below half of E4M3's smallest subnormal 2**-9 and every one of them rounds to 0
    x = np.full((1, 32), 0.0005, np.float32)
    x[0, 0], x[0, 1] = 449.0, 0.0
    s = reference_stats(x, 1.0, "mxfp8")
    assert (s.counts["mxfp8_underflow"], s.counts["mxfp8_nonzero"]) == (30, 31) and s.underflow("mxfp8") == 30 / 31
    assert s.sums["block_unit"] == 449.0
    # 449 comes back 448: (1/449)**2 of error; the 30 lost ones (0.0005/449)**2 each
    want = ((1 / 449) ** 2 + 30 * (0.0005 / 449) ** 2) / (1 + 30 * (0.0005 / 449) ** 2)
    assert s.relative_mse("mxfp8") == pytest.approx(want, rel=1e-5)
    # a 1-d tensor is one row, padded with zeros to 128: MXFP4 (E2M1, the OCP floor) keeps
    # 6 and 1 exactly and 2.5 rounds to 2 (a tie, to even)
    v = reference_stats([6.0, 2.5, 1.0], 1.0, "mxfp4")
    assert v.counts["mxfp4_underflow"] == 0 and v.relative_mse("mxfp4") == pytest.approx(0.25 / (36 + 6.25 + 1))
    assert count_fields(["mxfp4"])[-2:] == ("mxfp4_underflow", "mxfp4_nonzero")
    assert magnitude_fields(["mxfp4"]) == ("amax", "min_nonzero", "block_unit", "mxfp4_error", "mxfp4_energy")


def test_block_sums_merge_in_the_larger_unit():
    u, s = merge_block_sums(np.float32([2.0]), np.float32([1.0, 4.0]), np.float32([8.0]), np.float32([2.0, 2.0]), np.where)
    assert u.tolist() == [8.0] and s.tolist() == [1 / 16 + 2, 4 / 16 + 2]
    # the merged relative MSE is the joint one: errors 0.1 and 1 against values 1 and 10
    a = merge_block_sums(np.float32(1.0), np.float32([0.01, 1.0]), np.float32(10.0), np.float32([0.01, 1.0]), np.where)[1]
    assert a[0] / a[1] == pytest.approx((0.1**2 + 1.0**2) / (1.0**2 + 10.0**2), rel=1e-6)


def test_block_statistics_round_trip_and_say_what_was_measured():
    s = reference_stats(np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32), 2.0**10, ["nvfp4", "fp8-block"])
    assert s.formats == ("nvfp4", "fp8_block")
    d = json.loads(json.dumps(StepStats(0, {"w": s}, {}).to_dict()))
    assert StepStats.from_dict(d).gradients["w"] == s
    assert d["gradients"]["w"]["block"]["nvfp4"] == {"underflow": s.underflow("nvfp4"), "relative_mse": s.relative_mse("nvfp4")}
    with pytest.raises(KeyError, match=r"block format 'mxfp8' was not measured \(nvfp4, fp8_block were\): take it with train_step"):
        s.underflow("mxfp8")
    with pytest.raises(KeyError, match=r"not measured \(none were\)"):
        reference_stats([1.0]).relative_mse("nvfp4")
    with pytest.raises(ValueError, match="missing"):
        TensorStats(1, 1.0, 1.0, 1.0, {**s.counts}, {})
    counts, mags = np.zeros(len(count_fields(["mxfp8"])), np.int32), np.ones(5, np.float32)
    assert TensorStats.from_arrays(4, 1.0, counts, mags, ["mxfp8"]).sums["mxfp8_energy"] == 1.0
    with pytest.raises(ValueError, match="expected 10 counts and 5 magnitudes"):
        TensorStats.from_arrays(4, 1.0, counts, mags[:2], ["mxfp8"])


# -- the step option and the result -----------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2", 2.0])
def test_bad_stats_every_is_one_clear_error(value):
    with pytest.raises(ValueError, match=r"stats_every must be None \(no statistics\) or an int >= 1"):
        check_stats_every(value)


def test_good_stats_every():
    assert check_stats_every(None) is None
    assert check_stats_every(1) == 1 and check_stats_every(np.int64(50)) == 50


def test_step_result_stats_is_read_once_on_demand():
    calls = []
    made = StepStats(0, {}, {})

    def build():
        calls.append(1)
        return made

    r = StepResult(step_raw(), stats=build)
    assert calls == []  # nothing read when the step returns
    assert r.stats is made and r.stats is made and calls == [1]
    assert "stats" not in r.as_dict() and "stats" not in repr(r)
    assert StepResult(step_raw()).stats is None


def test_public_names():
    assert unimp.StepStats is StepStats and unimp.TensorStats is TensorStats
    assert unimp.reference_stats is reference_stats


def test_stats_module_doctests():
    import unimp.stats

    result = doctest.testmod(unimp.stats, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 4


def test_stats_module_imports_no_framework():
    path = pathlib.Path(unimp.__file__).parent / "stats.py"
    tree = ast.parse(path.read_text())
    top = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not top & {"torch", "tensorflow", "keras", "jax", "jaxlib", "flax", "optax"}


def test_the_first_non_finite_gradient_is_taken_in_backward_order():
    from unimp.stats import first_nonfinite_gradient

    names = ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
    assert first_nonfinite_gradient(names, [False, True, False, True]) == ("backward", "l2", "l2.weight")
    assert first_nonfinite_gradient(names, [False, True, True, True]) == ("backward", "l1", "l1.weight")
    assert first_nonfinite_gradient(names, [True] * 4) is None
    with pytest.raises(ValueError, match="4 gradient names but 3 finite flags"):
        first_nonfinite_gradient(names, [True] * 3)


def test_a_name_resolves_part_for_part_when_one_matches_and_a_missing_one_lists_the_names():
    s = StepStats.from_dict({"step": 0, "gradients": {}, "activations": {}})
    entry = (8, 1.0, np.arange(8, dtype=np.int32), np.array([2.0, 0.5], np.float32))
    other = (8, 1.0, np.arange(8, dtype=np.int32), np.array([4.0, 0.5], np.float32))
    names = {"mlp/fc1/kernel": entry, "mlp/fc1/bias": other, "head/kernel": other}
    arrays = StepStats.from_arrays(3, names, {"mlp/fc1": entry, "head": other})
    g, a = arrays.gradients, arrays.activations
    # a bare layer name, the other separator, a Keras layer.path with the model's name first
    assert a["fc1"] is a["mlp/fc1"] and a["mlp.fc1"] is a["mlp/fc1"] and a["sequential/head"] is a["head"]
    assert g["fc1.kernel"] is g["mlp/fc1/kernel"] and g["fc1/bias"].amax == 4.0
    with pytest.raises(KeyError, match=r"gradient name 'kernel' is ambiguous: write one of head/kernel, mlp/fc1/kernel"):
        g["kernel"]
    with pytest.raises(KeyError, match=r"no gradient named 'fc2'\. Did you mean 'mlp/fc1/bias'\?"):
        g["fc2"]
    with pytest.raises(KeyError, match="no activation named 'x'.*Names: none"):
        s.activations["x"]
    back = StepStats.from_dict(arrays.to_dict())
    assert back == arrays and back.activations["fc1"] == a["fc1"]
    import pickle

    assert type(pickle.loads(pickle.dumps(arrays)).gradients) is dict
