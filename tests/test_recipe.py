import json

import pytest

from unimp import DynamicLossScale, NoLossScale, Policy, Recipe, StaticLossScale, get_recipe


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


def test_the_readme_recipe_file_loads(tmp_path):
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    toml = re.search(r"```toml\n(.*?)```", readme, re.S).group(1)
    path = tmp_path / "my.toml"
    path.write_text(toml)
    r = get_recipe(str(path))
    assert str(r.policy) == "params=float32,compute=float16,output=float32"
    assert r.loss_scale.kind == "dynamic" and r.loss_scale.init_scale == 65536.0
    assert r.loss_scale.min_scale == 1.0 and r.cast_mode == "auto"
