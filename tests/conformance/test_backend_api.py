"""The backends expose the same neutral names with the same meaning."""

import importlib

import pytest
from conftest import require_backend

import unimp
from unimp import StepResult, canonical_dtype, get_recipe, registry
from unimp.backends._base import COMMON_API, MixedPrecisionBase

NEUTRAL_METHODS = (
    "recipe",
    "policy",
    "device",
    "loss_scale",
    "compute_dtype",
    "param_dtype",
    "output_dtype",
    "cast_to_compute",
    "cast_to_param",
    "cast_to_output",
    "autocast",
    "prepare",
    "train_step",
)


def test_every_backend_exports_the_common_api(backend):
    module = require_backend(backend)
    missing = [n for n in COMMON_API if n not in module.__all__ or not hasattr(module, n)]
    assert missing == []
    assert [n for n in module.__all__ if getattr(module, n, None) is None] == []  # all there
    assert module.StepResult is StepResult
    assert issubclass(module.MixedPrecision, MixedPrecisionBase)
    for name in (backend, *registry.backend_info(backend).aliases):  # "tf", "flax", ...
        mp = unimp.mixed_precision("mixed_float16", backend=name)
        assert type(mp) is module.MixedPrecision and mp.backend == backend, name


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_a_mixed_recipe_binds_to_the_frameworks_dtypes(backend, half):
    module = require_backend(backend)
    mp = unimp.mixed_precision(f"mixed_{half}", backend=backend)
    assert mp.compute_dtype == module.to_dtype(half)
    assert mp.param_dtype == mp.output_dtype == module.to_dtype("float32")
    assert canonical_dtype(mp.compute_dtype) == mp.policy.compute_dtype == half
    assert mp.recipe.policy is mp.policy


def test_mixed_precision_has_the_neutral_names(backend):
    mp = require_backend(backend).MixedPrecision(get_recipe("mixed_float16"))
    assert [n for n in NEUTRAL_METHODS if not hasattr(mp, n)] == []
    assert mp.recipe == get_recipe("mixed_float16")


def test_mixed_precision_takes_the_recipe_overrides(backend):
    # the overrides get_recipe takes, in one call (they used to reach the backend as a TypeError)
    require_backend(backend)
    mp = unimp.mixed_precision("float32", loss_scale="dynamic", cast_mode="module", backend=backend)
    assert mp.recipe == get_recipe("float32", loss_scale="dynamic", cast_mode="module")
    assert mp.loss_scale.kind == "dynamic"
    tpu = unimp.mixed_precision("half", platform="tpu", backend=backend)  # get_recipe's third
    assert tpu.recipe == get_recipe("half", platform="tpu")
    with pytest.raises(ValueError, match="unknown loss scale 'sometimes'"):
        unimp.mixed_precision("float32", loss_scale="sometimes", backend=backend)


def test_device_is_one_option_in_every_backend(backend):
    # the same keyword everywhere (it used to be torch's only): placed there, or a clear error
    require_backend(backend)
    mp = unimp.mixed_precision("mixed_float16", backend=backend, device="cpu")
    assert "cpu" in str(mp.device).lower()
    with pytest.raises(ValueError, match="cuda:63"):
        unimp.mixed_precision("mixed_float16", backend=backend, device="cuda:63")


def test_device_info_shape(backend):
    module = require_backend(backend)
    info = module.device_info()
    assert info, "at least the CPU"
    for d in info:
        assert set(d) == {"device", "kind", "float16", "bfloat16", "float8", "recommended"}
        assert d["kind"] in ("cpu", "gpu", "tpu")
        get_recipe(d["recommended"])
    assert module.framework_version() == importlib.import_module(backend).__version__


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32"])
def test_to_dtype_round_trips(backend, name):
    assert canonical_dtype(require_backend(backend).to_dtype(name)) == name


def test_to_dtype_reads_the_short_names(backend):
    to_dtype = require_backend(backend).to_dtype
    short = {"bf16": "bfloat16", "f32": "float32", "float": "float32", "fp16": "float16"}
    assert {k: canonical_dtype(to_dtype(k)) for k in short} == short
    assert to_dtype("bf16") == to_dtype("bfloat16") and to_dtype("float") == to_dtype("float32")


def test_every_backend_exports_the_fp8_api(backend):
    from unimp.backends._base import FP8_API

    module = require_backend(backend)
    assert [n for n in FP8_API if n not in module.__all__ or not hasattr(module, n)] == []
