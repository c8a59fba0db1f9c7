"""Casting a tree is one rule in every backend: floating leaves take the target dtype, and
integers, booleans, Python scalars and strings pass through as the same objects (jmp's
``_cast_floating_to``, Keras's ``_should_cast``). What each framework adds (torch's mapping
types, TensorFlow's variables and NumPy leaves, JAX's NumPy leaves) is in
``tests/backends/<fw>/test_casting.py``."""

from __future__ import annotations

import kits
import numpy as np
import pytest
from conftest import require_backend

import unimp


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_casts_touch_floating_leaves_only(backend, half):
    module = require_backend(backend)
    mp = unimp.mixed_precision(f"mixed_{half}", backend=backend)
    ints, longs = kits.native(backend, [1, 2], "int32"), kits.native(backend, [3], "int64")
    mask = kits.native(backend, [True, False], "bool")
    tree = {
        "x": kits.native(backend, [1.0, 2.0]),
        "i": ints,
        "l": longs,
        "b": mask,
        "s": 3.5,
        "n": 3,
        "t": "text",
        "nested": [kits.native(backend, [0.5], "float64"), "text", (kits.native(backend, [1.0]),)],
    }
    half_dtype, f32 = module.to_dtype(half), module.to_dtype("float32")

    def floats(out):
        return [out["x"].dtype, out["nested"][0].dtype, out["nested"][2][0].dtype]

    def passed_through(out):
        assert out["i"] is ints and out["l"] is longs and out["b"] is mask
        assert type(out["s"]) is float and out["s"] == 3.5 and type(out["n"]) is int and out["n"] == 3
        assert out["t"] == out["nested"][1] == "text"

    out = mp.cast_to_compute(tree)
    assert floats(out) == [half_dtype] * 3
    passed_through(out)
    for back in (mp.cast_to_output(out), mp.cast_to_param(out)):
        assert floats(back) == [f32] * 3
        passed_through(back)
    direct = module.cast_tree(tree, half)  # the function under the policy's casts
    assert floats(direct) == [half_dtype] * 3
    passed_through(direct)
    assert kits.dtype_name(direct["x"].dtype) == half
    assert kits.dtype_name(direct["i"].dtype) == "int32"


def test_an_unknown_dtype_is_refused_listing_the_names(backend):
    module = require_backend(backend)
    with pytest.raises(ValueError, match=r"unknown dtype 'int8'; expected one of: .*bfloat16.*float16"):
        module.cast_tree(kits.native(backend, np.ones(2)), "int8")
