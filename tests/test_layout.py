"""The layout rules of unimp/: backends are packages of the same modules, imports have no cycle
(wherever they stand), no package imports another's private names, backends import only the
core, the framework-free core imports no framework, and the package ``__init__`` files only
re-export."""

from __future__ import annotations

import ast
import pathlib
import pickle

import pytest
from conftest import require_backend

from unimp.backends._base import BACKEND_MODULES, COMMON_API

UNIMP = pathlib.Path(__file__).resolve().parents[1] / "unimp"
BACKENDS = ("torch", "tensorflow", "jax")
CORE = ("attached", "blockscale", "blockscale_linear", "blockscale_presets", "blockscale_recipe", "dtypes", "policy", "precision", "loss_scale", "recipe", "registry", "step")


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(UNIMP.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> list[tuple[str, tuple[str, ...]]]:
    """Every unimp import of a module, wherever it stands (module level, inside a function,
    under ``if TYPE_CHECKING:``) and ``importlib.import_module("unimp...")`` with a literal
    name: ``(module, names)`` pairs, relative imports resolved."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            if module.split(".")[0] == "unimp":
                out.append((module, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Import):
            out += [(a.name, ()) for a in node.names if a.name.split(".")[0] == "unimp"]
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("unimp.")
        ):
            out.append((node.args[0].value, ()))
    return out


def _imported_modules(path: pathlib.Path) -> set[str]:
    """The unimp modules ``path`` imports (``from pkg import module`` names the module)."""
    out: set[str] = set()
    for module, names in _imports(path):
        for n in names or ("",):
            full = f"{module}.{n}" if n else module
            while full not in ALL and "." in full:
                full = full.rpartition(".")[0]
            out.add(full)
    return out


def _package(name: str) -> str:
    return name if ALL[name].name == "__init__.py" else name.rpartition(".")[0]


ALL = {_module_name(p): p for p in UNIMP.rglob("*.py")}


@pytest.mark.parametrize("fw", BACKENDS)
def test_backend_packages_have_the_same_modules(fw):
    package = UNIMP / "backends" / fw
    # private helpers (_name.py) are one backend's implementation detail, not a shared concept
    modules = sorted(p.stem for p in package.glob("*.py") if not p.stem.startswith("_"))
    assert modules == sorted(BACKEND_MODULES)


def test_no_import_cycle():
    """Not even through a function-level or a type-checking import: a cycle there is two
    modules that each need the other, whenever the import runs."""
    graph = {
        name: {m for m in _imported_modules(path) if m in ALL and m != name}
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


def test_no_private_name_is_imported_across_packages():
    """A ``_name`` is its package's own: another package reaches only public names."""
    found = []
    for name, path in sorted(ALL.items()):
        for module, names in _imports(path):
            source = module if module in ALL and ALL[module].name == "__init__.py" else module.rpartition(".")[0]
            private = [n for n in names if n.startswith("_") and not n.startswith("__") and f"{module}.{n}" not in ALL]
            if private and source != _package(name):
                found.append(f"{name} imports {', '.join(private)} from {module}")
    assert not found, "\n".join(found)


#: What a backend never imports: the engine helpers, the porting shims, the user's commands, and
#: the other backends (each translates the core alone).
NOT_FOR_BACKENDS = ("unimp.distributed", "unimp.compat", "unimp.compare", "unimp.cli", "unimp.doctor")


@pytest.mark.parametrize("fw", BACKENDS)
def test_backends_import_only_the_core(fw):
    own = f"unimp.backends.{fw}"
    others = tuple(f"unimp.backends.{b}" for b in BACKENDS if b != fw)
    found = sorted(
        f"{name} imports {m}"
        for name, path in ALL.items() if name == own or name.startswith(own + ".")
        for m in _imported_modules(path)
        if m.startswith(NOT_FOR_BACKENDS + others)
    )
    assert not found, "\n".join(found)


def test_no_module_stamps_an_attribute_of_its_own_on_users_objects():
    """unimp's facts about a user's object live under its one attribute (unimp.attached)."""
    import re

    stamp = re.compile(r"""\._unimp_\w+|["']_unimp_\w+["']""")
    found = sorted(f"{name}: {m}" for name, path in ALL.items() for m in stamp.findall(path.read_text()))
    assert not found, "\n".join(found)


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
    assert defined == []


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


#: Each backend's loss scaler: (module, class). The train step and every other module reach it
#: through its public face only (issue 26: "each scaler behind its public face").
SCALERS = (
    ("unimp.backends.torch.scaling", "GradScaler"),
    ("unimp.backends.tensorflow.optimizer", "LossScaleOptimizer"),
)


def _own_private_names(path: pathlib.Path, cls: str | None) -> set[str]:
    """The ``_names`` class ``cls`` of ``path`` defines (every class but the scalers' with
    None): its methods and the attributes it assigns on ``self`` (dunders aside)."""
    tree = ast.parse(path.read_text())
    scalers = {c for m, c in SCALERS if ALL[m] == path}
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    if cls is not None:
        return _class_private_names(next(n for n in classes if n.name == cls))
    return set().union(*(_class_private_names(n) for n in classes if n.name not in scalers))


def _class_private_names(body: ast.ClassDef) -> set[str]:
    names = {n.name for n in body.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(body):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


@pytest.mark.parametrize(("module", "cls"), SCALERS, ids=[c for _, c in SCALERS])
def test_other_modules_reach_a_scaler_through_its_public_face(module, cls):
    """No other module reads or writes a private attribute or method of unimp's scaler on an
    object (``scaler._scale``, ``opt._adopt(...)``); its own module and subclasses' ``self`` may."""
    # a name another class of unimp defines too (a train step's own _step) is not the scaler's
    others = set().union(*(_own_private_names(p, None) for p in ALL.values()))
    private = _own_private_names(ALL[module], cls) - others
    assert len(private) > 5  # the rule has something to check
    found = []
    for name, path in sorted(ALL.items()):
        if name == module:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private:
                owner = node.value
                if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                    found.append(f"{name}:{node.lineno} .{node.attr}")
    assert not found, "\n".join(found)
