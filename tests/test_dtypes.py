import numpy as np
import pytest

from unimp.dtypes import canonical_dtype, finfo, is_half


@pytest.mark.parametrize(
    "name,expected",
    [
        ("float64", "float64"),
        ("f64", "float64"),
        ("fp64", "float64"),
        ("double", "float64"),
        ("float32", "float32"),
        ("f32", "float32"),
        ("fp32", "float32"),
        ("float", "float32"),
        ("full", "float32"),
        ("float16", "float16"),
        ("f16", "float16"),
        ("fp16", "float16"),
        ("bfloat16", "bfloat16"),
        ("bf16", "bfloat16"),
        ("BF16", "bfloat16"),
        (" Float16 ", "float16"),
        ("torch.float16", "float16"),
        ("tf.bfloat16", "bfloat16"),
    ],
)
def test_names_and_aliases(name, expected):
    assert canonical_dtype(name) == expected


@pytest.mark.parametrize(
    "obj,expected",
    [
        (np.float16, "float16"),
        (np.float32, "float32"),
        (np.float64, "float64"),
        (np.dtype("float16"), "float16"),
        (np.zeros(2, np.float32), "float32"),
    ],
)
def test_numpy_dtypes(obj, expected):
    assert canonical_dtype(obj) == expected


def test_ml_dtypes_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes ships with jax and tensorflow")
    assert canonical_dtype(ml_dtypes.bfloat16) == "bfloat16"
    assert canonical_dtype(np.dtype(ml_dtypes.bfloat16)) == "bfloat16"


class _FakeTorchDtype:
    """Stands for torch.float16: recognised by module and printed name, without importing torch."""

    __module__ = "torch"

    def __str__(self):
        return "torch.bfloat16"


class _FakeTfDType:
    __module__ = "tensorflow.python.framework.dtypes"
    name = "float16"


def test_framework_dtypes_recognised_without_import():
    assert canonical_dtype(_FakeTorchDtype()) == "bfloat16"
    assert canonical_dtype(_FakeTfDType()) == "float16"


@pytest.mark.parametrize(
    "bad",
    ["float8", "int32", "", "fp128", np.int32, np.dtype("int8"), 3, 2.5, None, True, object()],
)
def test_bad_dtypes_list_accepted_names(bad):
    with pytest.raises(ValueError, match="bfloat16"):
        canonical_dtype(bad)


def test_the_python_float_type_is_ambiguous_and_refused():
    # NumPy: float64; torch.float, JAX's default and Keras's "float": float32
    with pytest.raises(ValueError, match="'float32' or 'float64'"):
        canonical_dtype(float)
    from unimp import Policy

    with pytest.raises(ValueError, match="'float32' or 'float64'"):
        Policy(param_dtype=float)
    assert canonical_dtype("float") == "float32" and canonical_dtype(np.float64) == "float64"


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("cpu", ("cpu", None)),
        (" CUDA:1 ", ("gpu", 1)),
        ("gpu:0", ("gpu", 0)),
        ("rocm", ("gpu", None)),
        ("tpu:3", ("tpu", 3)),
        ("/GPU:2", ("gpu", 2)),
        ("/job:localhost/replica:0/task:0/device:CPU:0", ("cpu", 0)),
    ],
)
def test_parse_device_is_the_one_reading_of_device_spellings(spec, expected):
    from unimp.dtypes import parse_device

    assert parse_device(spec) == expected


@pytest.mark.parametrize("bad", ["abacus", "cpu:", "cpu:\u00b2", "cuda:-1", "", "gpu:1:2"])
def test_parse_device_refuses_other_spellings(bad):
    from unimp.dtypes import parse_device

    with pytest.raises(ValueError, match="not a device unimp reads"):
        parse_device(bad.encode().decode("unicode_escape"))


def test_half_needs_platform():
    with pytest.raises(ValueError, match="get_policy"):
        canonical_dtype("half")


def test_finfo_and_is_half():
    assert finfo("float16").max == 65504.0
    assert finfo("bf16").tiny == 2.0**-126
    assert finfo("float32").tiny == float(np.finfo(np.float32).tiny)
    assert is_half("fp16") and is_half("bfloat16") and not is_half("float32")
