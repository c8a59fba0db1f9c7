"""A griffe extension for the documentation site (``extensions:`` in mkdocs.yml).

unimp's docstrings are Google style as STYLE.md asks, with three habits of the Sphinx world that
griffe's Markdown rendering does not read:

* an ``Example:`` section (singular, as optax and Keras write it): griffe's Google parser knows
  only ``Examples:`` as the doctest section and renders ``Example:`` as an admonition of Markdown
  text, where ``>>>`` lines run together and a printed list reads as a link. The heading is
  renamed before the docstring is parsed, so each example renders as code;
* parameters documented together (``a, b: ...``), which griffe reads as one unknown
  parameter: written out one entry per parameter;
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
from typing import Any

import griffe


@functools.cache
def _pages() -> Any:
    """scripts/docs_pages.py (beside this file; not a package), where the rewriting lives."""
    path = pathlib.Path(__file__).with_name("docs_pages.py")
    spec = importlib.util.spec_from_file_location("_unimp_docs_pages", path)
    pages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pages)
    return pages


class ExampleSections(griffe.Extension):
    """Reads ``Example:`` as griffe's ``Examples:`` section, grouped parameters one by one, and
    Sphinx roles as links or code (``docs_pages.docstring_to_markdown``)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:  # noqa: D102
        if obj.docstring is not None:
            module = obj.path if obj.is_module else obj.module.path
            obj.docstring.value = _pages().docstring_to_markdown(obj.docstring.value, module)
