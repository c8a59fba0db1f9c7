"""The policy's ``matmul_precision`` on each framework's current API: every name sets the value
written in :data:`precision_kit.EXPECTED` (sources there), ``current_matmul_precision()`` says
which API and what it reads, everything reads as before after the block (also after an
exception), and unimp raises no warning doing it (torch 2.9 warns on its legacy
``allow_tf32`` / ``set_float32_matmul_precision``)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import numpy as np
import precision_kit
import pytest
from conftest import require_backend

from unimp.precision import MATMUL_PRECISION_TABLE, MATMUL_PRECISIONS

NAMES = list(MATMUL_PRECISIONS)


def _module(backend: str):
    return importlib.import_module(f"unimp.backends.{backend}")


@pytest.mark.parametrize("name", NAMES)
def test_each_name_sets_the_frameworks_current_api(backend, name):
    module = _module(backend)
    before = precision_kit.setting(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with module.matmul_precision(name):
            assert precision_kit.setting(backend) == precision_kit.expected(backend, name)
            current = module.current_matmul_precision()
    assert current == {"api": precision_kit.API[precision_kit.flavour(backend)], **precision_kit.expected(backend, name)}
    assert precision_kit.setting(backend) == before


@pytest.mark.parametrize("name", NAMES)
def test_restored_after_an_exception(backend, name):
    module = _module(backend)
    before = precision_kit.setting(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="boom"), module.matmul_precision(name):
            raise RuntimeError("boom")
    assert precision_kit.setting(backend) == before


def test_the_table_holds_the_written_values():
    # the one table the backends translate, against the values written out in precision_kit
    for name in NAMES:
        row = MATMUL_PRECISION_TABLE[name]
        assert dict(row.torch_fp32_precision) == precision_kit.EXPECTED["torch", name]
        legacy = precision_kit.EXPECTED["torch-legacy", name]
        assert (row.torch_matmul, row.torch_cudnn_tf32) == (legacy["matmul"], legacy["conv_tf32"])
        assert row.tensorflow_tf32 == precision_kit.EXPECTED["tensorflow", name]["tf32"]
        assert row.jax == precision_kit.EXPECTED["jax", name]["default_matmul_precision"]


# ------------------------------------------------------------------ torch only

_TORCH_TRANSLATION = textwrap.dedent(
    """
    import json, torch
    out = {}
    for name in ("highest", "high", "medium"):
        torch.set_float32_matmul_precision(name)
        out[name] = [torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision]
    for flag in (True, False):
        torch.backends.cudnn.allow_tf32 = flag
        out[str(flag)] = [torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.rnn.fp32_precision]
    print(json.dumps(out))
    """
)


def test_torch_switches_are_torchs_own_translation_of_its_names():
    """torch *torch only*: the matmul switches each name sets are those torch's legacy
    ``set_float32_matmul_precision(name)`` writes, and the cuDNN ones those
    ``cudnn.allow_tf32`` writes, except "ieee" for "highest" where ``allow_tf32 = False``
    writes "none" (inherit; a global ``torch.backends.fp32_precision = "tf32"`` would leak in).
    Run in a fresh process: the legacy calls change torch's hidden legacy state."""
    require_backend("torch")
    if not precision_kit.torch_has_fp32_precision():
        pytest.skip("torch < 2.9 has no fp32_precision switches")
    run = subprocess.run([sys.executable, "-c", _TORCH_TRANSLATION], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    torch_says = json.loads(run.stdout.splitlines()[-1])
    for name in NAMES:
        ours = precision_kit.EXPECTED["torch", name]
        assert [ours["cuda.matmul"], ours["mkldnn.matmul"]] == torch_says[name]
        tf32 = name != "highest"
        assert [ours["cudnn.conv"], ours["cudnn.rnn"]] == (torch_says["True"] if tf32 else ["ieee", "ieee"])
    assert torch_says["False"] == ["none", "none"]


@pytest.fixture
def torch_switches_restored():
    require_backend("torch")
    if not precision_kit.torch_has_fp32_precision():
        pytest.skip("torch < 2.9 has no fp32_precision switches")
    import torch

    names = ("", "cudnn", "mkldnn", *precision_kit.TORCH_SWITCHES)
    objects = [torch.backends if not n else precision_kit.torch_switch(n) for n in names]
    saved = [o.fp32_precision for o in objects]
    yield
    for o, v in zip(objects, saved, strict=True):
        o.fp32_precision = v


def test_torch_a_switch_that_inherited_inherits_again(torch_switches_restored):
    """torch *torch only*: a switch that read its parent's value before the block ("none":
    inherit) follows its parent again after it; one set explicitly keeps its value."""
    import torch

    from unimp.backends.torch import matmul_precision

    torch.backends.fp32_precision = "tf32"  # the global switch; cuda.matmul inherits it
    torch.backends.cudnn.conv.fp32_precision = "ieee"  # explicit, against the global
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with matmul_precision("highest"):
            assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        with matmul_precision("high"):
            assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.cudnn.conv.fp32_precision == "ieee"
    torch.backends.fp32_precision = "ieee"
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"  # still inherits
    assert torch.backends.cudnn.conv.fp32_precision == "ieee"


def test_torch_legacy_getter_reads_after_the_block(torch_switches_restored):
    """torch *torch only*: unimp writes no legacy state, so torch's legacy getters read after
    a block as before it (inside one that differs from the legacy state they raise: torch's
    "mix of the legacy and new APIs", the same as after a user's own new-API call)."""
    import torch

    from unimp.backends.torch import matmul_precision

    legacy = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    for name in NAMES:
        with matmul_precision(name):
            pass
        assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == legacy


def test_torch_ops_run_under_every_name():
    """torch *torch only*: a float32 matmul and a convolution run on the CPU under each name.
    A CPU has no TF32, so ``highest`` and ``high`` give the float32 result; ``medium`` sets
    oneDNN's matmul to ``"bf16"``, which a CPU with a bfloat16 unit (AVX512-BF16 / AMX) runs on
    bfloat16-rounded inputs and one without runs in float32: the product is one of the two,
    to float32 rounding, and nothing else."""
    require_backend("torch")
    import torch

    from unimp.backends.torch import matmul_precision

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 64, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    img = torch.randn(1, 3, 8, 8, generator=g)
    ref_mm = (x.double() @ x.double()).float()
    xb = x.bfloat16().double()
    ref_mm_bf16 = (xb @ xb).float()
    assert not torch.allclose(ref_mm, ref_mm_bf16, rtol=1e-5, atol=1e-4)  # the two are told apart
    ref_conv = torch.nn.functional.conv2d(img.double(), w.double()).float()

    def close(a: Any, b: Any) -> bool:
        return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-4))

    for name in NAMES:
        with matmul_precision(name):
            y = x @ x
            if name == "medium":
                assert close(y, ref_mm) or close(y, ref_mm_bf16), name
            else:
                torch.testing.assert_close(y, ref_mm, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(torch.nn.functional.conv2d(img, w), ref_conv, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ JAX only


@pytest.mark.parametrize("name", NAMES)
def test_jax_jitted_float32_matmul_runs_under_every_name(name):
    """JAX *JAX only*: a jitted float32 matmul and convolution run on this machine under each
    name (none of the names is a DotAlgorithmPreset a CPU refuses), and
    ``current_matmul_precision()`` inside says the API and the value."""
    require_backend("jax")
    import jax
    import jax.numpy as jnp

    from unimp.backends.jax import current_matmul_precision, matmul_precision

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 32)).astype(np.float32)
    img, ker = rng.normal(size=(1, 3, 8, 8)).astype(np.float32), rng.normal(size=(4, 3, 3, 3)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with matmul_precision(name):
            current = current_matmul_precision()
            y = jax.jit(lambda a: a @ a)(x)
            c = jax.jit(lambda a, k: jax.lax.conv(a, k, (1, 1), "SAME"))(img, ker)
    assert current == {"api": "default_matmul_precision", **precision_kit.EXPECTED["jax", name]}
    assert y.dtype == jnp.float32 and c.dtype == jnp.float32
    if jax.default_backend() == "cpu":  # every setting computes float32 on a CPU
        np.testing.assert_allclose(np.asarray(y), (x.astype(np.float64) @ x).astype(np.float32), rtol=1e-5, atol=1e-4)


def _lowered(fn, *args, precision: str) -> str:
    import jax

    with jax.default_matmul_precision(precision):
        return jax.jit(fn).lower(*args).as_text()


def test_jax_presets_are_no_drop_in_default():
    """JAX *JAX only*: why unimp sets ``lax.Precision`` names and not DotAlgorithmPresets
    (measured on JAX 0.10): as the default, a preset reaches dots of every dtype and casts
    their operands (a bfloat16 dot runs in float32 under F32_F32_F32, a float16 one rounds to
    bfloat16 under BF16_BF16_F32), convolutions lower with precision DEFAULT (the request
    does not reach them, where "float32" gives HIGHEST), and the TF32 presets fail on a CPU.
    If this starts failing, JAX changed: see whether a preset now maps a name more exactly."""
    require_backend("jax")
    import jax
    import jax.numpy as jnp

    bf16 = np.ones((4, 4), jnp.bfloat16)
    f16 = np.ones((4, 4), np.float16)
    img, ker = np.ones((1, 3, 8, 8), np.float32), np.ones((4, 3, 3, 3), np.float32)

    def conv(a, k):
        return jax.lax.conv(a, k, (1, 1), "SAME")

    def dot(a):
        return a @ a

    assert "convert" in _lowered(dot, bf16, precision="F32_F32_F32")
    assert "-> tensor<4x4xbf16>" in _lowered(dot, f16, precision="BF16_BF16_F32")
    assert "convert" not in _lowered(dot, bf16, precision="float32")
    assert "precision HIGHEST" in _lowered(conv, img, ker, precision="float32")
    assert "precision HIGHEST" not in _lowered(conv, img, ker, precision="F32_F32_F32")
    assert "precision DEFAULT" in _lowered(conv, img, ker, precision="F32_F32_F32")
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="not supported by dot_general on CPU"), jax.default_matmul_precision(
            "TF32_TF32_F32"
        ):
            jax.jit(dot)(np.ones((4, 4), np.float32))


def test_jax_a_users_preset_is_reported_and_restored():
    """JAX *JAX only*: a DotAlgorithmPreset a user set is what ``current_matmul_precision()``
    reports, and unimp's block puts it back."""
    require_backend("jax")
    import jax

    from unimp.backends.jax import current_matmul_precision, matmul_precision

    with jax.default_matmul_precision("BF16_BF16_F32_X3"):
        assert current_matmul_precision()["default_matmul_precision"] == "BF16_BF16_F32_X3"
        with matmul_precision("highest"):
            assert current_matmul_precision()["default_matmul_precision"] == "float32"
        assert current_matmul_precision()["default_matmul_precision"] == "BF16_BF16_F32_X3"


# ------------------------------------------------------------------ unimp info


def test_info_names_the_api_per_framework(backend, capsys):
    from unimp.cli import main

    assert main(["info", "--json"]) == 0
    rows = {row["backend"]: row for row in json.loads(capsys.readouterr().out)["backends"]}
    api = precision_kit.API[precision_kit.flavour(backend)]
    assert rows[backend]["matmul_precision"]["api"] == api
    assert main(["info"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "float32 matmul precision" in line]
    assert any(f"float32 matmul precision: {api}: " in line for line in lines)
