"""tensorflow backend, ``overflow``: all_finite, selecting and replica agreement."""

import os

from conftest import require_backend

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

utf = require_backend("tensorflow")  # skips with a reason if not under test, FAILS if missing


import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from backends.tensorflow.helpers import INF  # noqa: E402


@pytest.mark.parametrize(
    "tree, expected",
    [
        ([tf.ones(3), tf.constant([1, 2])], True),
        ([tf.constant([1.0, INF])], False),
        ({"a": tf.constant([np.nan], tf.float16)}, False),
        ([tf.constant([INF], tf.bfloat16), None], False),
        ([tf.IndexedSlices(tf.constant([[INF]]), tf.constant([0]), tf.constant([4, 1]))], False),
        ([], True),
    ],
)
def test_all_finite(tree, expected):
    result = utf.all_finite(tree)
    assert result.dtype == tf.bool and bool(result) is expected
