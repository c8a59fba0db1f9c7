"""tensorflow backend, ``overflow``: all_finite, selecting and replica agreement."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import pytest
import tensorflow as tf

import unimp.backends.tensorflow as utf
from backends.tensorflow.helpers import INF


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
