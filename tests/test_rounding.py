"""unimp.rounding, framework-free: the hash is lowbias32 as written with unsigned 32-bit
arithmetic, stochastic rounding rounds to a bfloat16 neighbour with the right probability, and
the modes refuse what they cannot do."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from unimp import rounding
from unimp.rounding import NumpyOps as ops


def _lowbias32(x: int) -> int:
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@given(st.integers(-(2**31), 2**31 - 1), st.integers(0, 2**31 - 1), st.integers(0, 2**20))
def test_random_bits_are_lowbias32_of_seed_step_index_and_element(seed, step, index):
    got = rounding.random_bits(ops, seed, step, index, (3,)).astype(np.int64) & 0xFFFFFFFF
    key = _lowbias32(_lowbias32(_lowbias32(seed) ^ step) ^ index)
    assert got.tolist() == [_lowbias32(e ^ key) for e in range(3)]


def test_stochastic_rounding_picks_a_neighbour_with_the_probability_of_its_distance():
    # 1 + 0.25 * 2**-7 lies a quarter of the way from 1.0 to the next bfloat16 (1 + 2**-7)
    x = np.full(40_000, 1.0 + 0.25 * 2.0**-7, np.float32)
    out = rounding.stochastic_round(ops, x, rounding.random_bits(ops, 7, 0, 0, x.shape)).astype(np.float32)
    assert set(out.tolist()) == {1.0, 1.0 + 2.0**-7}
    assert abs(float(np.mean(out == 1.0 + 2.0**-7)) - 0.25) < 0.01
    neg = rounding.stochastic_round(ops, -x, rounding.random_bits(ops, 7, 0, 0, x.shape)).astype(np.float32)
    np.testing.assert_array_equal(neg, -out)  # on the magnitude: the same bits round -x as x
    exact = np.array([1.0, 0.5, -3.0], np.float32)  # already bfloat16: never moved
    assert rounding.stochastic_round(ops, exact, rounding.random_bits(ops, 0, 0, 0, (3,))).astype(np.float32).tolist() == exact.tolist()


def test_kahan_keeps_what_float16_rounding_loses():
    p, c = np.ones(1, np.float16), np.zeros(1, np.float16)
    for _ in range(1000):  # float16's spacing at 1.0 is 2**-10: each step of 1e-4 is lost to nearest
        p, c = rounding.apply_update(ops, "kahan", p, np.float32([-1e-4]), c)
    assert p.dtype == np.float16 and abs(float(p[0]) - 0.9) < 1e-3
    q = np.ones(1, np.float16)
    for _ in range(1000):
        q, _ = rounding.apply_update(ops, "nearest", q, np.float32([-1e-4]))
    assert q.tolist() == [1.0]


def test_the_modes_refuse_what_they_cannot_do():
    p16 = np.ones(1, np.float16)
    with pytest.raises(ValueError, match="update must be one of"):
        rounding.check_update_mode("round")
    with pytest.raises(ValueError, match=r"update='stochastic' rounds float32 to bfloat16.*use update='kahan'"):
        rounding.apply_update(ops, "stochastic", p16, np.float32([1e-3]), bits=rounding.random_bits(ops, 0, 0, 0, (1,)))
    with pytest.raises(ValueError, match="needs the parameter's compensation buffer"):
        rounding.apply_update(ops, "kahan", np.ones(1, ml_dtypes.bfloat16), np.float32([1e-3]))
    with pytest.raises(ValueError, match="needs the parameter's random bits"):
        rounding.apply_update(ops, "stochastic", np.ones(1, ml_dtypes.bfloat16), np.float32([1e-3]))


def test_host_seeds_are_their_low_32_bits_and_floats_are_refused():
    # the breaker's case: 2**31, np.int64(2**40) and 1.7 meant different seeds (or errors) in
    # different frameworks; a host integer is taken modulo 2**32 here, once, for all of them
    bits = lambda seed: rounding.random_bits(ops, seed, 0, 0, (4,)).tolist()  # noqa: E731
    assert bits(2**31) == bits(-(2**31)) and bits(np.int64(2**40)) == bits(0) and bits(2**32 + 5) == bits(5)
    for bad in (1.7, np.float32(2.0), True):
        with pytest.raises(TypeError, match="seed must be an integer"):
            rounding.random_bits(ops, bad, 0, 0, (1,))
    assert rounding.check_update_mode("stochastic", "bf16") == "stochastic"
    assert rounding.check_update_mode("stochastic", ml_dtypes.bfloat16) == "stochastic"


def test_step_seed_takes_the_steps_seed_until_the_optimizer_has_stepped():
    from unimp.rounding import step_seed

    assert step_seed("kahan", 0, False, "kahan", 7, "x") == 7
    assert step_seed("kahan", 7, True, "kahan", 7, "x") == 7
    with pytest.raises(ValueError, match="pass rounding_seed=0 to keep its random bits"):
        step_seed("stochastic", 0, True, "stochastic", 7, "x")
    with pytest.raises(ValueError, match="give the step its plain optimizer, or a recipe with update='kahan'"):
        step_seed("kahan", 0, False, "nearest", 0, "its plain optimizer")
