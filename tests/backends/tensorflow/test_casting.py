"""tensorflow backend, ``casting``: dtype mapping and cast_tree (and module mode / master weights in torch)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import pytest
import tensorflow as tf

import unimp.backends.tensorflow as utf


@pytest.mark.parametrize(
    "name, expected",
    [
        ("float16", tf.float16),
        ("bf16", tf.bfloat16),
        ("float", tf.float32),
        (tf.float64, tf.float64),
    ],
)
def test_to_dtype(name, expected):
    assert utf.to_dtype(name) == expected


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cast_tree_casts_floating_leaves_only(dtype):
    ids = tf.constant([1, 2], tf.int32)
    mask = tf.constant([True, False])
    tree = {
        "x": tf.ones(3),
        "v": tf.Variable(tf.ones(2, tf.float64)),
        "np": np.ones(2, np.float32),
        "ids": ids,
        "mask": mask,
        "n": 3.5,
        "s": "text",
        "nested": [np.arange(3), (tf.zeros(1),)],
    }
    out = utf.cast_tree(tree, dtype)
    target = utf.to_dtype(dtype)
    assert out["x"].dtype == target and out["v"].dtype == target and out["np"].dtype == target
    assert out["nested"][1][0].dtype == target
    assert out["ids"] is ids and out["mask"] is mask
    assert out["n"] == 3.5 and out["s"] == "text"
    assert out["nested"][0].dtype == np.int64
