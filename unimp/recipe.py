"""A Recipe: a dtype Policy plus a loss scale plus how casts are applied. Framework-free."""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from unimp.blockscale_recipe import BlockRecipe
from unimp.fp8.config import CurrentScaling, DelayedScaling
from unimp.fp8.recipe import FP8Recipe
from unimp.loss_scale import (
    DynamicLossScale,
    LossScaleConfig,
    NoLossScale,
    StaticLossScale,
    loss_scale_from_dict,
)
from unimp.policy import _KEYS as _POLICY_KEYS
from unimp.policy import FP8_FLOAT16, Policy, get_policy

__all__ = ["CAST_MODES", "Recipe", "get_recipe"]

#: ``autocast``: per-op casting with the framework's float32 op lists (as torch.autocast);
#: ``module``: parameters and inputs cast at module boundaries (as jmp, haiku and Keras layers),
#: normalization layers kept float32; ``auto``: autocast where the framework has it, else module.
CAST_MODES = ("auto", "autocast", "module")

_RECIPE_KEYS = ("policy", "loss_scale", "cast_mode", "fp8", "block")


def _default_loss_scale(policy: Policy) -> LossScaleConfig:
    # float16 has a narrow exponent range: small gradients flush to zero without scaling.
    # bfloat16 has float32's exponent range, so it needs none (it may still be asked for).
    # Pure float16 (float16 parameters, so float16 gradients: Lightning's "16-true", a bare
    # "float16" / "half") gets none, as its origin gives it: Lightning's HalfPrecision runs no
    # GradScaler, and a scaled float16 gradient of a float16 parameter cannot be unscaled
    # safely (every backend refuses that pairing).
    if policy.compute_dtype == "float16" and policy.param_dtype != "float16":
        return DynamicLossScale()
    return NoLossScale()


@dataclass(frozen=True)
class Recipe:
    """A mixed-precision recipe, the same in every framework.

    Args:
        policy: a :class:`~unimp.Policy` or any name :func:`~unimp.get_policy` accepts.
        loss_scale: a loss-scale config (:class:`~unimp.NoLossScale`,
            :class:`~unimp.StaticLossScale`, :class:`~unimp.DynamicLossScale`), ``"dynamic"``,
            ``"none"``, a number (static), or a dict from ``to_dict()``. ``None`` picks the
            default for the policy: dynamic for float16 compute with wider (float32)
            parameters, none otherwise (bfloat16, float32, and pure float16: Lightning's
            ``16-true`` runs no GradScaler).
        cast_mode: ``"auto"``, ``"autocast"`` or ``"module"`` (see :data:`CAST_MODES`).
        fp8: ``None`` (no float8), or a :class:`unimp.fp8.recipe.FP8Recipe` (or its
            ``to_dict()``): float8 matmuls for Dense/Linear/Conv layers (see ``get_recipe("fp8")``).
            A layer covered by one of the policy's ``overrides`` stays out of float8: it runs
            in the dtypes its override gives.
        block: ``None``, or a :class:`unimp.blockscale_recipe.BlockRecipe` (or its
            ``to_dict()``): block-scaled matmuls (MXFP8, block FP8, NVFP4, MXFP4) for the
            Dense/Linear layers it selects (see ``get_recipe("mxfp8")``); policy overrides are
            kept out as for ``fp8``. A recipe has ``fp8`` or ``block``, not both.

    Raises:
        ValueError: unknown policy, loss scale or cast mode; the message names the valid values.

    Example:
        >>> r = Recipe("mixed_float16")
        >>> r.policy.compute_dtype, r.loss_scale.kind
        ('float16', 'dynamic')
    """

    policy: Policy = field(default_factory=Policy)
    loss_scale: LossScaleConfig | None = None
    cast_mode: str = "auto"
    fp8: FP8Recipe | None = None
    block: BlockRecipe | None = None

    def __post_init__(self) -> None:
        policy = get_policy(self.policy)
        ls = (
            _default_loss_scale(policy)
            if self.loss_scale is None
            else loss_scale_from_dict(self.loss_scale)
        )
        if not isinstance(self.cast_mode, str) or self.cast_mode.strip().lower() not in CAST_MODES:
            raise ValueError(
                f"Recipe.cast_mode must be one of {CAST_MODES}, got {self.cast_mode!r}."
            )
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "loss_scale", ls)
        object.__setattr__(self, "cast_mode", self.cast_mode.strip().lower())
        if self.fp8 is not None and not isinstance(self.fp8, FP8Recipe):
            if not isinstance(self.fp8, Mapping):
                hint = (
                    f"; wrap the scaling config: fp8=FP8Recipe({type(self.fp8).__name__}(...))"
                    if isinstance(self.fp8, (DelayedScaling, CurrentScaling)) else ""
                )
                raise ValueError(
                    f"Recipe.fp8 must be None or an unimp.fp8.recipe.FP8Recipe, got {type(self.fp8).__name__}{hint}."
                )
            object.__setattr__(self, "fp8", FP8Recipe.from_dict(self.fp8))
        if self.fp8 is not None and policy.compute_dtype == "float16":
            raise ValueError(FP8_FLOAT16)  # one rule for the name and for a recipe file
        if self.fp8 is not None:  # a layer the policy overrides keeps its dtypes: no float8 there
            object.__setattr__(self, "fp8", self.fp8.with_kept_out([p for p, _ in policy.overrides]))
        if self.block is not None:
            self._check_block(policy)
            object.__setattr__(self, "block", self.block.with_kept_out([p for p, _ in policy.overrides]))

    def _check_block(self, policy: Policy) -> None:
        """``block`` as a :class:`BlockRecipe` (a dict is read), with the rules it meets."""
        if not isinstance(self.block, BlockRecipe):
            if not isinstance(self.block, Mapping):
                raise ValueError(f"Recipe.block must be None or an unimp.blockscale_recipe.BlockRecipe "
                                 f"(e.g. BlockRecipe('mxfp8')), got {type(self.block).__name__}.")
            object.__setattr__(self, "block", BlockRecipe.from_dict(self.block))
        if self.fp8 is not None:
            raise ValueError("a recipe runs one low-precision matmul format: give fp8= or block=, not both "
                             "(recipe.replace(fp8=None) keeps the block-scaled one).")
        if policy.compute_dtype == "float16":
            raise ValueError(
                f"block-scaled recipe {self.block.rule.name!r} runs with bfloat16 compute (Transformer "
                "Engine's block-scaled recipes and the MX / NVFP4 reports train in bfloat16); use "
                "compute=bfloat16, e.g. get_recipe('" + self.block.rule.name.replace("_", "-") + "')."
            )

    @property
    def is_noop(self) -> bool:
        """True for an all-float32 recipe without loss scaling: binding it changes nothing."""
        return self.policy.is_float32 and not self.loss_scale.enabled

    def replace(self, **changes: Any) -> Recipe:
        """A validated copy with ``policy``, ``loss_scale`` or ``cast_mode`` changed."""
        unknown = set(changes) - set(_RECIPE_KEYS)
        if unknown:
            raise TypeError(
                f"unknown Recipe field(s) {sorted(unknown)}; fields are {list(_RECIPE_KEYS)}"
            )
        values = {"policy": self.policy, "loss_scale": self.loss_scale, "cast_mode": self.cast_mode,
                  "fp8": self.fp8, "block": self.block}
        values.update(changes)
        return Recipe(**values)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: ``{"policy": str(policy), "loss_scale": {...}, "cast_mode": ...}``, plus
        ``"fp8": {...}`` for an FP8 recipe, ``"block": {...}`` for a block-scaled one."""
        out = {
            "policy": str(self.policy),
            "loss_scale": self.loss_scale.to_dict(),
            "cast_mode": self.cast_mode,
        }
        if self.fp8 is not None:
            out["fp8"] = self.fp8.to_dict()
        if self.block is not None:
            out["block"] = self.block.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Recipe:
        """Inverse of :meth:`to_dict`. ``loss_scale`` may be omitted (the policy's default).

        ``policy`` is a name or ``str(policy)`` (per-layer overrides as ``;pattern:value``
        clauses), or a table ``{"name": "mixed_float16", "overrides": {"head": "float32"}}``
        (TOML: ``[policy]`` with ``name = ...`` and a ``[policy.overrides]`` table).

        Raises:
            ValueError: an unknown key or a bad value, naming the key.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"a recipe must be a dict, got {type(d).__name__}.")
        unknown = sorted(set(d) - set(_RECIPE_KEYS))
        if unknown:
            raise ValueError(f"unknown recipe key(s) {unknown}; valid keys: {list(_RECIPE_KEYS)}.")
        if "policy" not in d:
            raise ValueError('recipe key \'policy\' is missing, e.g. {"policy": "mixed_float16"}.')
        out = {}
        for key in _RECIPE_KEYS:
            if key not in d:
                continue
            try:
                if key == "policy":
                    out[key] = _policy_from_value(d[key])
                elif key == "loss_scale":
                    out[key] = loss_scale_from_dict(d[key])
                elif key == "fp8":
                    out[key] = None if d[key] is None else FP8Recipe.from_dict(d[key])
                elif key == "block":
                    out[key] = None if d[key] is None else BlockRecipe.from_dict(d[key])
                else:
                    out[key] = d[key]
            except (ValueError, TypeError) as e:
                raise ValueError(f"recipe key {key!r}: {e}") from None
        return cls(**out)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Recipe:
        """Reads a recipe from a ``.toml`` or ``.json`` file (same keys as :meth:`to_dict`).

        A TOML file may hold the keys at top level or under a ``[recipe]`` table; in
        ``[loss_scale]``, ``kind`` is ``none``, ``static`` or ``dynamic``.

        Raises:
            FileNotFoundError: no such file.
            ValueError: unknown extension, a parse error, or a bad key (named).
        """
        path = os.fspath(path)
        ext = os.path.splitext(path)[1].lower()
        if ext not in (".toml", ".json"):
            raise ValueError(f"recipe file {path!r} must end in .toml or .json.")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"recipe file {path!r} does not exist; give a recipe name (mixed_float16, O2, "
                "bf16-mixed, ...) or the path of a .toml / .json recipe file."
            )
        with open(path, "rb") as f:
            raw = f.read()
        try:
            if ext == ".json":
                data = json.loads(raw.decode("utf-8"))
            else:
                try:
                    import tomllib
                except ModuleNotFoundError:  # Python 3.10
                    import tomli as tomllib  # type: ignore[no-redef]
                data = tomllib.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot parse recipe file {path!r}: {e}") from None
        if isinstance(data, dict) and set(data) == {"recipe"}:
            data = data["recipe"]
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"recipe file {path!r}: {e}") from None

    def describe(self) -> str:
        """One line: policy, loss scale and cast mode."""
        ls = self.loss_scale
        if ls.kind == "dynamic":
            ls_text = (
                f"dynamic(init={ls.init_scale:g}, growth={ls.growth_factor:g}x every "
                f"{ls.growth_interval}, backoff={ls.backoff_factor:g}, "
                f"min={'2**-126' if ls.min_scale is None else f'{ls.min_scale:g}'}, "
                f"max={'none' if ls.max_scale is None else f'{ls.max_scale:g}'})"
            )
        elif ls.kind == "static":
            ls_text = f"static({ls.scale:g})"
        else:
            ls_text = "none"
        fp8 = f"; {self.fp8.describe()}" if self.fp8 is not None else ""
        block = f"; {self.block.describe()}" if self.block is not None else ""
        return f"policy {self.policy}; loss scale {ls_text}; cast_mode {self.cast_mode}{fp8}{block}"


#: The whole-step Policy fields a recipe file's ``[policy]`` table may set beside ``name``.
_POLICY_TABLE_FIELDS = ("matmul_precision", "reduce_dtype", "accum_dtype", "update")


def _policy_from_value(value: Any) -> Policy:
    """A recipe file's ``policy``: a name, or a table ``{"name": ..., "overrides": {pattern:
    value}}`` that may also set the whole-step fields ``matmul_precision``, ``reduce_dtype``,
    ``accum_dtype`` and ``update`` (as :class:`Policy`'s fields of the same name)."""
    if not isinstance(value, Mapping):
        return get_policy(value)
    allowed = ("name", *_POLICY_TABLE_FIELDS, "overrides")
    unknown = sorted(set(value) - set(allowed))
    if unknown or "name" not in value:
        raise ValueError(
            f"a policy table takes 'name' (required) and {list(allowed[1:])}, got {sorted(value)}; "
            'e.g. {"name": "mixed_float16", "matmul_precision": "high", "overrides": {"head": "float32"}}.'
        )
    name = value["name"]
    policy = get_policy(name)
    fields = {k: value[k] for k in _POLICY_TABLE_FIELDS if k in value}
    if isinstance(fields.get("matmul_precision"), str) and fields["matmul_precision"].strip().lower() == "none":
        fields["matmul_precision"] = None  # TOML has no null: "none" as in the name's matmul=none
    if fields and isinstance(name, str):
        # a field set both in the name ("mixed_float16,matmul=high", or "matmul=high" alone in
        # jmp's grammar) and the table is ambiguous
        head = name.split(";", 1)[0]
        keys = {
            _POLICY_KEYS.get(part.partition("=")[0].strip().lower())
            for part in head.split(",")
            if "=" in part
        }
        twice = sorted(keys & set(fields))
        if twice:
            raise ValueError(
                f"policy {twice[0]} is given twice: in the name {name!r} and in the [policy] table; "
                "keep one of them."
            )
    if fields:
        policy = policy.with_(**fields)
    if "overrides" not in value:
        return policy
    table = value["overrides"]
    if not isinstance(table, Mapping):
        raise ValueError(
            f"the policy table's 'overrides' must be a table {{pattern = value}}, got "
            f"{type(table).__name__} {table!r}; e.g. [policy.overrides] with head = \"float32\"."
        )
    for pattern, v in table.items():
        if isinstance(v, Mapping):  # TOML reads `blocks.0.attn = "float32"` as nested tables
            raise ValueError(
                f"policy override {pattern!r} holds a table {dict(v)!r}: an unquoted dotted key "
                f'is a nested table in TOML, so quote the pattern ("blocks.0.attn" = "float32"), '
                f'and write a policy value as a string ("params=float32,compute=float32").'
            )
    twice = sorted(set(dict(policy.overrides)) & set(table))
    if twice:
        raise ValueError(
            f"policy override pattern {twice[0]!r} is given twice: in the name {name!r} and in "
            "[policy.overrides]; keep one of them."
        )
    return policy.with_(overrides=dict(policy.overrides) | dict(table))


# Apex opt levels fix the cast mode and the loss scale, as Apex did.
_APEX = {
    "O0": ("autocast", NoLossScale()),
    "O1": ("autocast", DynamicLossScale.preset("apex")),
    "O2": ("module", DynamicLossScale.preset("apex")),
    "O3": ("module", StaticLossScale(1.0)),
}


#: The FP8 recipes: float8 matmuls for Dense/Linear/Conv layers (first and last excluded),
#: bfloat16 elsewhere, float32 master weights, no loss scale. ``fp8`` is Accelerate's
#: ``mixed_precision="fp8"``, ``transformer-engine`` Lightning's precision flag (with Transformer
#: Engine's DelayedScaling rule); ``fp8-delayed`` / ``fp8-current`` are unimp's own rules.
FP8_RECIPES = {
    "fp8": lambda: DelayedScaling(),
    "fp8-delayed": lambda: DelayedScaling(),
    "fp8-current": lambda: CurrentScaling(),
    "transformer-engine": lambda: DelayedScaling.preset("transformer_engine"),
}

#: The block-scaled recipes (issue 33): name -> :data:`unimp.blockscale_linear.BLOCK_LINEAR_RULES`
#: key. Block-scaled matmuls for the selected Dense/Linear layers (first and last excluded),
#: bfloat16 elsewhere, float32 master weights, no loss scale, as the FP8 recipes.
BLOCK_RECIPES = {"mxfp8": "mxfp8", "fp8-block": "fp8_block", "nvfp4": "nvfp4", "mxfp4": "mxfp4"}


def get_recipe(name: Any, **overrides: Any) -> Recipe:
    """Builds a recipe from any policy name, a recipe file path, or a Policy.

    The loss scale defaults to dynamic (unimp's defaults) for float16 compute with float32
    parameters (``mixed_float16``, ``16-mixed``) and to none for bfloat16 and float32
    (bfloat16 has float32's exponent range) and for pure float16 (``16-true``, ``float16``,
    ``half``: float16 parameters, whose float16 gradients cannot be unscaled safely; Lightning's
    ``16-true`` runs no GradScaler). Apex opt levels set
    the cast mode and loss scale as Apex did: O1 autocast + dynamic, O2 module (float16 model,
    float32 master weights) + dynamic, O3 pure float16 with scale 1.

    Args:
        name: a policy name (see :func:`~unimp.get_policy`), a path ending in ``.toml`` /
            ``.json``, a :class:`Policy`, a :class:`Recipe`, or a framework's policy object
            or dtype as :func:`~unimp.get_policy` reads them (a Keras ``DTypePolicy``, a jmp
            ``Policy``, ``torch.float16``): ``get_recipe(keras.mixed_precision.Policy(
            "mixed_float16"))`` is ``get_recipe("mixed_float16")``.
        **overrides: ``loss_scale=`` and ``cast_mode=`` replace the defaults (``None`` keeps
            the default, as ``Recipe(loss_scale=None)``: write ``loss_scale="none"`` to turn
            loss scaling off); ``platform=`` resolves ``"half"`` (see :func:`get_policy`);
            ``fp8=`` an :class:`unimp.fp8.recipe.FP8Recipe`, or ``None`` for none (as
            ``Recipe(fp8=None)``: ``get_recipe("fp8", fp8=None)`` is its bfloat16 recipe
            without float8); ``block=`` a :class:`unimp.blockscale_recipe.BlockRecipe`, or
            ``None`` for none (``get_recipe("mxfp8", block=None)`` is its bfloat16 recipe).

    Raises:
        ValueError: unknown name (naming the closest valid one) or bad override.

    Example:
        >>> get_recipe("bf16-mixed").loss_scale.kind
        'none'
        >>> get_recipe("O2").cast_mode
        'module'
    """
    unknown = set(overrides) - {"loss_scale", "cast_mode", "platform", "fp8", "block"}
    if unknown:
        raise TypeError(
            f"unknown get_recipe option(s) {sorted(unknown)}; use loss_scale=, cast_mode=, fp8=, block=."
        )
    platform = overrides.pop("platform", None)
    if isinstance(name, Recipe):
        return name.replace(**overrides) if overrides else name
    if isinstance(name, str) and os.path.splitext(name)[1].lower() in (".toml", ".json"):
        recipe = Recipe.from_file(name)
        return recipe.replace(**overrides) if overrides else recipe
    if isinstance(name, str) and name.strip().lower() in FP8_RECIPES:
        # fp8=None given: the recipe without float8, as Recipe(fp8=None) and recipe.replace(fp8=None)
        default = "fp8" not in overrides
        fp8 = overrides.pop("fp8", None)
        fp8 = FP8Recipe(FP8_RECIPES[name.strip().lower()]()) if default else fp8
        return Recipe(get_policy("mixed_bfloat16"), overrides.get("loss_scale"),
                      overrides.get("cast_mode", "auto"), fp8, overrides.get("block"))
    if isinstance(name, str) and name.strip().lower() in BLOCK_RECIPES:
        default = "block" not in overrides
        block = overrides.pop("block", None)
        block = BlockRecipe(BLOCK_RECIPES[name.strip().lower()]) if default else block
        return Recipe(get_policy("mixed_bfloat16"), overrides.get("loss_scale"),
                      overrides.get("cast_mode", "auto"), overrides.get("fp8"), block)
    fp8 = overrides.pop("fp8", None)
    if fp8 is not None:
        return get_recipe(name, **overrides, platform=platform).replace(fp8=fp8)
    block = overrides.pop("block", None)
    if block is not None:
        return get_recipe(name, **overrides, platform=platform).replace(block=block)
    try:
        policy = get_policy(name, platform=platform)
    except ValueError as e:
        if not isinstance(name, str) or not str(e).startswith("unknown policy"):
            raise
        # get_policy knows no recipe names: the FP8 recipes are named here, closest first
        key = name.strip().lower()
        close = difflib.get_close_matches(key.replace("_", "-"), [*FP8_RECIPES, *BLOCK_RECIPES], n=1, cutoff=0.7)
        kind = "FP8" if close and close[0] in FP8_RECIPES else "block-scaled"
        hint = f"Did you mean the {kind} recipe {close[0]!r}? " if close else ""
        raise ValueError(f"{e} {hint}FP8 recipes: {', '.join(FP8_RECIPES)}; block-scaled recipes: "
                         f"{', '.join(BLOCK_RECIPES)}.") from None
    key = name.strip().upper() if isinstance(name, str) else None
    if key in _APEX:
        cast_mode, ls = _APEX[key]
        return Recipe(
            policy, overrides.get("loss_scale", ls), overrides.get("cast_mode", cast_mode)
        )
    return Recipe(policy, overrides.get("loss_scale"), overrides.get("cast_mode", "auto"))
