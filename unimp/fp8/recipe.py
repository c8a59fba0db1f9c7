"""What an FP8 recipe adds to a :class:`unimp.Recipe`: the scaling rule and which layers run
float8 matmuls."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from unimp.fp8.config import CurrentScaling, DelayedScaling, FP8Config, fp8_from_dict
from unimp.overrides import check_pattern, pattern_matches

#: Layer kinds whose matmuls run in float8 by default (Keras / flax ``Dense``, torch ``Linear``,
#: convolutions).
FP8_LAYERS = ("Dense", "Linear", "Conv")


def matches(pattern: str, path: str) -> bool:
    """A glob over a dotted layer path: ``pattern`` matches the whole path or a dotted prefix of
    it (``"encoder.*"`` matches ``"encoder.layer1.fc"``; ``"head"`` matches ``"head.dense"``):
    the one rule of ``Policy.overrides``, :func:`unimp.overrides.pattern_matches`."""
    return pattern_matches(pattern, path)


def refuse_shared(selected: Sequence[str], sites: Mapping[str, Sequence[str]]) -> None:
    """The rule for a layer object that runs at several places (a torch module at two paths,
    a Keras layer called twice), in every backend: refused when the recipe selects it.

    One float8 layer keeps one scaling state per tensor; two call sites would share the input
    and gradient amax histories of two different tensors (two pushes per step, one scale for
    both), which no implementation's rule describes. torch's ``named_modules`` lists such a
    module once, so a swap would reach one of its places only.

    Args:
        selected: the paths :meth:`FP8Recipe.select` chose.
        sites: for each layer reached more than once, its path (as ``select`` saw it) mapped
            to every place it runs at (paths, or calls).

    Raises:
        ValueError: a selected layer in ``sites``, named with its places, and the fixes.
    """
    shared = {p: list(sites[p]) for p in selected if p in sites}
    if shared:
        named = "; ".join(f"{p!r} runs at {places}" for p, places in shared.items())
        raise ValueError(
            f"float8 layer(s) shared by several call sites: {named}. One float8 layer keeps one "
            "amax history per tensor, which the call sites would share. Give each call site its "
            "own layer, or keep the shared one out of float8 (FP8Recipe(exclude=[path]))."
        )


@dataclass(frozen=True)
class FP8Recipe:
    """The FP8 part of a recipe: float8 matmuls for Dense/Linear/Conv layers.

    Everything else follows the recipe's policy (bfloat16 compute, float32 master weights in
    the ``fp8*`` recipes).

    Args:
        scaling: a :class:`unimp.fp8.DelayedScaling` or :class:`unimp.fp8.CurrentScaling`
            (or its ``to_dict()``).
        layers: the layer kinds that run float8 matmuls: class-name prefixes, each an
            identifier starting with ``Dense``, ``Linear`` or ``Conv``.
        exclude: glob patterns over dotted layer paths kept out of float8 (see :func:`matches`).
        exclude_first_last: keep the first and the last float8-capable layer in higher
            precision (default True, the usual FP8 guidance).

    Raises:
        ValueError: a bad scaling config, or ``layers`` / ``exclude`` that are not tuples of
            non-empty strings (named).
    """

    scaling: FP8Config = field(default_factory=DelayedScaling)
    layers: tuple[str, ...] = FP8_LAYERS
    exclude: tuple[str, ...] = ()
    exclude_first_last: bool = True

    def __post_init__(self) -> None:
        scaling = self.scaling
        if isinstance(scaling, Mapping):
            scaling = fp8_from_dict(scaling)
        if not isinstance(scaling, (DelayedScaling, CurrentScaling)):
            raise ValueError(
                f"FP8Recipe.scaling must be a DelayedScaling or CurrentScaling, got {type(scaling).__name__}."
            )
        object.__setattr__(self, "scaling", scaling)
        for name in ("layers", "exclude"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"FP8Recipe.{name} must be a tuple of non-empty strings, got {value!r}.")
            object.__setattr__(self, name, tuple(value))
        for kind in self.layers:  # a typo would silently select no layer
            # an entry is a prefix of a layer's class name (``select``: ``kind.startswith``), so
            # it must itself be an identifier: 'Linear:0' or 'Dense ' never matches a class name
            if not (kind.isidentifier() and kind.startswith(FP8_LAYERS)):
                head = re.match(r"[A-Za-z_]\w*", kind.strip())
                close = [head.group()] if head and head.group().startswith(FP8_LAYERS) else (
                    difflib.get_close_matches(kind, FP8_LAYERS, n=1, cutoff=0.5))
                raise ValueError(
                    f"FP8Recipe.layers: {kind!r} is not a layer kind unimp runs in float8; each entry is "
                    f"a class-name prefix (an identifier) starting with one of {list(FP8_LAYERS)} "
                    "(e.g. 'Conv2D'), matched against each layer's class name"
                    + (f". Did you mean {close[0]!r}?" if close else ".")
                )
        # the patterns of Policy.overrides, checked by its rule: '/' reads as '.', and one with
        # whitespace or ';' would never match a dotted path
        object.__setattr__(self, "exclude", tuple(check_pattern(p, "FP8Recipe.exclude") for p in self.exclude))
        if not isinstance(self.exclude_first_last, (bool, np.bool_)):
            raise ValueError(f"FP8Recipe.exclude_first_last must be True or False, got {self.exclude_first_last!r}.")
        object.__setattr__(self, "exclude_first_last", bool(self.exclude_first_last))

    @property
    def kept_out(self) -> tuple[str, ...]:
        """The recipe policy's override patterns: a layer the policy gives its own dtypes keeps
        them and stays out of float8 (set by :class:`unimp.Recipe`; not a field, so it is
        neither compared nor saved: the policy carries it)."""
        return getattr(self, "_kept_out", ())

    def with_kept_out(self, patterns: Sequence[str]) -> FP8Recipe:
        """A copy whose :attr:`kept_out` is ``patterns`` (``Recipe`` passes its policy's
        override patterns)."""
        out = dataclasses.replace(self)
        object.__setattr__(out, "_kept_out", tuple(patterns))
        return out

    def applies_to(self, path: str, kind: str, index: int | None = None, count: int | None = None) -> bool:
        """Whether the layer at dotted ``path`` of class ``kind`` runs float8 matmuls.

        Args:
            path: the layer's dotted path (``"encoder.layer1.fc"``).
            kind: its class name (``"Linear"``, ``"Dense"``, ``"Conv2D"``).
            index, count: its position among the model's float8-capable layers, and their
                number (for ``exclude_first_last``).
        """
        if not any(kind.startswith(k) for k in self.layers):
            return False
        if any(matches(p, path) for p in (*self.exclude, *self.kept_out)):
            return False
        if self.exclude_first_last and index is not None and count is not None:
            return 0 < index < count - 1
        return True

    def select(self, layers: Sequence[tuple[str, str]]) -> tuple[str, ...]:
        """The dotted paths, in model order, of the layers that run float8 matmuls.

        The rule every backend's ``mp.fp8_layers`` applies to the layers it finds: a layer's
        kind is a prefix match on :attr:`layers`, ``exclude`` globs remove paths, and with
        ``exclude_first_last`` the first and the last float8-capable layer (counted before
        ``exclude``) stay out.

        Args:
            layers: ``(path, kind)`` of every layer of the model, in model (definition) order;
                e.g. ``[("emb", "Linear"), ("ln1", "LayerNorm"), ("attn.q", "Linear"), ...]``.

        Raises:
            ValueError: a path given twice, or an entry that is not a ``(path, kind)`` pair of
                strings (named).
        """
        pairs = list(layers)
        for entry in pairs:
            if (not isinstance(entry, tuple) or len(entry) != 2
                    or not all(isinstance(v, str) for v in entry)):
                raise ValueError(f"FP8Recipe.select needs (path, kind) pairs of strings, got {entry!r}.")
        paths = [p for p, _ in pairs]
        dup = sorted({p for p in paths if paths.count(p) > 1})
        if dup:
            raise ValueError(f"FP8Recipe.select: layer path(s) {dup} given twice; paths name one layer each.")
        capable = [(p, k) for p, k in pairs if any(k.startswith(x) for x in self.layers)]
        n = len(capable)
        return tuple(p for i, (p, k) in enumerate(capable) if self.applies_to(p, k, i, n))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, one key per dataclass field (``scaling`` as its ``to_dict()``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["scaling"] = self.scaling.to_dict()
        out["layers"], out["exclude"] = list(self.layers), list(self.exclude)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FP8Recipe:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: not a dict, an unknown key (named), or a bad value.
        """
        return layer_recipe_from_dict(cls, d, "an FP8 recipe")

    def describe(self) -> str:
        s = self.scaling
        rule = (
            f"delayed(L={s.amax_history_len}, {s.amax_compute_algo}, margin={s.margin}, rule={s.rule})"
            if isinstance(s, DelayedScaling)
            else f"current(power_of_2={s.power_of_2_scales}, rule={s.rule})"
        )
        out = f"fp8 {s.fp8_format} {rule} on {'/'.join(self.layers)}"
        if self.exclude_first_last:
            out += ", first and last layers excluded"
        if self.exclude:
            out += f", excluding {list(self.exclude)}"
        if self.kept_out:
            out += f", policy overrides {list(self.kept_out)} kept out"
        return out


def layer_recipe_from_dict(cls: type, d: Any, what: str) -> Any:
    """``cls(**d)`` for a recipe dataclass with ``layers`` / ``exclude`` tuples (JSON gives
    lists): the FP8 and the block-scaled recipes' ``from_dict``.

    Raises:
        ValueError: ``d`` is not a dict, or holds a key ``cls`` has no field for (named).
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"{what} must be a dict, got {type(d).__name__}.")
    names = [f.name for f in dataclasses.fields(cls)]
    extra = sorted(set(d) - set(names))
    if extra:
        raise ValueError(f"unknown {what.split(' ', 1)[1]} key(s) {extra}; keys are {names}.")
    return cls(**{k: tuple(v) if k in ("layers", "exclude") and isinstance(v, list) else v for k, v in d.items()})
