import pytest

from unimp import get_recipe
from unimp.dtypes import device_support


@pytest.mark.parametrize(
    "kind,cc,f16,bf16,rec",
    [
        ("cpu", None, True, True, "float32"),
        ("tpu", None, False, True, "mixed_bfloat16"),
        ("gpu", (9, 0), True, True, "mixed_bfloat16"),
        ("gpu", (8, 0), True, True, "mixed_bfloat16"),
        ("gpu", (7, 5), True, False, "mixed_float16"),
        ("gpu", (6, 1), True, False, "float32"),
        ("gpu", (5, 2), False, False, "float32"),
        ("gpu", None, True, False, "mixed_float16"),
    ],
)
def test_device_support_rule(kind, cc, f16, bf16, rec):
    d = device_support(kind, cc)
    assert (d["float16"], d["bfloat16"], d["recommended"]) == (f16, bf16, rec)
    get_recipe(d["recommended"])


def test_unknown_kind():
    with pytest.raises(ValueError, match="'cpu', 'gpu' or 'tpu'"):
        device_support("npu")
