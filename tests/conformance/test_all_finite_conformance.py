"""``all_finite(tree)`` is one rule in every backend: a scalar bool on the device, True when every
floating leaf (float32, float16, bfloat16) is finite; integer leaves and ``None`` are left out, and
an empty tree is finite. What each framework adds (TensorFlow's ``IndexedSlices``, JAX's Python
floats, ``axis_name`` and ``select_tree``) is in ``tests/backends/<fw>/test_overflow.py``."""

from __future__ import annotations

import kits
import pytest
from conftest import require_backend

INF, NAN = float("inf"), float("nan")

CASES = {
    "finite-with-ints": (lambda a: [a([1.0, 1.0, 1.0]), a([1, 2], "int32")], True),
    "inf": (lambda a: [a([1.0, INF])], False),
    "nan-after-a-finite-leaf": (lambda a: [a([1.0, 1.0]), a([1.0, NAN])], False),
    "nan-float16": (lambda a: {"a": a([1.0, 1.0, 1.0]), "b": a([1.0, NAN], "float16")}, False),
    "inf-bfloat16-beside-none": (lambda a: [a([INF], "bfloat16"), None], False),
    "finite-bfloat16": (lambda a: {"a": a([1.0, 1.0, 1.0]), "b": a([[0.0, 0.0], [0.0, 0.0]], "bfloat16")}, True),
    "ints-only": (lambda a: {"i": a([1, 2, 3], "int32"), "l": a([1], "int64")}, True),
    "finite-beside-none": (lambda a: [a([1.0]), None], True),
    "empty-list": (lambda a: [], True),
    "empty-dict": (lambda a: {}, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_all_finite_is_one_bool_over_the_floating_leaves(backend, case):
    module = require_backend(backend)
    make, expected = CASES[case]
    out = module.all_finite(make(lambda values, dtype="float32": kits.native(backend, values, dtype)))
    assert kits.dtype_name(out.dtype) == "bool" and tuple(out.shape) == ()
    assert bool(out) is expected
