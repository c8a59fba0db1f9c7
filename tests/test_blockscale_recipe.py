"""unimp.blockscale_recipe: which Dense / Linear layers a block-scaled recipe selects (the FP8
recipes' rule), its checks and its dict form (no framework)."""

from __future__ import annotations

import doctest

import pytest

from unimp import blockscale_recipe
from unimp.blockscale_recipe import GUIDANCE, BlockRecipe

LAYERS = [("emb", "Embedding"), ("fc1", "Linear"), ("ln", "LayerNorm"), ("blocks.0.fc", "Linear"),
          ("blocks.1.fc", "Linear"), ("head", "Linear")]


def test_docstring_examples_run():
    result = doctest.testmod(blockscale_recipe)
    assert result.attempted >= 1 and result.failed == 0


def test_selection_is_the_fp8_recipes_first_last_and_exclude_rule():
    assert BlockRecipe("mxfp8").select(LAYERS) == ("blocks.0.fc", "blocks.1.fc")
    assert BlockRecipe("mxfp8", exclude=("blocks.1.*",)).select(LAYERS) == ("blocks.0.fc",)
    assert BlockRecipe("nvfp4", exclude_first_last=False).select(LAYERS) == (
        "fc1", "blocks.0.fc", "blocks.1.fc", "head")
    assert BlockRecipe("mxfp8").with_kept_out(["blocks.0"]).select(LAYERS) == ("blocks.1.fc",)


def test_round_trips_through_its_dict():
    r = BlockRecipe("fp8-block", exclude=("head",), seed=4)
    assert r.rule.name == "fp8_block"
    assert BlockRecipe.from_dict(r.to_dict()) == r
    assert r.to_dict()["rule"] == "fp8_block"
    assert "block-scaled fp8_block" in r.describe() and "excluding ['head']" in r.describe()
    assert set(GUIDANCE) == {"mxfp8", "fp8_block", "nvfp4", "mxfp4"}
    assert "15 %" in BlockRecipe("nvfp4").guidance


def test_bad_input_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="block-scaled convolutions are not built"):
        BlockRecipe("mxfp8", layers=("Conv2D",))
    with pytest.raises(ValueError, match="Did you mean 'nvfp4'"):
        BlockRecipe("nvfp3")
    with pytest.raises(TypeError, match="seed must be an int"):
        BlockRecipe("nvfp4", seed=1.5)
    with pytest.raises(ValueError, match="unknown block-scaled recipe key"):
        BlockRecipe.from_dict({"rule": "mxfp8", "scaling": {}})
    with pytest.raises(ValueError, match="exclude"):
        BlockRecipe("mxfp8", exclude=("a b",))
