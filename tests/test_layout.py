"""The layout rules of unimp/: backends are packages of the same modules, files stay small,
imports have no cycle, the framework-free core imports no framework, and the package
``__init__`` files only re-export."""

from __future__ import annotations

import ast
import pathlib
import pickle

import pytest
from conftest import require_backend

from unimp.backends._base import BACKEND_MODULES, COMMON_API

UNIMP = pathlib.Path(__file__).resolve().parents[1] / "unimp"
BACKENDS = ("torch", "tensorflow", "jax")
CORE = ("dtypes", "policy", "precision", "loss_scale", "recipe", "registry", "step")
MAX_LINES = 600


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(UNIMP.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_imports(path: pathlib.Path) -> set[str]:
    """unimp modules imported at module level (not under ``if TYPE_CHECKING:``, not inside a
    function: those run after every module has loaded)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else ():
            if isinstance(sub, ast.ImportFrom) and sub.module and sub.module.startswith("unimp"):
                out.add(sub.module)
                out.update(f"{sub.module}.{a.name}" for a in sub.names)
            elif isinstance(sub, ast.Import):
                out.update(a.name for a in sub.names if a.name.startswith("unimp"))
    return out


ALL = {_module_name(p): p for p in UNIMP.rglob("*.py")}


@pytest.mark.parametrize("fw", BACKENDS)
def test_backend_packages_have_the_same_modules(fw):
    package = UNIMP / "backends" / fw
    # private helpers (_name.py) are one backend's implementation detail, not a shared concept
    modules = sorted(p.stem for p in package.glob("*.py") if not p.stem.startswith("_"))
    assert modules == sorted(BACKEND_MODULES)


@pytest.mark.parametrize("name", sorted(ALL))
def test_no_module_is_over_the_size_limit(name):
    lines = len(ALL[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by concept (limit {MAX_LINES})"


def test_no_import_cycle():
    graph = {
        name: {m for m in _runtime_imports(path) if m in ALL and m != name}
        for name, path in ALL.items()
    }
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            pytest.fail("import cycle: " + " -> ".join([*stack[stack.index(node):], node]))
        if node in done:
            return
        for dep in sorted(graph.get(node, ())):
            visit(dep, [*stack, node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])


@pytest.mark.parametrize("name", CORE)
def test_core_imports_no_framework(name):
    files = [UNIMP / f"{name}.py"] if (UNIMP / f"{name}.py").exists() else [*(UNIMP / name).glob("*.py")]
    assert files
    for path in files:
        tree = ast.parse(path.read_text())
        top = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        top |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not top & {"torch", "tensorflow", "keras", "jax", "jaxlib", "flax", "optax"}, path


@pytest.mark.parametrize("fw", BACKENDS)
def test_package_init_only_reexports(fw):
    tree = ast.parse((UNIMP / "backends" / fw / "__init__.py").read_text())
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert defined in ([], ["__getattr__"])  # __getattr__: moved private names for old pickles


@pytest.mark.parametrize("fw", BACKENDS)
def test_public_names_keep_the_package_path(fw):
    module = require_backend(fw)
    assert set(COMMON_API) <= set(module.__all__)
    for name in module.__all__:
        obj = getattr(module, name)
        if isinstance(obj, type) and obj.__module__.startswith("unimp.backends"):
            assert obj.__module__ == module.__name__, name
            assert pickle.loads(pickle.dumps(obj)) is obj


def test_test_modules_outside_packages_have_unique_basenames():
    """pytest imports a test file in a folder without ``__init__.py`` by its basename: two such
    files with one name stop the whole collection ("import file mismatch")."""
    tests = UNIMP.parent / "tests"
    seen: dict[str, pathlib.Path] = {}
    for path in sorted(tests.rglob("test_*.py")):
        if (path.parent / "__init__.py").exists():
            continue
        other = seen.setdefault(path.name, path)
        assert other == path, f"{other} and {path} share a basename; rename one"
