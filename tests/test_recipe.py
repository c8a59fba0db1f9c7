import json

import pytest
from conftest import require_backend

from unimp import (
    DynamicLossScale,
    NoLossScale,
    Policy,
    Recipe,
    StaticLossScale,
    get_policy,
    get_recipe,
)


@pytest.mark.parametrize(
    "name,kind",
    [
        ("mixed_float16", "dynamic"),
        ("16-mixed", "dynamic"),
        ("fp16", "dynamic"),
        ("c=f16", "dynamic"),
        ("float16", "none"),  # pure float16: float16 gradients cannot be unscaled safely
        ("16-true", "none"),  # Lightning's HalfPrecision runs no GradScaler
        ("half", "none"),
        ("mixed_bfloat16", "none"),
        ("bf16-mixed", "none"),
        ("bf16", "none"),
        ("float32", "none"),
        ("no", "none"),
        ("64-true", "none"),
    ],
)
def test_default_loss_scale(name, kind):
    assert get_recipe(name).loss_scale.kind == kind


def test_dynamic_with_bfloat16_is_allowed():
    r = get_recipe("mixed_bfloat16", loss_scale=DynamicLossScale())
    assert r.loss_scale == DynamicLossScale() and r.policy.compute_dtype == "bfloat16"


@pytest.mark.parametrize(
    "level,cast_mode,loss_scale,policy",
    [
        ("O0", "autocast", NoLossScale(), Policy("float32", "float32", "float32")),
        (
            "O1",
            "autocast",
            DynamicLossScale.preset("apex"),
            Policy("float32", "float16", "float32"),
        ),
        ("O2", "module", DynamicLossScale.preset("apex"), Policy("float32", "float16", "float32")),
        ("O3", "module", StaticLossScale(1.0), Policy("float16", "float16", "float16")),
    ],
)
def test_apex_levels(level, cast_mode, loss_scale, policy):
    r = get_recipe(level)
    assert (r.cast_mode, r.loss_scale, r.policy) == (cast_mode, loss_scale, policy)


@pytest.mark.parametrize("name", ["mixed_float16", "O2", "bf16-true", "c=f16"])
def test_dict_round_trip(name):
    r = get_recipe(name)
    assert Recipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    assert hash(Recipe.from_dict(r.to_dict())) == hash(r)


def test_from_file_toml_and_json(tmp_path):
    toml = tmp_path / "r.toml"
    toml.write_text(
        'policy = "mixed_float16"\ncast_mode = "module"\n[loss_scale]\nkind = "dynamic"\ninit_scale = 1024\ngrowth_interval = 10\n'
    )
    r = Recipe.from_file(toml)
    assert r.cast_mode == "module"
    assert r.loss_scale == DynamicLossScale(init_scale=1024, growth_interval=10)
    js = tmp_path / "r.json"
    js.write_text(json.dumps(r.to_dict()))
    assert Recipe.from_file(js) == r
    assert get_recipe(str(js)) == r
    nested = tmp_path / "n.toml"
    nested.write_text('[recipe]\npolicy = "bf16-mixed"\n')
    assert Recipe.from_file(nested).policy.compute_dtype == "bfloat16"


@pytest.mark.parametrize(
    "content,ext,needle",
    [
        ('policy = "mixed_float16"\nlosscale = 3\n', ".toml", "losscale"),
        ('policy = "mixed_flaot16"\n', ".toml", "mixed_float16"),
        ('cast_mode = "module"\n', ".toml", "policy"),
        ('policy = "float16"\ncast_mode = "perop"\n', ".toml", "cast_mode"),
        ('policy = "float16"\n[loss_scale]\nkind = "dynamic"\ngrowth = 2\n', ".toml", "growth"),
        ("policy = \n", ".toml", "cannot parse"),
        ('{"policy": "float16",}', ".json", "cannot parse"),
        ("[1, 2]", ".json", "dict"),
        ("policy: float16", ".yaml", ".toml or .json"),
    ],
)
def test_bad_recipe_files_name_the_key(tmp_path, content, ext, needle):
    p = tmp_path / f"r{ext}"
    p.write_text(content)
    with pytest.raises(ValueError, match=needle):
        Recipe.from_file(p)


def test_bad_recipe_values():
    with pytest.raises(ValueError, match="cast_mode"):
        Recipe("float16", cast_mode="fast")
    with pytest.raises(ValueError, match="unknown recipe key"):
        Recipe.from_dict({"policy": "float16", "scaler": 1})
    with pytest.raises(TypeError, match="loss_scale="):
        get_recipe("float16", scale=3)
    with pytest.raises(FileNotFoundError):
        Recipe.from_file("/nonexistent/recipe.toml")


def test_noop_and_describe():
    assert get_recipe("float32").is_noop
    assert not get_recipe("mixed_bfloat16").is_noop
    assert "dynamic(init=32768" in get_recipe("mixed_float16").describe()


def test_the_docs_recipe_file_loads(tmp_path):
    import pathlib
    import re

    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "concepts.md").read_text()
    toml = re.search(r"```toml\n(.*?)```", page, re.S).group(1)
    path = tmp_path / "my.toml"
    path.write_text(toml)
    r = get_recipe(str(path))
    assert str(r.policy) == "params=float32,compute=float16,output=float32"
    assert r.loss_scale.kind == "dynamic" and r.loss_scale.init_scale == 65536.0
    assert r.loss_scale.min_scale == 1.0 and r.cast_mode == "auto"


def _framework_objects(backend):
    """``(framework object, the name it stands for)`` for each backend's policy objects."""
    if backend == "tensorflow":
        import keras
        import tensorflow as tf

        return [
            (keras.mixed_precision.Policy("mixed_float16"), "mixed_float16"),
            (keras.DTypePolicy("mixed_bfloat16"), "mixed_bfloat16"),
            (keras.dtype_policies.DTypePolicyMap(default_policy="mixed_float16"), "mixed_float16"),
            (keras.DTypePolicy("float32"), "float32"),
            (tf.bfloat16, "bfloat16"),
        ]
    if backend == "jax":
        import jax.numpy as jnp
        import jmp

        return [
            (jmp.get_policy("params=float32,compute=float16,output=float32"), "mixed_float16"),
            (jmp.get_policy("half"), "float16"),
            (jnp.bfloat16, "bfloat16"),
        ]
    import torch

    return [(torch.float16, "float16"), (torch.bfloat16, "bfloat16"), (torch.float32, "float32")]


@pytest.mark.parametrize("backend", ["torch", "tensorflow", "jax"])
def test_a_frameworks_own_policy_object_or_dtype_is_the_recipe_its_name_is(backend):
    require_backend(backend)
    for obj, name in _framework_objects(backend):
        assert get_recipe(obj) == get_recipe(name), obj
        assert get_policy(obj) == get_policy(name), obj
    if backend == "tensorflow":  # the call: it raised TypeError ... got DTypePolicy
        import keras

        assert get_recipe(keras.mixed_precision.Policy("mixed_float16")).loss_scale.kind == "dynamic"


def test_framework_objects_that_name_no_policy_are_refused_with_the_fix():
    require_backend("tensorflow")
    import keras
    import numpy as np

    per_layer = keras.dtype_policies.DTypePolicyMap(default_policy="mixed_float16")
    per_layer["head"] = "float32"
    with pytest.raises(ValueError, match=r"gives 1 layer\(s\) their own policy: write them as unimp overrides"):
        get_recipe(per_layer)
    with pytest.raises(ValueError, match="quantizes weights for inference"):
        get_policy(keras.dtype_policies.get("int8_from_mixed_bfloat16"))
    for bad in (None, 3, np.zeros(3), object()):
        with pytest.raises(TypeError, match="get_policy takes a policy name"):
            get_recipe(bad)
