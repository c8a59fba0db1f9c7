"""``unimp explain --block-format``: the block-scaled presets on one block each, element by
element, through ``unimp.cli.main``; the values are derived by hand in each test."""

from __future__ import annotations

import json

import pytest

from unimp.cli import main

MX = "ocp_mx,transformer_engine_mxfp8,torchao_mx,torchao_mx_rceil,jax_mxfp8"


def _json(capsys, *argv):
    assert main(["explain", "--block-format", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _block(table, name):
    return next(b for b in table["blocks"] if b["name"] == name)


def test_a_maximum_above_448_by_preset(capsys):
    """449: floor scale 1 (449 clipped to 448; 0.001 -> 2**-9, the nearest E4M3 subnormal),
    round-up scale 2 (0.001 / 2 = 0.0005 -> 0; 0.01 / 2 = 0.005 -> 3 * 2**-9, times 2)."""
    block = _block(_json(capsys, MX), "above 448")
    rows = block["presets"]
    assert block["values"][0] == 449.0
    assert {n: r["scale"] for n, r in rows.items()} == {
        "ocp_mx": 1.0, "transformer_engine_mxfp8": 2.0, "torchao_mx": 1.0, "torchao_mx_rceil": 2.0, "jax_mxfp8": 2.0,
    }
    assert rows["ocp_mx"]["values"][0] == rows["jax_mxfp8"]["values"][0] == 448.0
    assert rows["ocp_mx"]["values"][5:7] == [5 * 2.0**-9, 2.0**-9]
    assert rows["transformer_engine_mxfp8"]["values"][5:7] == [6 * 2.0**-9, 0.0]
    assert rows["transformer_engine_mxfp8"]["differs"] == [False] * 5 + [True, True, False]
    assert rows["torchao_mx"]["differs"] == [False] * 8
    assert block["differences"][0] == (
        "transformer_engine_mxfp8 vs ocp_mx: scale 2 vs 1; element 6 (0.01): 0.0117188 vs 0.00976562; "
        "element 7 (0.001): 0 vs 0.00195312"
    )


def test_zero_inf_and_tiny_blocks_by_preset(capsys):
    table = _json(capsys, MX)
    zero = _block(table, "zero")["presets"]
    assert all(r["scale"] == 2.0**-127 and set(r["values"]) == {0.0} for r in zero.values())
    inf = _block(table, "inf")["presets"]  # strict JSON: NaN and inf are null
    assert inf["ocp_mx"]["scale"] == 2.0**127 and inf["torchao_mx"]["scale"] == 2.0**120  # byte 247
    assert inf["jax_mxfp8"]["scale"] is None and set(inf["jax_mxfp8"]["values"]) == {None}  # byte 255
    tiny = _block(table, "tiny")["presets"]  # 2**-120: byte 0 (2**-127) under both rules
    assert tiny["ocp_mx"]["values"][0] == tiny["jax_mxfp8"]["values"][0] == 2.0**-120  # 2**7 exact in E4M3
    assert set(tiny["transformer_engine_mxfp8"]["values"]) == {0.0}  # not scaled: 2**-120 -> 0
    assert set(tiny["torchao_mx_rceil"]["values"]) == {0.0}
    assert tiny["torchao_mx"]["values"][0] == 2.0**-121  # / 2**-126 = 64, * 2**-127


def test_nvfp4_and_block_fp8_scales(capsys):
    """449 alone in a tensor: NVFP4's block holding the amax decodes with 448 * (449 / 2688);
    block FP8's S = 448 / 449 floored to 0.5, so 1 / S = 2."""
    block = _block(_json(capsys, "transformer_engine_block_fp8,transformer_engine_nvfp4"), "above 448")["presets"]
    assert block["transformer_engine_block_fp8"]["scale"] == 2.0
    assert block["transformer_engine_nvfp4"]["scale"] == pytest.approx(448 * 449 / 2688, rel=1e-6)
    assert block["transformer_engine_nvfp4"]["values"][0] == pytest.approx(449.0, rel=1e-6)  # q = 6


def test_values_replace_the_default_blocks(capsys):
    table = _json(capsys, "ocp_mx,jax_mxfp8", "--values", "449,0.001")
    assert [b["name"] for b in table["blocks"]] == ["--values"]
    rows = table["blocks"][0]["presets"]
    assert rows["ocp_mx"]["values"] == [448.0, 2.0**-9] and rows["jax_mxfp8"]["values"] == [448.0, 0.0]


def test_all_and_the_text_table(capsys):
    assert main(["explain", "--block-format", "all"]) == 0
    out = capsys.readouterr().out
    for name in ("zero", "inf", "nan", "above 448", "tiny"):
        assert f"block {name!r}:" in out
    line = next(s for s in out.splitlines() if s.strip().startswith("transformer_engine_mxfp8") and "0.01172*" in s)
    assert line.split()[1] == "2"  # its scale
    assert "  - torchao_mx vs ocp_mx: same scale and values" in out
    assert "from pytorch/ao: torchao/prototype/mx_formats/mx_tensor.py" in out


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--block-format", "ocp_mx,jax_mxpf8"], ["choose one of ocp_mx, transformer_engine_mxfp8", "Did you mean 'jax_mxfp8'"]),
        (["--block-format", ","], ["needs preset names (or all)"]),
        (["--block-format", "ocp_mx", "--fp8"], ["drop the recipe, --scalers and --fp8"]),
        (["mixed_float16", "--block-format", "ocp_mx"], ["drop the recipe"]),
        (["--block-format", "ocp_mx", "--values", "1,2,3"], ["1, 2, 4, 8, 16 or 32 numbers"]),
        (["--block-format", "ocp_mx", "--values", "1,x"], ["entry 1 ('x') is not a number"]),
        (["--fp8", "--values", "1"], ["--values goes with --block-format"]),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, words, capsys):
    assert main(["explain", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("unimp explain: error:") and err.strip().count("\n") == 0
    for w in words:
        assert w in err
