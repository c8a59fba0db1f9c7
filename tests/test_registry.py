import json
import subprocess
import sys

import pytest

import unimp
from unimp import registry


def test_list_backends():
    assert registry.list_backends()[:3] == ["torch", "tensorflow", "jax"]


@pytest.mark.parametrize(
    "alias,name",
    [
        ("pytorch", "torch"),
        ("tf", "tensorflow"),
        ("keras", "tensorflow"),
        ("flax", "jax"),
        ("TORCH", "torch"),
    ],
)
def test_aliases(alias, name):
    assert registry.backend_info(alias).name == name


@pytest.mark.parametrize(
    "bad,closest", [("pytroch", "pytorch"), ("tensorflw", "tensorflow"), ("jaxx", "jax")]
)
def test_unknown_backend_lists_valid_names(bad, closest):
    with pytest.raises(ValueError) as e:
        registry.get_backend(bad)
    msg = str(e.value)
    assert f"Did you mean '{closest}'" in msg and "torch" in msg and "aliases" in msg


def test_missing_framework_names_extra(monkeypatch):
    info = registry.BackendInfo(
        "fakefw", "unimp.backends.fakefw", ("no_such_framework_xyz",), (), "fakefw"
    )
    monkeypatch.setitem(registry._backends, "fakefw", info)
    with pytest.raises(ImportError, match=r'pip install "unimp\[fakefw\]"'):
        registry.get_backend("fakefw")
    assert "fakefw" not in registry.available_backends()


def test_register_backend_rejects_taken_alias():
    with pytest.raises(ValueError, match="already used"):
        registry.register_backend(
            registry.BackendInfo("mine", "x", (), (), "mine", aliases=("tf",))
        )


def test_mixed_precision_needs_backend():
    with pytest.raises(TypeError, match="backend="):
        unimp.mixed_precision("mixed_float16")


def test_import_unimp_imports_no_framework():
    code = (
        "import sys, json, unimp, unimp.cli, unimp.backends._base; unimp.available_backends(); "
        "unimp.get_recipe('mixed_float16'); "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch','tensorflow','jax','jaxlib','keras','flax','optax'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


class _FakeArray:
    pass


def test_detect_backend_without_import(monkeypatch):
    assert registry.detect_backend(1.0, [2, 3], {"a": "x"}) is None
    torch_like = type("Tensor", (), {"__module__": "torch"})()
    jax_like = type("ArrayImpl", (), {"__module__": "jaxlib.xla_extension"})()
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch", object()))
    monkeypatch.setitem(sys.modules, "jaxlib", sys.modules.get("jaxlib", object()))
    assert registry.detect_backend(torch_like, 3) == "torch"
    assert registry.detect_backend({"w": jax_like}) == "jax"
    with pytest.raises(TypeError, match="torch.*jax|jax.*torch"):
        registry.detect_backend([torch_like, jax_like])


def test_unknown_mixed_precision_option_lists_the_accepted(backend):
    with pytest.raises(TypeError, match=r"unknown mixed_precision option\(s\) \['grad_scale'\].*loss_scale=, cast_mode=, platform=, device="):
        unimp.mixed_precision("mixed_float16", backend=backend, grad_scale=3)


@pytest.mark.parametrize(
    "recipe, torch_mode, other_mode",
    [
        ("mixed_float16", "autocast", "module"),
        ("float16", "module", "module"),  # not mixed: no master weights to autocast around
        ("O2", "module", "module"),
        ("float32", "none", "none"),
        ("float32;head:float16", "autocast", "module"),  # autocast inside the overridden modules
    ],
)
def test_resolve_cast_mode_is_one_rule_for_every_backend(recipe, torch_mode, other_mode):
    from unimp import get_recipe

    r = get_recipe(recipe)
    assert registry.resolve_cast_mode(r, "torch") == torch_mode
    assert registry.resolve_cast_mode(r, "tensorflow") == registry.resolve_cast_mode(r, "jax") == other_mode


def test_keras_engine_names(monkeypatch, tmp_path):
    # keras-tensorflow is the tensorflow backend (Keras 3 on TensorFlow); Keras's other engines
    # bind to unimp.keras, and "keras" is Keras on the engine this process configures
    assert registry.backend_info("keras-tensorflow").name == "tensorflow"
    for name in ("keras-jax", "Keras-Torch"):
        assert registry.backend_info(name) is registry.KERAS
    monkeypatch.delitem(sys.modules, "keras", raising=False)  # read as Keras would, unimported
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    assert registry.keras_engine() == "tensorflow"  # Keras's default
    (tmp_path / "keras.json").write_text('{"backend": "torch"}')
    assert registry.keras_engine() == "torch"
    assert registry.backend_info("keras") is registry.KERAS
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")  # the variable wins over the file
    assert registry.backend_info("keras").name == "tensorflow"
    # a process running Keras on TensorFlow refuses the pinned other engines, naming the fix
    with pytest.raises(ValueError, match="KERAS_BACKEND=jax before Keras is imported"):
        registry.get_backend("keras-jax")
