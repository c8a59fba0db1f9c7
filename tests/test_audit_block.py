"""``unimp audit --to mxfp8`` (and fp8-block, nvfp4, mxfp4): the thresholds, the reading of the
block formats' statistics, and a planted layer named in every backend."""

import json

import numpy as np
import pytest
from conftest import BACKENDS, require_backend

from unimp.cli import main
from unimp.compare.audit import audit_stats, initial_scale
from unimp.compare.audit_block import TYPICAL, thresholds
from unimp.recipe import BLOCK_RECIPES
from unimp.stats import BLOCK_FORMATS, StepStats, reference_stats

_rng = np.random.default_rng(1)


def _step(i, acts, grads, fmt):
    return StepStats(
        i,
        {k: reference_stats(v, 1.0, fmt) for k, v in grads.items()},
        {k: reference_stats(v, 1.0, fmt) for k, v in acts.items()},
    )


def test_the_typical_errors_are_the_rules_on_a_standard_normal_tensor():
    x = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)
    s = reference_stats(x, 1.0, BLOCK_FORMATS)
    for fmt, (under, mse) in TYPICAL.items():
        assert s.underflow(fmt) == pytest.approx(under, abs=0.0006), fmt
        assert s.relative_mse(fmt) == pytest.approx(mse, rel=0.02), fmt
    assert sorted(BLOCK_RECIPES.values()) == sorted(BLOCK_FORMATS)
    t = thresholds("mxfp8", 0.01)
    assert (t["underflow"], t["relative_mse"]) == (0.01, pytest.approx(2.8e-3))
    assert thresholds("mxfp4", 0.3)["underflow"] == 0.3 and thresholds("mxfp4")["underflow"] == pytest.approx(0.176)
    assert "twice what a standard normal tensor loses" in t["why"] and "four times" in t["why"]
    assert initial_scale("nvfp4") == initial_scale("fp8-block") == 1.0  # the block recipes scale no loss
    with pytest.raises(ValueError, match="choose one of mxfp8, fp8-block, nvfp4, mxfp4"):
        thresholds("fp4")


def test_ordinary_tensors_are_clean_and_the_ones_that_lose_more_are_named():
    normal = _rng.standard_normal((32, 128)).astype(np.float32)
    # 30 octaves within a block: a third of it is more than 2**17 below its block's largest
    # value and rounds to 0, yet carries too little of the energy to raise the MSE
    spread = normal * np.float32(2.0) ** _rng.integers(-30, 0, (32, 128))
    tiny = normal * np.float32(1e-37)  # every block below 448 * 2**-127: left unscaled, lost
    head = np.float32([1e-30] + [1.0] * 9)  # loses 10 %, but has fewer elements than a block: not named
    acts = {"l2": spread, "l1": normal, "l3": tiny, "l4": tiny * 2, "head": head}
    steps = [_step(0, acts, {"l1.weight": normal}, "mxfp8")]
    assert steps[0].activations["head"].underflow("mxfp8") == 0.1
    found = audit_stats(steps, "mxfp8")
    assert [(f.layer, f.kind, f.downstream) for f in found] == [
        ("l2", "activation underflow", ()),
        ("l3", "activation quantization error", ("l4",)),  # l4 carries l3's values on
        ("l3", "activation underflow", ("l4",)),
    ]
    assert 0.3 < found[0].fraction < 0.4 and found[1].fraction == found[2].fraction == 1.0  # all of l3 is 0
    assert "the layers that read l3's output" in found[2].fix and "bfloat16" in found[2].fix
    assert found[0].headroom == steps[0].activations["l2"].headroom("bfloat16")
    # FP4 loses a few % of a normal tensor to 0 and errs by about 1e-2: that is not a finding
    fp4 = [_step(0, {"l1": normal}, {"l1.weight": normal}, "nvfp4")]
    assert audit_stats(fp4, "nvfp4") == []
    # statistics taken without the target's format say so
    with pytest.raises(KeyError, match="block format 'mxfp4' was not measured"):
        audit_stats(steps, "mxfp4")


def test_gradients_are_named_only_when_non_finite():
    normal = _rng.standard_normal((8, 64)).astype(np.float32)
    lopsided = normal.copy()
    lopsided[:, 0] = 1e6  # a huge value in the first block of each row: the rest of it rounds to 0
    bad = normal.copy()
    bad[0, 0] = np.inf
    steps = [
        _step(0, {"l0": normal}, {"l2/kernel": lopsided, "l3/kernel": bad}, "mxfp4"),
        _step(1, {"l0": normal}, {"l2/kernel": lopsided, "l3/kernel": normal}, "mxfp4"),
    ]
    assert steps[0].gradients["l2/kernel"].underflow("mxfp4") > 0.5  # measured, and recorded
    (f,) = audit_stats(steps, "mxfp4")  # but a parameter's gradient is no tensor the recipe quantizes
    assert (f.layer, f.kind, f.tensor, f.step) == ("l3", "gradient non-finite", "l3/kernel", 0)
    assert "already non-finite in float32" in f.fix


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_planted_tiny_layer_is_named_by_mxfp8_not_by_bfloat16(backend, capsys):
    """l1's weights x 1e-36: its outputs (at most about 1e-36) are below 448 * 2**-127, so every
    MXFP8 block of them gets the E8M0 byte 0, which Transformer Engine leaves unscaled, and all
    of them round to 0 (in every framework: the byte is 0 whether or not the quotient
    ``amax / 448``, a float32 subnormal, is flushed). bfloat16 has float32's range: it keeps
    them (torch, which keeps float32 subnormals, may name l2's gradient there: products of
    them below bfloat16's smallest subnormal)."""
    require_backend(backend)
    argv = ["audit", "--backends", backend, "--steps", "1", "--plant", "l1=1e-36", "--json"]
    assert main([*argv, "--to", "mxfp8"]) == 0
    block = json.loads(capsys.readouterr().out)
    found = {(f["layer"], f["kind"]): f for f in block["findings"][backend]}
    assert found[("l1", "activation underflow")]["fraction"] == 1.0
    assert block["thresholds"]["underflow"] == 0.01 and block["scale"] == 1.0
    assert main([*argv, "--to", "bfloat16"]) == 0
    half = json.loads(capsys.readouterr().out)
    assert "l1" not in {f["layer"] for f in half["findings"][backend]}
    # the text: the thresholds stated, each finding with its share and threshold
    assert main([*argv[:-1], "--to", "mxfp8"]) == 0
    out = capsys.readouterr().out
    assert "thresholds: a tensor is named when more than 1.0% of its nonzero values would round to 0 in mxfp8" in out
    assert "  l1: activation underflow in l1 from step 0, 100.00% of its nonzero elements (named above 1.0%)" in out


@pytest.mark.slow  # three Keras worker processes
def test_the_planted_tiny_layer_is_named_on_every_keras_engine():
    """unimp's Keras train step takes ``stats_formats`` on each Keras backend (the compare
    worker passes the spec's step options): the same ``l1`` finding, all of it rounding to 0."""
    for name in ("tensorflow", "jax", "torch"):
        require_backend(name)
    from unimp.compare.run import CompareConfig, run_audit

    engines = ("keras-tensorflow", "keras-jax", "keras-torch")
    r = run_audit(CompareConfig(model="mlp", backends=engines), to="mxfp8", steps=1, plant="l1=1e-36")
    for engine in engines:
        (first, *_) = r["findings"][engine]
        assert (first["layer"], first["fraction"]) == ("l1", 1.0) and "l2" in first["downstream"], engine


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["audit", "--to", "mxfp9"], "choose one of float16, bfloat16, mxfp8, fp8-block, nvfp4, mxfp4"),
        (["audit", "--to", "fp8_block"], "choose one of float16, bfloat16, mxfp8, fp8-block, nvfp4, mxfp4"),
    ],
)
def test_a_bad_target_is_one_line_naming_the_choices(argv, needle, capsys):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
