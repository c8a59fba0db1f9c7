"""The FP8 recipes: get_recipe("fp8" | "fp8-delayed" | "fp8-current" | "transformer-engine")."""

from __future__ import annotations

import json

import pytest

import unimp
from unimp import fp8
from unimp.fp8.recipe import FP8Recipe, matches


@pytest.mark.parametrize(
    ("name", "scaling"),
    [("fp8", fp8.DelayedScaling()), ("fp8-delayed", fp8.DelayedScaling()),
     ("fp8-current", fp8.CurrentScaling()), ("FP8", fp8.DelayedScaling()),
     ("transformer-engine", fp8.DelayedScaling.preset("transformer_engine"))],
)
def test_fp8_recipes(name, scaling):
    r = unimp.get_recipe(name)
    assert r.fp8.scaling == scaling
    assert r.policy == unimp.get_policy("mixed_bfloat16")  # bfloat16 elsewhere, float32 masters
    assert r.loss_scale.kind == "none"
    assert r.fp8.layers == ("Dense", "Linear", "Conv") and r.fp8.exclude_first_last
    assert unimp.Recipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    assert "fp8 HYBRID" in r.describe()


def test_plain_recipes_keep_their_dict():
    assert "fp8" not in unimp.get_recipe("mixed_float16").to_dict()


def test_fp8_override_and_exclude():
    r = unimp.get_recipe("fp8", fp8=FP8Recipe(fp8.CurrentScaling(), exclude=("encoder.*", "head")))
    assert r.fp8.scaling.kind == "current" and r.fp8.exclude == ("encoder.*", "head")
    r2 = unimp.get_recipe("mixed_bfloat16", fp8={"scaling": {"kind": "delayed", "amax_history_len": 16}})
    assert r2.fp8.scaling.amax_history_len == 16


@pytest.mark.parametrize(
    ("pattern", "path", "hit"),
    [("encoder.*", "encoder.layer1.fc", True), ("head", "head.dense", True), ("head", "heads.dense", False),
     ("*.fc", "encoder.layer1.fc", True), ("layer1", "encoder.layer1.fc", False), ("encoder.layer?", "encoder.layer1.fc", True)],
)
def test_exclude_glob_matches_whole_path_or_dotted_prefix(pattern, path, hit):
    assert matches(pattern, path) is hit


def test_applies_to():
    f = FP8Recipe(exclude=("head",))
    assert f.applies_to("body.fc", "Linear", index=1, count=4)
    assert not f.applies_to("embed", "Linear", index=0, count=4)  # first
    assert not f.applies_to("out", "Dense", index=3, count=4)  # last
    assert not f.applies_to("head.proj", "Linear", index=2, count=4)  # excluded by pattern
    assert not f.applies_to("norm", "LayerNorm")
    assert FP8Recipe(exclude_first_last=False).applies_to("embed", "Conv2D", index=0, count=4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"scaling": "delayed"}, "FP8Recipe.scaling"), ({"exclude": "head"}, "FP8Recipe.exclude"),
     ({"layers": ("Dense", "")}, "FP8Recipe.layers"), ({"exclude_first_last": 1}, "exclude_first_last"),
     ({"exclude": ("head;out",)}, r"FP8Recipe.exclude: pattern 'head;out'"),  # never matched, silently
     ({"exclude": (" head",)}, r"FP8Recipe.exclude: pattern ' head'"),
     ({"layers": ("Dens",)}, r"'Dens' is not a layer kind .* Did you mean 'Dense'"),  # selected none
     ({"layers": ("dense",)}, r"'dense' is not a layer kind .* Did you mean 'Dense'"),
     # never an identifier, so never a class-name prefix: accepted, and selected no layer, before
     ({"layers": ("Linear:0",)}, r"'Linear:0' is not a layer kind .*\(an identifier\).* Did you mean 'Linear'"),
     ({"layers": ("Dense ",)}, r"'Dense ' is not a layer kind .* Did you mean 'Dense'"),
     ({"layers": ("Conv/2d",)}, r"'Conv/2d' is not a layer kind .* Did you mean 'Conv'")],
)
def test_fp8_recipe_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FP8Recipe(**kwargs)
    with pytest.raises(ValueError, match="unknown FP8 recipe key"):
        unimp.Recipe.from_dict({"policy": "mixed_bfloat16", "fp8": {"exclud": []}})


#: the compare ViT's layers in model order (unimp/compare/models.py): eight Dense/Linear layers
VIT_LAYERS = [("emb", "Linear"), ("ln1", "LayerNorm"), ("attn.q", "Linear"), ("attn.k", "Linear"),
              ("attn.v", "Linear"), ("attn.o", "Linear"), ("ln2", "LayerNorm"), ("mlp.fc1", "Linear"),
              ("mlp.fc2", "Linear"), ("lnf", "LayerNorm"), ("l2", "Linear")]


def test_select_first_and_last_out_and_globs():
    assert FP8Recipe().select(VIT_LAYERS) == ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.fc1", "mlp.fc2")
    assert FP8Recipe(exclude=("attn.*",)).select(VIT_LAYERS) == ("mlp.fc1", "mlp.fc2")
    assert FP8Recipe(exclude_first_last=False, exclude=("mlp",)).select(VIT_LAYERS) == (
        "emb", "attn.q", "attn.k", "attn.v", "attn.o", "l2")
    assert FP8Recipe().select([("l1", "Dense"), ("l2", "Dense")]) == ()  # the seeds' MLP: none
    with pytest.raises(ValueError, match="given twice"):
        FP8Recipe().select([("a", "Dense"), ("a", "Dense")])
    with pytest.raises(ValueError, match="pairs of strings"):
        FP8Recipe().select(["a"])


def test_exclude_reads_slash_as_dot_as_overrides_do():
    # Keras's layer.path and unimp trace's names use '/'; the dotted paths never matched them
    f = FP8Recipe(exclude=("encoder/fc",))
    assert f.exclude == ("encoder.fc",) and not f.applies_to("encoder.fc", "Dense")


def test_a_bare_scaling_config_as_recipe_fp8_names_the_wrapper():
    with pytest.raises(ValueError, match=r"wrap the scaling config: fp8=FP8Recipe\(CurrentScaling\(...\)\)"):
        unimp.get_recipe("mixed_bfloat16", fp8=fp8.CurrentScaling())


def test_policy_overrides_keep_their_layers_out_of_float8():
    # the overrides decide which layers stay out: 'b' runs in float32, as its override says
    policy = unimp.get_policy("mixed_bfloat16;b:float32")
    r = unimp.Recipe(policy, fp8=FP8Recipe(exclude_first_last=False))
    layers = [("a", "Linear"), ("b", "Linear"), ("b.inner", "Linear"), ("c", "Linear")]
    assert r.fp8.select(layers) == ("a", "c")
    assert r.fp8.kept_out == ("b",) and "policy overrides ['b'] kept out" in r.fp8.describe()
    # not a field: the recipe round-trips and compares as before, the policy carries the patterns
    assert unimp.Recipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    assert "kept_out" not in r.to_dict()["fp8"]
    assert unimp.Recipe("mixed_bfloat16", fp8=FP8Recipe(exclude_first_last=False)).fp8.select(layers) == (
        "a", "b", "b.inner", "c")


@pytest.mark.parametrize("name", ["fp8", "fp8-current", "transformer-engine"])
def test_fp8_none_gives_the_recipe_without_float8(name):
    # fp8=None is "no FP8 part", as Recipe(fp8=None) and recipe.replace(fp8=None); left out,
    # the FP8 recipe keeps its own
    plain = unimp.get_recipe(name, fp8=None)
    assert plain.fp8 is None and str(plain.policy) == str(unimp.get_policy("mixed_bfloat16"))
    assert plain == unimp.get_recipe(name).replace(fp8=None)
    assert unimp.get_recipe(name).fp8 is not None


def test_fp8_recipe_takes_a_numpy_bool_as_a_bool():
    import numpy as np

    r = FP8Recipe(exclude_first_last=np.bool_(False))
    assert r.exclude_first_last is False and r == FP8Recipe(exclude_first_last=False)


def test_float8_with_float16_compute_is_refused_by_name_and_in_a_recipe_alike(tmp_path):
    # one rule (issue 28 item 9): a recipe file with a mixed_float16 policy and an [fp8] table
    # ran, and its report called the float16 reference run "bfloat16", while the name was refused
    path = tmp_path / "fp8_f16.toml"
    path.write_text('[policy]\nname = "mixed_float16"\n\n[fp8]\n')
    for make in (
        lambda: unimp.get_recipe("transformer-engine-float16"),
        lambda: unimp.Recipe("mixed_float16", fp8=FP8Recipe()),
        lambda: unimp.get_recipe("16-mixed", fp8=FP8Recipe()),
        lambda: unimp.get_recipe(str(path)),
    ):
        with pytest.raises(ValueError, match=r"FP8 with float16 compute .* is not supported"):
            make()
    assert unimp.Recipe("mixed_bfloat16", fp8=FP8Recipe()).fp8 is not None
