"""The documentation site's generated pages cover the public API (no MkDocs build here: CI's
``mkdocs build --strict`` in .ci/run does that; these checks take a second)."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _load_generator():
    spec = importlib.util.spec_from_file_location("docs_pages", ROOT / "scripts" / "docs_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()
PACKAGES = [pkg for pkg, _, _ in gen.API_PACKAGES]
MKDOCS_YML = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def test_every_public_package_has_an_api_page():
    assert set(PACKAGES) >= {
        "unimp", "unimp.backends.torch", "unimp.backends.tensorflow", "unimp.backends.jax",
        "unimp.keras", "unimp.loss_scale", "unimp.fp8", "unimp.blockscale",
    }


@pytest.mark.parametrize("package", PACKAGES)
def test_every_name_of_all_is_on_the_api_page(package):
    pages = gen.api_pages()
    path = next(p for pkg, p, _ in gen.API_PACKAGES if pkg == package)
    documented = set(re.findall(rf"(?m)^::: {re.escape(package)}\.(\w+)$", pages[path]))
    names = gen.static_all(package)
    assert names, package
    assert set(names) - documented == set(), f"{package}: names missing from {path}"
    assert documented - set(names) == set(), f"{path} documents names not in {package}.__all__"
    assert f"reference/api/{pathlib.PurePosixPath(path).name}" in MKDOCS_YML, f"{path} not in nav"


@pytest.mark.parametrize("package", ["unimp", "unimp.loss_scale", "unimp.fp8", "unimp.blockscale"])
def test_the_static_all_is_the_runtime_all(package):
    # the framework-free packages import in a moment; the backends' would import the frameworks
    assert gen.static_all(package) == list(importlib.import_module(package).__all__)


def test_cli_page_has_every_subcommand():
    import argparse

    from unimp.cli import build_parser

    page = gen.cli_page()
    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in subs.choices:
        assert f"## `unimp {name}`" in page


def _pages() -> list[pathlib.Path]:
    return sorted(DOCS.rglob("*.md"))


def test_every_table_marker_names_a_table():
    for page in _pages():
        for name in re.findall(r"<!-- gen:([a-z0-9-]+) -->", page.read_text(encoding="utf-8")):
            assert name in gen.TABLES, f"{page}: unknown table {name!r}"
    for name, build in gen.TABLES.items():
        assert build().count("\n") >= 2, name


def test_every_included_file_exists():
    # pymdownx.snippets' base paths in mkdocs.yml: the examples and the commands' outputs
    bases = [ROOT / "examples", DOCS / "outputs"]
    for page in _pages():
        for include in re.findall(r'--8<-- "([^"]+)"', page.read_text(encoding="utf-8")):
            assert any((b / include).is_file() for b in bases), f"{page}: no {include} in {bases}"


def test_every_page_is_in_the_nav():
    for page in _pages():
        rel = page.relative_to(DOCS).as_posix()
        assert re.search(rf"(^|[\s:]){re.escape(rel)}$", MKDOCS_YML, re.M), f"{rel} not in nav"


def test_grouped_parameters_are_written_one_by_one():
    doc = (
        "Summary.\n\nArgs:\n    model: a model.\n    gradients, activations: ``{name: x}`` as\n"
        "        from_arrays takes them.\n    grad_accum_steps, max_grad_norm,\n"
        "        rounding_seed: the options.\n    order: last.\n\nReturns:\n    a, b: a pair.\n"
    )
    assert gen.split_grouped_parameters(doc) == (
        "Summary.\n\nArgs:\n    model: a model.\n    gradients: ``{name: x}`` as\n"
        "        from_arrays takes them.\n    activations: as ``gradients``.\n"
        "    grad_accum_steps: the options.\n    max_grad_norm: as ``grad_accum_steps``.\n"
        "    rounding_seed: as ``grad_accum_steps``.\n    order: last.\n\nReturns:\n    a, b: a pair.\n"
    )


@pytest.mark.parametrize(
    "role,module,expected",
    [
        (":class:`GradScaler`", "unimp.backends.torch.scaling",
         "[`GradScaler`][unimp.backends.torch.GradScaler]"),
        (":func:`~unimp.loss_scale.update_arrays`", "unimp.recipe",
         "[`update_arrays`][unimp.loss_scale.update_arrays]"),
        (":meth:`TensorStats.from_arrays`", "unimp.stats",
         "[`TensorStats.from_arrays`][unimp.TensorStats]"),
        (":mod:`unimp.fp8`", "unimp.recipe", "[`unimp.fp8`][unimp.fp8]"),
        # not public, or not on an API page: code, never a dangling link
        (":data:`unimp.backends._base.BACKEND_MODULES`", "unimp.backends.torch",
         "`unimp.backends._base.BACKEND_MODULES`"),
        (":mod:`unimp.stats`", "unimp", "`unimp.stats`"),
    ],
)
def test_sphinx_roles_become_links_to_public_names_or_code(role, module, expected):
    assert gen.docstring_to_markdown(role, module) == expected


def test_example_sections_are_read_as_doctests():
    assert gen.docstring_to_markdown("A.\n\n    Example:\n        >>> 1\n        1\n", "unimp") == (
        "A.\n\n    Examples:\n        >>> 1\n        1\n"
    )


def test_rst_simple_tables_and_literal_markers_become_markdown():
    doc = (
        "Table:\n\n=====  =====\nname   value\n=====  =====\n``a``  1\n``b``  two words\n"
        "=====  =====\n\nCode::\n\n    x = 1\n"
    )
    assert gen.docstring_to_markdown(doc, "unimp") == (
        "Table:\n\n| name | value |\n|---|---|\n| ``a`` | 1 |\n| ``b`` | two words |\n\n"
        "Code:\n\n    x = 1\n"
    )


def _python_blocks(path: pathlib.Path) -> list[str]:
    """The ```python blocks of a Markdown file (tabs' indented ones too), without the includes."""
    text = path.read_text(encoding="utf-8")
    blocks = re.findall(r"(?ms)^([ \t]*)```python\n(.*?)^\1```", text)
    sources = ["\n".join(line[len(indent):] for line in b.splitlines()) for indent, b in blocks]
    return [s for s in sources if "--8<--" not in s]


def _module_source(module: str) -> str | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path.read_text(encoding="utf-8")
    return None


def _unimp_references(source: str) -> list[str]:
    """What a snippet asks of unimp that does not exist: modules, imported names, ``unimp.X``."""
    import ast

    problems = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "unimp":
            text = _module_source(node.module)
            if text is None:
                problems.append(f"no module {node.module}")
                continue
            for alias in node.names:
                if node.module in PACKAGES:  # a public package: its __all__
                    if alias.name not in gen.static_all(node.module):
                        problems.append(f"{alias.name} is not in {node.module}.__all__")
                elif _module_source(f"{node.module}.{alias.name}") is None and not re.search(
                    rf"(?m)^\s*(def |class )?{alias.name}\b|\b{alias.name}\b.*import|import.*\b{alias.name}\b",
                    text,
                ):
                    problems.append(f"{node.module} has no {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "unimp" and _module_source(alias.name) is None:
                    problems.append(f"no module {alias.name}")
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "unimp"):
            if node.attr not in gen.static_all("unimp") and _module_source(f"unimp.{node.attr}") is None:
                problems.append(f"unimp.{node.attr} is not public")
    return problems


@pytest.mark.parametrize(
    "page", ["README.md", *(p.relative_to(ROOT).as_posix() for p in _pages())]
)
def test_python_snippets_parse_and_name_what_exists(page):
    # the README's and the pages' snippets use a user's model and data, so they are not run;
    # they must parse, and every unimp module, name and unimp.X they use must exist
    for source in _python_blocks(ROOT / page):
        assert _unimp_references(source) == [], f"{page}:\n{source}"
