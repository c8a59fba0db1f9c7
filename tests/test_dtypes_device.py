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


@pytest.mark.parametrize(
    ("kind", "cc", "float8"),
    [("cpu", None, False), ("tpu", None, False), ("gpu", (8, 0), False), ("gpu", (8, 9), True),
     ("gpu", (9, 0), True), ("gpu", None, False)],
)
def test_float8_units_from_compute_capability_8_9(kind, cc, float8):
    assert device_support(kind, cc)["float8"] is float8


def test_float8_line_says_emulated_and_small_layers_gain_nothing():
    from unimp.dtypes import float8_line

    cpu = float8_line([device_support("cpu") | {"device": "cpu"}])
    assert cpu.startswith("float8 matmuls: emulated by default (no float8 units here, where the native "
                          "path runs emulated too; the native float8 GEMMs are opt-in (UNIMP_FP8_NATIVE=1)")
    assert "small layers gain nothing" in cpu and "1.5x" in cpu
    h100 = float8_line([device_support("gpu", (9, 0)) | {"device": "cuda:0"}], "torch")
    assert "cuda:0 has float8 units; torch FP8Dense(native=True) is opt-in (torch._scaled_mm)" in h100
    for backend, path in [("tensorflow", "Keras FP8Dense(native=True) is opt-in (XLA-compiled"),
                          ("jax", "JAX fp8_dot_general(native=True) is opt-in (float8 dot_general")]:
        assert path in float8_line([device_support("gpu", (9, 0)) | {"device": "cuda:0"}], backend)
