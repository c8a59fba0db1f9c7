"""jax backend, ``casting``: what JAX adds to the one casting rule (NumPy leaves stay NumPy,
float64 needs x64). The rule itself (floating leaves only, every backend), the dtype names and
the refusal of an unknown dtype are in tests/conformance/test_casting_conformance.py and
test_backend_api.py."""


import jax.numpy as jnp
import numpy as np
import pytest

import unimp.backends.jax as ujax
from backends.jax.helpers import HALF, RECIPE


def test_float64_without_x64_names_the_fix():
    with pytest.raises(ValueError, match="jax_enable_x64"):
        ujax.MixedPrecision("float64")


@pytest.mark.parametrize("half", HALF)
def test_a_numpy_leaf_is_cast_and_stays_numpy(half):
    out = ujax.MixedPrecision(RECIPE[half]).cast_to_compute({"np": np.ones(2, np.float32)})
    assert isinstance(out["np"], np.ndarray) and out["np"].dtype == jnp.dtype(half)
