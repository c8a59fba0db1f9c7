"""Per-layer overrides of a :class:`~unimp.Policy`: the one matching rule every backend translates.

Framework-free. A policy's ``overrides`` give some layers (torch modules, Keras layers, flax
modules, parameter-tree paths) another policy than the model's. This module holds the rule:

* **Paths** are dotted: ``"l2"``, ``"blocks.0.attn.q"``, ``"l2.weight"``. Each backend writes its
  names this way (torch ``named_modules`` / ``named_parameters`` names as they are; Keras layer
  paths below the model with ``/`` read as ``.``; JAX pytree key paths joined by ``.``).
* **Patterns** are :mod:`fnmatch` globs, case-sensitive: ``*`` (any run of characters, dots
  included), ``?`` (one character), ``[seq]`` / ``[!seq]``. A pattern matches a path when it
  matches the whole path or a prefix of it that ends at a dot: ``"head"`` covers ``"head"``,
  ``"head.weight"`` and ``"head.bias"`` but not ``"header"``; ``"blocks.*.attn"`` covers
  ``"blocks.3.attn.q.weight"``; ``"*norm*"`` covers every path with ``norm`` in it. A ``/`` in
  a pattern is read as ``.``, so the layer names ``unimp trace`` prints (``"head/0"``) work too.
* **No precedence**: a path takes the value of every pattern that matches it, so patterns that
  match the same path must agree. Two that give it different policies are a conflict, a
  ``ValueError`` naming both patterns and the path, raised when the overrides are applied to a
  model's paths (:func:`resolve_overrides`), before any training. Overlapping globs cannot be
  told apart from the patterns alone, so the check needs the paths; nested overrides
  (``"blocks"`` and ``"blocks.0.attn"`` with different values) are therefore refused, never
  silently ordered.
* **Values** are a :class:`~unimp.Policy`, a string with ``=`` in jmp's grammar
  (``"params=float32,compute=bfloat16,output=float32"``), a named policy (``"mixed_bfloat16"``,
  ``"bf16-mixed"``), or a dtype. A **dtype** ``d`` (any spelling
  :func:`unimp.dtypes.canonical_dtype` accepts: ``"float32"``, ``"f32"``, ``"bf16"``,
  ``"fp16"``; these win over the named policies of the same spelling) means: the layer computes
  and returns ``d``, its parameters stay in the model's param dtype, i.e.
  ``Policy(parent.param_dtype, d, d)``, as a Keras layer given ``dtype="float32"`` inside a
  ``mixed_float16`` model, or torch's guidance to run a region with ``autocast(enabled=False)``
  and cast its inputs to float32.
* **Unmatched patterns** warn (:class:`OverrideWarning`) naming the pattern and the nearest
  paths (:func:`difflib.get_close_matches`): a typo must not silently leave a layer in half.

:mod:`unimp.policy` stores the normalised overrides; the backends call :func:`resolve_overrides`
on their model's paths and map each matched layer to their own mechanism.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

#: A layer's policy (:class:`unimp.Policy`): the matching rule here is generic over it, so this
#: module imports no policy (the policy module imports it).
P = TypeVar("P")

__all__ = [
    "OverrideWarning",
    "check_pattern",
    "match_overrides",
    "normalize_overrides",
    "pattern_matches",
    "resolve_overrides",
    "top_paths",
]

#: characters a pattern may not hold: they separate clauses in ``str(policy)``.
_RESERVED = ";:,= \t\n"


class OverrideWarning(UserWarning):
    """An override pattern matched none of the model's layer or parameter paths."""


def check_pattern(pattern: Any, field: str = "Policy.overrides") -> str:
    """Validates one override pattern and returns it, ``/`` read as ``.`` (so the layer names
    ``unimp trace`` prints, ``"head/0"``, and Keras's ``layer.path`` work as patterns).
    ``field`` names the option in the messages (``FP8Recipe.exclude`` takes the same patterns).

    Raises:
        TypeError: not a string.
        ValueError: empty, or holds whitespace or one of ``; : , =`` (they separate the clauses
            of ``str(policy)``).
    """
    if not isinstance(pattern, str):
        raise TypeError(
            f"{field}: a pattern must be a str like 'head' or '*norm*', got "
            f"{type(pattern).__name__}."
        )
    bad = sorted({c for c in pattern if c in _RESERVED})
    if not pattern or bad:
        raise ValueError(
            f"{field}: pattern {pattern!r} must be a non-empty glob over dotted paths "
            f"without whitespace or ';', ':', ',', '=' (found {bad or 'nothing'}); e.g. 'head', "
            "'*norm*', 'blocks.*.attn'."
        )
    return pattern.replace("/", ".")


def normalize_overrides(
    overrides: Any, value_policy: Callable[[str, Any], P]
) -> tuple[tuple[str, P], ...]:
    """The canonical, hashable form of ``Policy(overrides=...)``.

    Args:
        overrides: a mapping ``{pattern: value}`` or an iterable of ``(pattern, value)`` pairs
            (the stored form), or ``None``; values as in this module's docstring.
        value_policy: ``(pattern, value) -> Policy``, the checked policy of one value
            (:class:`~unimp.Policy` passes its own, so this module imports no policy).

    Returns:
        ``((pattern, Policy), ...)`` sorted by pattern, so equal contents are equal policies
        whatever order they were written in.

    Raises:
        TypeError: not a mapping / pairs, or a bad pattern or value type.
        ValueError: a bad pattern, a pattern given twice, an unknown dtype or policy name (the
            message names the pattern and lists the valid names), or a nested override.
    """
    if overrides is None:
        return ()
    if isinstance(overrides, Mapping):
        items = list(overrides.items())
    elif isinstance(overrides, Iterable) and not isinstance(overrides, (str, bytes)):
        items = []
        for pair in overrides:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise TypeError(
                    f"Policy.overrides: expected {{pattern: policy_or_dtype}} or (pattern, value) "
                    f"pairs, got the item {pair!r}."
                )
            items.append(tuple(pair))
    else:
        raise TypeError(
            f"Policy.overrides must be a dict {{pattern: policy_or_dtype}}, got "
            f"{type(overrides).__name__}."
        )
    out: dict[str, P] = {}
    for pattern, value in items:
        pattern = check_pattern(pattern)
        if pattern in out:
            raise ValueError(f"Policy.overrides: pattern {pattern!r} is given twice.")
        out[pattern] = value_policy(pattern, value)
    return tuple(sorted(out.items()))


def pattern_matches(pattern: str, path: str) -> bool:
    """Whether ``pattern`` covers ``path``: it matches the whole path or a prefix ending at a dot.

    Example:
        >>> pattern_matches("head", "head.weight"), pattern_matches("head", "header")
        (True, False)
        >>> pattern_matches("blocks.*.attn", "blocks.0.attn.q.bias")
        True
    """
    if fnmatch.fnmatchcase(path, pattern):
        return True
    parts = path.split(".")
    return any(
        fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts))
    )


def match_overrides(
    overrides: Iterable[tuple[str, P]], path: str
) -> tuple[str, P] | None:
    """The override that covers ``path``: ``(pattern, policy)``, or ``None`` when none does.

    The rule of this module: every matching pattern must give the same policy; the first
    (by pattern order) is returned. Reusable beyond dtypes (e.g. keeping layers out of FP8).

    Raises:
        ValueError: two patterns cover ``path`` with different policies (names both).
    """
    found: tuple[str, P] | None = None
    for pattern, policy in overrides:
        if not pattern_matches(pattern, path):
            continue
        if found is None:
            found = (pattern, policy)
        elif found[1] != policy:
            raise ValueError(
                f"Policy.overrides conflict at {path!r}: pattern {found[0]!r} gives {found[1]} "
                f"but pattern {pattern!r} gives {policy}; make the patterns disjoint or give "
                "them the same value."
            )
    return found


def resolve_overrides(
    overrides: Iterable[tuple[str, P]], paths: Iterable[str], *, what: str = "layer"
) -> dict[str, P]:
    """Applies overrides to a model's paths: ``{path: policy}`` for every covered path.

    Checks everything before returning, so a backend can validate a model before changing it.

    Args:
        overrides: ``policy.overrides``.
        paths: the model's dotted paths, in model order.
        what: ``"layer"``, ``"module"`` or ``"parameter"``, for the messages.

    Returns:
        The covered paths (model order) and their override policies.

    Raises:
        ValueError: a conflict (see :func:`match_overrides`).

    Warns:
        OverrideWarning: a pattern covers none of ``paths``; names it and the nearest paths.
    """
    overrides = tuple(overrides)
    paths = list(dict.fromkeys(paths))
    out: dict[str, P] = {}
    used: set[str] = set()
    for path in paths:
        hit = match_overrides(overrides, path)
        if hit is not None:
            out[path] = hit[1]
            used.update(p for p, _ in overrides if pattern_matches(p, path))
    # the paths and their dotted prefixes: "l3" is nearest to the layer "l2", not "l2.w"
    names = list(dict.fromkeys(
        ".".join(path.split(".")[:i]) for path in paths for i in range(1, path.count(".") + 2)
    ))
    for pattern, _ in overrides:
        if pattern in used:
            continue
        near = difflib.get_close_matches(pattern, names, n=3, cutoff=0.3)
        hint = (
            f"did you mean {', '.join(repr(p) for p in near)}?" if near
            else f"the model's paths begin {', '.join(repr(p) for p in names[:8]) or '(none)'}."
        )
        warnings.warn(
            f"Policy.overrides: pattern {pattern!r} matches no {what} path of the model; {hint} "
            "Patterns are fnmatch globs over dotted paths ('head', '*norm*', 'blocks.*.attn').",
            OverrideWarning,
            stacklevel=_caller_level(),
        )
    return out


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside unimp, so a warning names the user's line."""
    root = os.path.dirname(os.path.abspath(__file__)) + os.sep
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root):
        level += 1
        frame = frame.f_back
    return level


def top_paths(resolved: Mapping[str, P]) -> dict[str, P]:
    """The outermost covered paths: those whose dotted parents are not covered with the same
    policy. A backend applies an override once there (a torch module and not again its
    submodules)."""
    out: dict[str, P] = {}
    for path, policy in resolved.items():
        parts = path.split(".")
        parents = (".".join(parts[:i]) for i in range(1, len(parts)))
        if not any(resolved.get(p) == policy for p in parents):
            out[path] = policy
    return out
