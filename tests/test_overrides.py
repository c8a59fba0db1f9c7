"""Per-layer overrides in the core: the matching rule, normalisation, parsing and serialisation."""

from __future__ import annotations

import json

import pytest

from unimp import Policy, Recipe, get_policy, get_recipe
from unimp.overrides import (
    OverrideWarning,
    match_overrides,
    pattern_matches,
    resolve_overrides,
    top_paths,
)

F32 = Policy("float32", "float32", "float32")


@pytest.mark.parametrize(
    ("pattern", "path", "expected"),
    [
        ("head", "head", True),
        ("head", "head.weight", True),
        ("head", "header", False),
        ("head", "body.head", False),
        ("*norm*", "blocks.0.norm1.weight", True),
        ("blocks.*.attn", "blocks.3.attn.q.bias", True),
        ("blocks.?.attn", "blocks.12.attn", False),
        ("blocks.[0-1].attn", "blocks.1.attn", True),
        ("blocks.[0-1].attn", "blocks.2.attn", False),
        ("Head", "head", False),  # case-sensitive
    ],
)
def test_pattern_matches_whole_path_or_dotted_prefix(pattern, path, expected):
    assert pattern_matches(pattern, path) is expected


def test_dtype_value_keeps_parent_param_dtype():
    p = Policy("float32", "float16", "float32", overrides={"head": "float32", "emb": "bf16"})
    assert dict(p.overrides) == {
        "head": F32,
        # a dtype name wins over Lightning's mixed "bf16": the layer computes and returns bf16
        "emb": Policy("float32", "bfloat16", "bfloat16"),
    }


def test_policy_values_and_named_policies():
    p = get_policy("bfloat16").with_(
        overrides={"a": "mixed_float16", "b": "params=float32,compute=float32", "c": F32}
    )
    assert dict(p.overrides) == {
        "a": Policy("float32", "float16", "float32"),
        "b": F32,
        "c": F32,
    }


def test_a_slash_reads_as_a_dot():
    p = get_policy("mixed_float16;head/0:float32")
    assert p.overrides == (("head.0", F32),)
    assert p.policy_for("head.0.weight") == F32


def test_overrides_are_canonical_and_hashable():
    a = Policy("float32", "float16", "float32", overrides={"x": "f32", "y": "float32"})
    b = Policy("float32", "float16", "float32", overrides=[("y", F32), ("x", "float32")])
    assert a == b and hash(a) == hash(b)
    assert a.overrides == (("x", F32), ("y", F32))
    assert {a: 1}[b] == 1


@pytest.mark.parametrize(
    "text",
    [
        "mixed_float16;l2:float32",
        "mixed_bfloat16;*norm*:float32;blocks.*.attn:params=float32,compute=float16,output=float32",
        "bfloat16;head:float32",
    ],
)
def test_str_parses_back_to_an_equal_policy(text):
    p = get_policy(text)
    assert p.overrides
    assert get_policy(str(p)) == p
    assert str(get_policy(str(p))) == str(p)


def test_str_writes_dtype_values_compactly():
    p = get_policy("mixed_float16").with_(overrides={"l2": "float32"})
    assert str(p) == "params=float32,compute=float16,output=float32;l2:float32"
    assert repr(get_policy("mixed_float16")) == (
        "Policy(param_dtype='float32', compute_dtype='float16', output_dtype='float32')"
    )
    assert "overrides=(('l2'" in repr(p)


def test_recipe_dict_and_files_keep_overrides(tmp_path):
    r = get_recipe("mixed_float16;l2:float32;*norm*:float32")
    assert Recipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    j = tmp_path / "r.json"
    j.write_text(json.dumps(r.to_dict()))
    assert Recipe.from_file(j) == r
    t = tmp_path / "r.toml"
    t.write_text(
        '[policy]\nname = "mixed_float16"\n[policy.overrides]\nl2 = "float32"\n"*norm*" = "float32"\n'
    )
    assert Recipe.from_file(t) == r
    assert "l2:float32" in r.describe()


@pytest.mark.parametrize(
    ("table", "match"),
    [('[policy.overrides]\nblocks.0.attn = "float32"\n', r"quote the pattern \(\"blocks.0.attn\""),
     ('[policy.overrides]\nhead = {params = "float32", compute = "float32"}\n', "policy value as a string"),
     ('overrides = "head:float32"\n', "'overrides' must be a table"),
     ("overrides = []\n", "'overrides' must be a table")],
    ids=["unquoted-dotted-key", "inline-table-value", "string", "array"],
)
def test_recipe_file_overrides_table_mistakes_name_the_fix(tmp_path, table, match):
    t = tmp_path / "r.toml"
    t.write_text('[policy]\nname = "mixed_float16"\n' + table)
    with pytest.raises(ValueError, match=match):
        Recipe.from_file(t)


def test_recipe_file_policy_table_takes_the_whole_step_fields(tmp_path):
    t = tmp_path / "r.toml"
    t.write_text('[policy]\nname = "mixed_float16"\nmatmul_precision = "high"\nreduce_dtype = "float32"\n'
                 'accum_dtype = "float32"\n[policy.overrides]\nl2 = "float32"\n')
    r = Recipe.from_file(t)
    assert (r.policy.matmul_precision, r.policy.reduce_dtype, r.policy.accum_dtype) == ("high", "float32", "float32")
    assert r.policy.compute_dtype == "float16" and dict(r.policy.overrides)["l2"].compute_dtype == "float32"
    assert Recipe.from_dict(r.to_dict()) == r


@pytest.mark.parametrize(
    ("table", "match"),
    [('name = "mixed_float16"\nmatmul_precision = "fast"\n', "must be one of 'highest'"),
     ('name = "mixed_float16"\ncompute_dtype = "float32"\n', r"takes 'name' \(required\) and \['matmul_precision'"),
     ('name = "mixed_float16,matmul=high"\nmatmul_precision = "medium"\n', "matmul_precision is given twice"),
     ('name = "matmul=high"\nmatmul_precision = "medium"\n', "matmul_precision is given twice"),
     ('name = "reduce=bf16"\nreduce_dtype = "float32"\n', "reduce_dtype is given twice"),
     ('name = "mixed_float16;l2:float32"\n[policy.overrides]\nl2 = "float16"\n', "pattern 'l2' is given twice")],
    ids=["bad-precision", "not-a-table-key", "field-in-name-and-table", "field-first-in-name",
         "dtype-field-first-in-name", "pattern-in-name-and-table"],
)
def test_recipe_file_policy_table_bad_field_is_refused(tmp_path, table, match):
    t = tmp_path / "r.toml"
    t.write_text('[policy]\n' + table)
    with pytest.raises(ValueError, match=match):
        Recipe.from_file(t)


def test_recipe_file_policy_table_matmul_none_is_the_frameworks_setting(tmp_path):
    # TOML has no null: "none" turns off the float32 name's implied "highest", as matmul=none does
    t = tmp_path / "r.toml"
    t.write_text('[policy]\nname = "float32"\nmatmul_precision = "none"\n')
    assert get_policy("float32").matmul_precision == "highest"
    assert Recipe.from_file(t).policy == get_policy("float32,matmul=none")
    assert Recipe.from_file(t).policy.matmul_precision is None


def test_policy_for_and_is_float32():
    p = get_policy("mixed_float16;l2:float32")
    assert p.policy_for("l2.bias") == F32
    assert p.policy_for("l1") == get_policy("mixed_float16")
    assert not get_policy("float32;l2:bf16").is_float32
    assert get_policy("float32;l2:float32").is_float32


def test_conflict_names_both_patterns():
    p = get_policy("mixed_float16;*norm*:float32;blocks.*:bfloat16")
    with pytest.raises(ValueError, match=r"'\*norm\*'.*'blocks\.\*'|'blocks\.\*'.*'\*norm\*'"):
        p.policy_for("blocks.0.norm")
    with pytest.raises(ValueError, match="conflict at 'blocks.0.norm'"):
        resolve_overrides(p.overrides, ["blocks.0.attn", "blocks.0.norm"])
    # patterns that agree are no conflict
    same = get_policy("mixed_float16;*norm*:float32;blocks.*:float32")
    assert match_overrides(same.overrides, "blocks.0.norm")[1] == F32


def test_unmatched_pattern_warns_with_nearest_paths():
    p = get_policy("mixed_float16;haed:float32")
    with pytest.warns(OverrideWarning, match=r"'haed' matches no layer.*did you mean 'head'"):
        assert resolve_overrides(p.overrides, ["body", "head", "head.weight"]) == {}


def test_top_paths_keeps_outermost():
    p = get_policy("mixed_float16;attn:float32")
    resolved = resolve_overrides(p.overrides, ["attn", "attn.q", "attn.k", "mlp"])
    assert list(resolved) == ["attn", "attn.q", "attn.k"]
    assert list(top_paths(resolved)) == ["attn"]


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"head": "float8"}, ValueError, r"overrides\['head'\].*float8"),
        ({"head": 3}, TypeError, r"overrides\['head'\]"),
        ({"": "float32"}, ValueError, "non-empty glob"),
        ({"a;b": "float32"}, ValueError, r"without whitespace"),
        ({"a": get_policy("mixed_float16;b:float32")}, ValueError, "overrides of its own"),
        ([("a", "float32"), ("a", "float16")], ValueError, "given twice"),
        ("head=float32", TypeError, "must be a dict"),
    ],
)
def test_bad_overrides_are_errors(overrides, error, match):
    with pytest.raises(error, match=match):
        Policy("float32", "float16", "float32", overrides=overrides)


def test_bad_override_text():
    with pytest.raises(ValueError, match="not pattern:value"):
        get_policy("mixed_float16;l2")


def test_explain_lists_each_override_per_framework():
    from unimp.compare.explain import explain_recipe

    lines = dict(explain_recipe(get_recipe("mixed_float16;l2:float32")))
    assert any("'l2'" in x and "enabled=False" in x for x in lines["torch"])
    assert any("'l2'" in x and '"float32"' in x for x in lines["tensorflow"])
    assert any("'l2'" in x and "mp.module_kwargs(path)" in x for x in lines["jax"])


def test_compare_accepts_a_recipe_file_with_overrides(tmp_path):
    from unimp.compare.run import CompareConfig, validate

    path = tmp_path / "r.toml"
    path.write_text('[policy]\nname = "mixed_float16"\n[policy.overrides]\nl2 = "float32"\n')
    recipe, _, _ = validate(CompareConfig(recipe=str(path), backends=("jax",)))
    assert recipe == get_recipe("mixed_float16;l2:float32")
