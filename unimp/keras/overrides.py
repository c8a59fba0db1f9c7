"""Keras per-layer overrides, on any Keras backend: :mod:`unimp.overrides` matched on layer names, each matched layer
given its override's Keras dtype policy.

The paths are the layer names from the model down, dotted (``"l2"``, ``"mlp.fc1"`` for the
``fc1`` layer of a nested ``mlp`` model: Keras's ``layer.path`` ``"mlp/fc1"`` with ``/`` read as
``.``); input layers have none. A pattern that covers a layer covers the layers inside it.

Keras's own mechanism is the per-layer dtype policy (``Dense(..., dtype="float32")``, the
Keras mixed-precision guide's float32 output layer) and, for many layers at once,
``keras.dtype_policies.DTypePolicyMap`` keyed by ``layer.path`` (keras/src/dtype_policies/
dtype_policy_map.py: exact paths first, then keys as regexes with ``re.fullmatch``, a path
matching two regexes is an error). unimp resolves its own globs (:mod:`unimp.overrides`, so the
rule is the same as torch's and JAX's) into a :func:`dtype_policy_map` of exact layer paths, and
:func:`apply_overrides` sets each covered layer's ``dtype_policy`` from it. A layer's compute
dtype is its policy's: Keras casts its floating inputs to it and reads its variables in it
(autocast), so a float32 override layer inside a ``mixed_float16`` model runs in float32.
Variables already exist when ``prepare`` runs, so an override keeps the model's variable dtype.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import keras

from unimp.attached import attach, peek
from unimp.keras.casting import cast_tree, keras_policy_name
from unimp.overrides import resolve_overrides
from unimp.policy import Policy


def _walk(layer: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for sub in layer._flatten_layers(include_self=False, recursive=False):
        if isinstance(sub, keras.layers.InputLayer):
            continue
        path = f"{prefix}.{sub.name}" if prefix else sub.name
        yield path, sub
        yield from _walk(sub, path)


def layer_paths(model: Any) -> list[str]:
    """The dotted paths overrides match in Keras: layer names from the model down.

    Example:
        >>> import keras
        >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="head")])
        >>> layer_paths(m)
        ['head']
    """
    return [path for path, _ in _walk(model)]


def _keras_name(pattern_path: str, policy: Policy, model_policy: Policy) -> str:
    name = keras_policy_name(policy.param_dtype, policy.compute_dtype)
    if name is None or policy.param_dtype != model_policy.param_dtype:
        raise ValueError(
            f"Policy.overrides: layer {pattern_path!r} gets {policy}, which Keras cannot give a "
            f"built layer: its variables stay {model_policy.param_dtype} (the model's) and Keras "
            "policies compute in the variable dtype or in a half dtype over float32 variables. "
            "Give the override a dtype ('float32', 'bfloat16', ...)."
        )
    return name


def resolve(mp: Any, model: Any) -> dict[str, tuple[Any, Policy, str]]:
    """``{dotted path: (layer, override policy, Keras policy name)}``, all checked: what
    :func:`apply_overrides` applies, resolved before anything changes.

    Raises:
        ValueError: as :func:`dtype_policy_map`.

    Warns:
        OverrideWarning: a pattern matches no layer.
    """
    if not mp.policy.overrides:
        return {}
    layers = dict(_walk(model))
    resolved = resolve_overrides(mp.policy.overrides, list(layers), what="layer")
    return {
        path: (layers[path], o, _keras_name(path, o, mp.policy)) for path, o in resolved.items()
    }


def dtype_policy_map(mp: Any, model: Any) -> Any:
    """The policy's overrides as a ``keras.dtype_policies.DTypePolicyMap`` over ``model``.

    Keys are the exact ``layer.path`` of every covered layer (the layers inside a covered layer
    too: a Keras policy does not pass down to built sublayers); the default policy is
    ``mp.dtype_policy``.

    Raises:
        ValueError: an override conflict, or an override Keras cannot express (names the layer).

    Warns:
        OverrideWarning: a pattern matches no layer.
    """
    out = keras.dtype_policies.DTypePolicyMap(default_policy=mp.dtype_policy)
    for layer, _, name in resolve(mp, model).values():
        out[layer.path] = keras.DTypePolicy(name)
    return out


def _override_call(layer: Any, *args: Any, **kwargs: Any) -> Any:
    return cast_tree(layer._unimp.override_call(*args, **kwargs), layer._unimp.override_output)


def apply_overrides(mp: Any, model: Any, resolved: dict | None = None) -> dict[str, Policy]:
    """Gives every layer the overrides cover its override's dtype policy, in place.

    Everything is checked first, so a failed call changes nothing. An override whose output
    dtype is not its compute dtype also has the layer's ``call`` wrapped to cast its floating
    outputs (the same rule as torch's).

    Args:
        mp: a Keras ``MixedPrecision`` (:class:`unimp.keras.MixedPrecision` or the TensorFlow
            backend's).
        model: a built Keras model or layer.
        resolved: what :func:`resolve` returned, when ``prepare`` already checked it.

    Returns:
        ``{dotted layer path: override policy}`` of the layers changed.

    Raises:
        ValueError: as :func:`dtype_policy_map`.
    """
    resolved = resolve(mp, model) if resolved is None else resolved
    for layer, o, name in resolved.values():
        layer.dtype_policy = keras.DTypePolicy(name)
        if o.output_dtype != o.compute_dtype and peek(layer, "override_call") is None:
            attach(layer).override_call = layer.call
            attach(layer).override_output = o.output_dtype
            layer.call = types.MethodType(_override_call, layer)
    attach(model).overrides = mp.policy.overrides  # which were applied: train_step checks
    return {path: o for path, (_, o, _) in resolved.items()}
