"""tensorflow backend, ``overflow``: what TensorFlow adds to all_finite (IndexedSlices). The
rule itself (every backend) is in tests/conformance/test_all_finite_conformance.py."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tensorflow as tf

import unimp.backends.tensorflow as utf
from backends.tensorflow.helpers import INF


def test_all_finite_reads_indexed_slices():
    tree = [tf.IndexedSlices(tf.constant([[INF]]), tf.constant([0]), tf.constant([4, 1]))]
    result = utf.all_finite(tree)
    assert result.dtype == tf.bool and bool(result) is False
