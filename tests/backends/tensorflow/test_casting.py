"""tensorflow backend, ``casting``: what TensorFlow adds to the one casting rule (dtype objects,
variables and NumPy leaves). The rule itself (floating leaves only, every backend) and the dtype
names are in tests/conformance/test_casting_conformance.py and test_backend_api.py."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import pytest
import tensorflow as tf

import unimp.backends.tensorflow as utf


def test_to_dtype_takes_a_tensorflow_dtype():
    assert utf.to_dtype(tf.float64) == tf.float64


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cast_tree_casts_variables_and_numpy_floats_and_leaves_numpy_ints(dtype):
    tree = {
        "v": tf.Variable(tf.ones(2, tf.float64)),
        "np": np.ones(2, np.float32),
        "nested": [np.arange(3), (tf.zeros(1),)],
    }
    out = utf.cast_tree(tree, dtype)
    target = utf.to_dtype(dtype)
    assert out["v"].dtype == target and out["np"].dtype == target
    assert out["nested"][1][0].dtype == target
    assert out["nested"][0].dtype == np.int64
