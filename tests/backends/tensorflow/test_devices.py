"""tensorflow backend, ``devices``: version, device parsing and placement, device_info."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import subprocess
import sys

import keras
import pytest

import unimp.backends.tensorflow as utf


@pytest.mark.parametrize("other", ["jax", "torch", "numpy"])
def test_other_keras_backend_is_a_clear_error(monkeypatch, other):
    # what the import of unimp.backends.tensorflow runs (checked in-process: a subprocess
    # importing TensorFlow costs ~10 s on this machine)
    monkeypatch.setattr(keras.backend, "backend", lambda: other)
    with pytest.raises(ImportError, match="KERAS_BACKEND=tensorflow") as info:
        utf.devices._check_keras()
    assert repr(other) in str(info.value)


def test_device_info_lists_the_cpu_first():
    # the keys and framework_version: tests/conformance/test_backend_api.py
    info = utf.device_info()
    assert info[0]["kind"] == "cpu" and info[0]["recommended"] == "float32"


def test_device_does_not_start_the_tensorflow_runtime():
    # virtual devices and memory growth can only be configured before the runtime starts
    code = (
        "import os; os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'\n"
        "import tensorflow as tf\n"
        "from unimp.backends import tensorflow as utf\n"
        "utf.MixedPrecision('mixed_float16', device='cpu')\n"
        "try:\n    utf.MixedPrecision('mixed_float16', device='gpu:3')\nexcept ValueError:\n    pass\n"
        "cpu = tf.config.list_physical_devices('CPU')[0]\n"
        "tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)\n"
        "mp = utf.MixedPrecision('mixed_float16', device='cpu:1')\n"
        "with mp.autocast():\n    pass\n"
        "try:\n    utf.MixedPrecision('mixed_float16', device='cpu:5').autocast().__enter__()\n"
        "except ValueError as e:\n    print('lazy check:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "lazy check: device /CPU:5: TensorFlow has no such device here" in out.stdout
