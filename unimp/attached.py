"""unimp's state on a user's object, in one attribute.

``mp.prepare`` and the train steps remember a few facts about the user's model, optimizer and
layers (prepared already, the master weights, the float8 scaling of a swapped layer, ...). They
keep them in one unimp-owned namespace under one attribute, :data:`ATTRIBUTE` (``_unimp``),
never in attributes of their own on the user's object: a user's ``vars(model)`` shows one name,
and a copy of the object (``copy.deepcopy``, pickle, ``torch.save``) carries unimp's facts with
it as it carries any attribute. What each backend keeps there is named where it is set.

Example:
    >>> class Model: ...
    >>> m = Model()
    >>> peek(m, "prepared", False)
    False
    >>> attach(m).prepared = True
    >>> peek(m, "prepared", False), [n for n in vars(m)]
    (True, ['_unimp'])
"""

from __future__ import annotations

import types
from typing import Any

__all__ = ["ATTRIBUTE", "Attached", "attach", "check_attachable", "peek"]

#: The one attribute unimp sets on a user's object.
ATTRIBUTE = "_unimp"

_MISSING = object()


class Attached(types.SimpleNamespace):
    """unimp's facts about one user object (its own class, so a user's namespace under the
    same name is never taken for unimp's)."""


def check_attachable(obj: Any) -> None:
    """Raises what :func:`attach` would, without setting anything: ``prepare`` checks the
    user's objects first, so a refusal leaves them as they were.

    Raises:
        TypeError: ``obj`` has an attribute ``_unimp`` of its own (rename it), or takes no
            attributes (a builtin, a ``__slots__`` class without ``__dict__``).
    """
    ns = getattr(obj, ATTRIBUTE, _MISSING)
    if isinstance(ns, Attached):
        return
    if ns is not _MISSING:
        raise TypeError(
            f"the {type(obj).__name__} has an attribute {ATTRIBUTE!r} of its own (a "
            f"{type(ns).__name__}), where unimp keeps its state on the objects it prepares; "
            "rename that attribute."
        )
    if not hasattr(obj, "__dict__"):
        raise TypeError(
            f"unimp keeps its state on the {type(obj).__name__} in an attribute "
            f"{ATTRIBUTE!r}, which the object refuses; pass an object that takes attributes."
        )


def attach(obj: Any) -> Attached:
    """unimp's namespace on ``obj``, made (and set as ``obj._unimp``) on first use.

    Raises:
        TypeError: as :func:`check_attachable`.
    """
    ns = getattr(obj, ATTRIBUTE, None)
    if isinstance(ns, Attached):
        return ns
    check_attachable(obj)
    ns = Attached()
    try:
        setattr(obj, ATTRIBUTE, ns)
    except (AttributeError, TypeError):
        raise TypeError(
            f"unimp keeps its state on the {type(obj).__name__} in an attribute "
            f"{ATTRIBUTE!r}, which the object refuses; pass an object that takes attributes."
        ) from None
    return ns


def peek(obj: Any, name: str, default: Any = None) -> Any:
    """``obj._unimp.<name>``, or ``default`` where ``obj`` holds no such fact (nothing is set)."""
    ns = getattr(obj, ATTRIBUTE, None)
    return getattr(ns, name, default) if isinstance(ns, Attached) else default
