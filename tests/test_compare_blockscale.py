"""`unimp compare --recipes mixed_bfloat16,mxfp8 --model vit`: the block-scaled recipes train the
compare ViT in every framework (torch and Keras swap the selected layers in prepare; the JAX
runner sends the selected paths through ``mp.block_matmul``), and the run differs from the
bfloat16 one only by the format's error."""

from __future__ import annotations

import json

import pytest
from conftest import BACKENDS, require_backend

from unimp.cli import main
from unimp.compare.explain import explain_recipe
from unimp.recipe import get_recipe

#: |mxfp8 - bfloat16| test accuracy on digits, measured: the ViT, 2 epochs of batch 32 on a
#: CPU: torch 0.008, TensorFlow 0.006, JAX 0.000 (nvfp4 and mxfp4 up to 0.039); after
#: 1 epoch of batch 512 the two runs are within a few test images
ACCURACY_TOLERANCE = 0.03


@pytest.mark.slow  # about 20 s per framework on 2 CPU cores: a bfloat16 and an mxfp8 ViT run
@pytest.mark.parametrize("backend", BACKENDS)
def test_compare_mxfp8_vit_trains_and_differs_from_bfloat16(backend, tmp_path):
    require_backend(backend)
    out = tmp_path / "rep"
    code = main(["compare", "--recipes", "mixed_bfloat16,mxfp8", "--model", "vit", "--epochs", "1",
                 "--batch-size", "512", "--backends", backend, "--quiet", "--out", str(out)])
    assert code == 0
    rows = {r[1]: r for r in json.loads((out / "report.json").read_text())["rows"] if r[0] == backend}
    bf16, mx = rows["mixed_bfloat16"], rows["mxfp8"]
    assert bf16[2] != mx[2]  # the loss: the block-scaled layers ran
    assert abs(float(bf16[3]) - float(mx[3])) <= ACCURACY_TOLERANCE
    block = json.loads((out / "report.json").read_text())["recipes"]["mxfp8"]["block"]
    # the ViT's blocks in the format, the patch embedding and the head kept out (first / last)
    assert block["layers"][backend][-2:] == ["mlp.fc1", "mlp.fc2"]
    assert block["accuracy"][backend]["bfloat16"] is None  # its reference is a row of its own


@pytest.mark.slow  # a bfloat16 and an mxfp8 ViT run in torch, about 20 s on 2 CPU cores
def test_compare_of_one_block_scaled_recipe_reports_its_layers_against_bfloat16(tmp_path):
    require_backend("torch")
    out = tmp_path / "rep"
    assert main(["compare", "--recipe", "mxfp8", "--model", "vit", "--epochs", "1", "--batch-size", "512",
                 "--backends", "torch", "--quiet", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    acc = report["block"]["accuracy"]["torch"]
    assert acc["block"] == report["runs"]["torch"]["test_accuracy"]
    assert acc["diff"] == pytest.approx(acc["block"] - acc["bfloat16"]) and abs(acc["diff"]) <= ACCURACY_TOLERANCE
    md = (out / "report.md").read_text()
    assert "## Block-scaled (mxfp8)" in md and "attn.q, attn.k, attn.v, attn.o, mlp.fc1, mlp.fc2" in md
    assert "The published recipe: arXiv 2506.08027" in md


@pytest.mark.slow  # three Keras worker processes, about 25 s each on 2 CPU cores
def test_compare_mxfp8_vit_trains_on_every_keras_engine(tmp_path):
    """Keras's own trainer on each engine (unimp.keras.blockscale on JAX and torch, the
    TensorFlow backend's swap on TensorFlow) trains the ViT with its block-scaled layers from
    the same weights, and predicts the held-out rows (Keras-TensorFlow's predict of a partial
    batch has no static batch size, which the block checks need: compare predicts one batch)."""
    for name in ("tensorflow", "jax", "torch"):
        require_backend(name)
    engines = ["keras-tensorflow", "keras-jax", "keras-torch"]
    out = tmp_path / "rep"
    # (--recipes: one recipe without the bfloat16 reference runs the block section adds)
    code = main(["compare", "--recipes", "mxfp8", "--model", "vit", "--epochs", "1", "--batch-size", "512",
                 "--backends", ",".join(engines), "--quiet", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "report.json").read_text())["recipes"]["mxfp8"]
    runs = report["runs"]
    assert all(report["block"]["layers"][e][-2:] == ["mlp.fc1", "mlp.fc2"] for e in engines)
    assert list(runs) == engines
    first = [r["loss"][0] for r in runs.values()]
    assert max(first) - min(first) <= 2e-2 * first[0], first  # bfloat16 kernels apart, no more
    for r in runs.values():
        assert all(r["applied"]) and 0.0 <= r["test_accuracy"] <= 1.0


def test_explain_names_what_each_framework_does_with_a_block_scaled_recipe():
    lines = dict(explain_recipe(get_recipe("nvfp4")))
    assert any("BlockScaledLinear" in line and "block-scaled nvfp4" in line for line in lines["torch"])
    assert any("every Keras engine" in line and "block-scaled nvfp4" in line for line in lines["tensorflow"])
    assert any("mp.block_matmul(path, x, w, step)" in line for line in lines["jax"])
    assert not any("block" in line for line in dict(explain_recipe(get_recipe("mixed_bfloat16")))["torch"])
