"""A griffe extension for the documentation site (``extensions:`` in mkdocs.yml).

unimp's docstrings follow STYLE.md's Google style with an ``Example:`` section (singular, as
optax and Keras write it). griffe's Google parser knows only ``Examples:`` as the doctest
section and renders ``Example:`` as an admonition of Markdown text, where ``>>>`` lines run
together and a printed list reads as a link. This extension renames the heading before the
docstring is parsed, so each example renders as code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"(?m)^(\s*)Example:[ \t]*$")


class ExampleSections(griffe.Extension):
    """Reads a docstring's ``Example:`` heading as griffe's ``Examples:`` section."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:  # noqa: D102
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
