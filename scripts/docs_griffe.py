"""A griffe extension for the documentation site (``extensions:`` in mkdocs.yml).

unimp's docstrings are Google style as STYLE.md asks, with two habits of the Sphinx world that
griffe's Markdown rendering does not read:

* an ``Example:`` section (singular, as optax and Keras write it): griffe's Google parser knows
  only ``Examples:`` as the doctest section and renders ``Example:`` as an admonition of Markdown
  text, where ``>>>`` lines run together and a printed list reads as a link. The heading is
  renamed before the docstring is parsed, so each example renders as code;
* Sphinx roles (``:class:`GradScaler```, ``:func:`~unimp.loss_scale.update_arrays```): each
  becomes a link to its entry on an API page when the name is one of the documented public
  names (resolved as Python would from the docstring's module outwards: ``GradScaler`` in
  ``unimp.backends.torch.scaling`` is ``unimp.backends.torch.GradScaler``), and inline code
  otherwise, so no link is left unresolved and the strict build stays quiet.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"(?m)^(\s*)Example:[ \t]*$")
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|exc|obj|const):`(~?)([\w.]+)(?:\(\))?`")


@functools.cache
def _pages() -> Any:
    path = pathlib.Path(__file__).with_name("docs_pages.py")
    spec = importlib.util.spec_from_file_location("_unimp_docs_pages", path)
    pages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pages)
    return pages


@functools.cache
def packages() -> frozenset[str]:
    """The packages with an API page (each page's title is its anchor)."""
    return frozenset(package for package, _, _ in _pages().API_PACKAGES)


@functools.cache
def documented() -> frozenset[str]:
    """Every name the generated API pages document, as its anchor ``package.name``."""
    return frozenset(f"{p}.{name}" for p in packages() for name in _pages().static_all(p))


def resolve(target: str, module: str) -> tuple[str, str] | None:
    """The documented anchor ``target`` names from ``module``, and the part of it that does
    (``GradScaler.update`` links to ``...GradScaler``); None when it names no documented one."""
    parts = target.split(".")
    scopes = module.split(".")
    bases = [""] + [".".join(scopes[:i]) + "." for i in range(len(scopes), 0, -1)]
    if target in packages():
        return target, target
    for base in ([""] if target.startswith("unimp") else bases):
        for n in range(len(parts), 0, -1):  # a member's name links to its class or module entry
            anchor = base + ".".join(parts[:n])
            if anchor in documented():
                return anchor, ".".join(parts[:n])
    return None


def _role(match: re.Match[str], module: str) -> str:
    short, target = match.group(1), match.group(2)
    text = target.rsplit(".", 1)[-1] if short else target
    found = resolve(target, module)
    return f"[`{text}`][{found[0]}]" if found else f"`{text}`"


class ExampleSections(griffe.Extension):
    """Reads ``Example:`` as griffe's ``Examples:`` section and Sphinx roles as links or code."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:  # noqa: D102
        if obj.docstring is None:
            return
        module = obj.path if obj.is_module else obj.module.path
        value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
        obj.docstring.value = _ROLE.sub(lambda m: _role(m, module), value)
