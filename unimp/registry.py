"""The one list of backends: lookup by name and alias, lazy import, entry-point plug-ins.

Framework-free: finding out whether a framework is installed uses ``importlib.util.find_spec``
and package metadata, never an import of the framework.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import importlib.util
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = [
    "BackendInfo",
    "available_backends",
    "backend_info",
    "cast_mode_refusal",
    "detect_backend",
    "framework_versions",
    "get_backend",
    "keras_engine",
    "list_backends",
    "mixed_precision",
    "register_backend",
    "resolve_cast_mode",
]

ENTRY_POINT_GROUP = "unimp.backends"


@dataclass(frozen=True)
class BackendInfo:
    """What unimp knows about a backend without importing it.

    Attributes:
        name: canonical name (``torch``, ``tensorflow``, ``jax``).
        module: the module implementing it (imported on first use).
        requires: top-level packages that must be importable.
        distributions: pip distributions whose version ``unimp info`` reports.
        extra: the ``pip install "unimp[extra]"`` that installs it.
        aliases: other names accepted for it.
        array_modules: top-level modules whose array types belong to this backend.
        cast_modes: the :data:`unimp.recipe.CAST_MODES` the framework runs, ``"auto"`` aside
            (it picks the first): torch has autocast and module casting; Keras's dtype
            policies and JAX's jmp-style policies cast at layer / function boundaries, which is
            ``"module"``. The one table: ``MixedPrecision`` and ``unimp explain`` read it.
    """

    name: str
    module: str
    requires: tuple[str, ...]
    distributions: tuple[str, ...]
    extra: str
    aliases: tuple[str, ...] = ()
    array_modules: tuple[str, ...] = ()
    cast_modes: tuple[str, ...] = ("module",)


_BUILTIN = (
    BackendInfo(
        "torch", "unimp.backends.torch", ("torch",), ("torch",), "torch", ("pytorch",), ("torch",),
        ("autocast", "module"),
    ),
    BackendInfo(
        "tensorflow",
        "unimp.backends.tensorflow",
        ("tensorflow", "keras"),
        ("tensorflow", "tensorflow-cpu", "keras"),
        "tensorflow",
        ("tf", "keras-tensorflow"),
        ("tensorflow", "keras"),
    ),
    BackendInfo(
        "jax",
        "unimp.backends.jax",
        ("jax", "optax"),
        ("jax", "jaxlib", "flax", "optax"),
        "jax",
        ("flax",),
        ("jax", "jaxlib"),
    ),
)

#: Keras on JAX or torch: :mod:`unimp.keras` binds a recipe there. Not one of the backends
#: above: Keras's engine is fixed per process, so the in-process suite (and ``list_backends``)
#: has the TensorFlow backend for Keras, and the other engines run in a worker each
#: (tests/test_keras_backends.py, ``unimp compare --backends keras-jax``). ``keras`` names
#: Keras on the engine this process configures (:func:`keras_engine`): the TensorFlow backend
#: for TensorFlow, this one for JAX and torch.
KERAS = BackendInfo(
    "keras", "unimp.keras", ("keras",), ("keras",), "keras-jax", ("keras-jax", "keras-torch"),
    ("keras",),
)
#: the Keras engines :data:`KERAS` runs, by the name that pins each
KERAS_PINNED = {"keras-jax": "jax", "keras-torch": "torch"}

_lock = threading.RLock()
_backends: dict[str, BackendInfo] = {b.name: b for b in _BUILTIN}
_loaded: dict[str, ModuleType] = {}
_entry_points_read = False


def register_backend(info: BackendInfo) -> None:
    """Adds a backend (third parties normally use the ``unimp.backends`` entry-point group,
    whose entries point at a :class:`BackendInfo` object).

    Raises:
        ValueError: the name or an alias is taken by another backend.
    """
    with _lock:
        taken = _alias_map()
        for n in (info.name, *info.aliases):
            if n in taken and taken[n] != info.name:
                raise ValueError(f"backend name {n!r} is already used by backend {taken[n]!r}.")
        _backends[info.name] = info


def _read_entry_points() -> None:
    global _entry_points_read
    with _lock:
        if _entry_points_read:
            return
        _entry_points_read = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in _backends:
                continue
            info = ep.load()
            if not isinstance(info, BackendInfo):
                raise TypeError(
                    f"entry point {ep.name!r} in group {ENTRY_POINT_GROUP!r} must point at a "
                    f"unimp.registry.BackendInfo, got {type(info).__name__}."
                )
            register_backend(info)


def _alias_map() -> dict[str, str]:
    out = {}
    for b in _backends.values():
        out[b.name] = b.name
        for a in b.aliases:
            out[a] = b.name
    return out


def keras_engine() -> str:
    """The backend Keras runs on in this process, without importing Keras where it is not
    imported yet: Keras's own ``keras.backend.backend()`` once imported, else what Keras will
    read (``KERAS_BACKEND``, then ``$KERAS_HOME/keras.json`` or ``~/.keras/keras.json``), else
    Keras's default, ``"tensorflow"``."""
    import json
    import os

    if "keras" in sys.modules and hasattr(sys.modules["keras"], "backend"):
        return str(sys.modules["keras"].backend.backend())
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as f:
            return str(json.load(f).get("backend", "tensorflow"))
    except (OSError, ValueError):
        return "tensorflow"


def _canonical(name: str) -> str:
    _read_entry_points()
    if not isinstance(name, str):
        raise TypeError(f"backend name must be a str, got {type(name).__name__}.")
    key = name.strip().lower()
    aliases = _alias_map()
    if key in aliases:
        return aliases[key]
    if key == "keras":  # Keras on the engine this process configures
        return "tensorflow" if keras_engine() == "tensorflow" else KERAS.name
    if key in KERAS_PINNED:
        return KERAS.name
    close = difflib.get_close_matches(key, [*aliases, "keras", *KERAS_PINNED], n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    valid = ", ".join(
        f"{b.name}" + (f" (aliases: {', '.join(b.aliases)})" if b.aliases else "")
        for b in _backends.values()
    )
    raise ValueError(
        f"unknown backend {name!r}.{hint} Valid backends: {valid}; and Keras: keras (on the "
        f"engine this process runs), {', '.join(KERAS_PINNED)}."
    )


def list_backends() -> list[str]:
    """Canonical names of every registered backend, installed or not."""
    _read_entry_points()
    return list(_backends)


def backend_info(name: str) -> BackendInfo:
    """The :class:`BackendInfo` for a name or alias (:data:`KERAS` for Keras on JAX or torch).
    Raises ``ValueError`` for unknown names."""
    canonical = _canonical(name)
    return KERAS if canonical == KERAS.name else _backends[canonical]


def _installed(info: BackendInfo) -> bool:
    return all(importlib.util.find_spec(req) is not None for req in info.requires)


def available_backends() -> list[str]:
    """Backends whose frameworks are installed (found with ``find_spec``, nothing imported)."""
    _read_entry_points()
    return [n for n, b in _backends.items() if _installed(b)]


def framework_versions(name: str) -> dict[str, str | None]:
    """Installed versions of a backend's distributions, from package metadata (no import)."""
    out: dict[str, str | None] = {}
    for dist in backend_info(name).distributions:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def get_backend(name: str) -> ModuleType:
    """Imports (once) and returns a backend module by name or alias.

    Raises:
        ValueError: unknown name; the message lists valid names, aliases and the closest match.
        ImportError: the framework is not installed; the message names the extra to install,
            e.g. ``pip install "unimp[torch]"``.
    """
    canonical = _canonical(name)
    if canonical == KERAS.name:
        _check_keras_engine(name)
    with _lock:
        if canonical in _loaded:
            return _loaded[canonical]
        info = backend_info(canonical)
        missing = [r for r in info.requires if importlib.util.find_spec(r) is None]
        if missing:
            raise ImportError(
                f"backend {canonical!r} needs {', '.join(missing)}, which is not installed. "
                f'Install it with: pip install "unimp[{info.extra}]"'
            )
        module = importlib.import_module(info.module)
        _loaded[canonical] = module
        return module


def _check_keras_engine(name: str) -> None:
    """``keras-jax`` / ``keras-torch`` in a process whose Keras runs on another engine:
    refused, naming the fix (Keras's engine is fixed per process)."""
    engine = keras_engine()
    wanted = KERAS_PINNED.get(name.strip().lower(), engine)
    if engine != wanted:
        raise ValueError(
            f"backend {name!r}: this process runs Keras on {engine!r}, and Keras's backend is "
            f"fixed per process. Set KERAS_BACKEND={wanted} before Keras is imported (or use "
            f"backend='keras', Keras on the engine this process runs)."
        )
    if engine not in KERAS_PINNED.values():
        raise ValueError(f"backend {name!r}: unimp runs Keras on TensorFlow, JAX or torch, not {engine!r}.")
    if importlib.util.find_spec(engine) is None:
        raise ImportError(
            f"backend {name!r} needs {engine}, which is not installed. Install it with: "
            f'pip install "unimp[keras-{engine}]"'
        )


def mixed_precision(
    recipe_or_name: Any = "mixed_float16", backend: str | None = None, **options: Any
) -> Any:
    """Binds a recipe to a backend: returns that backend's ``MixedPrecision``.

    Args:
        recipe_or_name: a :class:`~unimp.Recipe`, or anything :func:`~unimp.get_recipe` accepts.
        backend: backend name or alias (``"torch"``, ``"tf"``, ``"jax"``, ...). Required.
        **options: ``loss_scale=``, ``cast_mode=`` and ``platform=`` go to
            :func:`~unimp.get_recipe` (``loss_scale="none"`` turns scaling off; ``None`` keeps
            the recipe's default); the rest are backend options, e.g. ``device="cuda"`` for
            torch.

    Raises:
        ValueError: unknown backend or recipe name, or a bad override.
        ImportError: the backend's framework is not installed (names the extra).
        TypeError: ``backend`` not given, or an option neither :func:`~unimp.get_recipe` nor the
            backend takes (the message lists the accepted ones).

    Example:
        >>> mp = mixed_precision("float32", loss_scale="dynamic", backend="jax")  # doctest: +SKIP
    """
    from unimp.recipe import get_recipe

    if backend is None:
        raise TypeError(f"mixed_precision() needs backend=, one of {list_backends()}.")
    recipe_keys = ("loss_scale", "cast_mode", "platform")
    overrides = {k: options.pop(k) for k in recipe_keys if k in options}
    module = get_backend(backend)
    import inspect

    params = inspect.signature(module.MixedPrecision.__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    backend_keys = [n for n in params if n not in ("self", "recipe") and params[n].kind is not params[n].VAR_KEYWORD]
    unknown = sorted(k for k in options if k not in backend_keys)
    if unknown and not takes_any:  # checked before anything is built
        accepted = ", ".join(f"{k}=" for k in (*recipe_keys, *backend_keys))
        raise TypeError(
            f"unknown mixed_precision option(s) {unknown} for backend {module.__name__.rsplit('.', 1)[-1]!r}; "
            f"use {accepted}."
        )
    recipe = get_recipe(recipe_or_name, **overrides)
    return module.MixedPrecision(recipe, **options)


def detect_backend(*values: Any) -> str | None:
    """The backend whose arrays are among ``values`` (searched one level into lists, tuples
    and dicts), from ``type(x).__module__`` alone: nothing is imported.

    Returns:
        The canonical backend name, or ``None`` when no framework array is found.

    Raises:
        TypeError: arrays of two frameworks are mixed; the message names both.
    """
    _read_entry_points()
    found: dict[str, str] = {}

    def visit(x: Any) -> None:
        top = (type(x).__module__ or "").split(".")[0]
        for b in _backends.values():
            if top in b.array_modules and top in sys.modules:
                found.setdefault(b.name, type(x).__qualname__)

    for v in values:
        if isinstance(v, dict):
            for x in v.values():
                visit(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        else:
            visit(v)
    if len(found) > 1:
        names = ", ".join(f"{k} ({t})" for k, t in found.items())
        raise TypeError(
            f"arrays from different frameworks in one call: {names}; convert them to one framework."
        )
    return next(iter(found), None)


def cast_mode_refusal(recipe: Any, backend: str) -> str | None:
    """Why ``backend`` cannot run ``recipe.cast_mode`` (one line, naming the modes it has), or
    None where it can: ``"auto"`` always, a mode in its :attr:`BackendInfo.cast_modes`, and
    every mode under a float32 policy, which casts nothing (Apex O0 is ``"autocast"``)."""
    info = backend_info(backend)
    mode = recipe.cast_mode
    if mode == "auto" or mode in info.cast_modes or recipe.policy.is_float32:
        return None
    others = " or ".join(repr(m) for m in ("auto", *info.cast_modes))
    return f"{info.name} has no cast_mode={mode!r}: use cast_mode {others}"


def resolve_cast_mode(recipe: Any, backend: str) -> str:
    """The cast mode ``backend`` runs ``recipe`` in: ``"none"`` for a float32 policy (nothing is
    cast); for ``"auto"``, ``"autocast"`` where the backend has it and the policy is mixed (or a
    float32 model with half overrides, autocast inside those modules only), else ``"module"``;
    an explicit mode as given. The one rule ``MixedPrecision`` and ``unimp explain`` follow; a
    mode the backend lacks is :func:`cast_mode_refusal`'s to refuse.
    """
    p = recipe.policy
    if p.is_float32:
        return "none"
    if recipe.cast_mode != "auto":
        return recipe.cast_mode
    f32_base = p.param_dtype == p.compute_dtype == "float32"
    has = "autocast" in backend_info(backend).cast_modes
    return "autocast" if has and (p.is_mixed or f32_base) else "module"
