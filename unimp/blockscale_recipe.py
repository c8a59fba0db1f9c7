"""What a block-scaled recipe adds to a model: the rule (:mod:`unimp.blockscale_linear`) and
which Dense / Linear layers run it, chosen by the FP8 recipes' rule (issue 33). Framework-free.

The selection is :meth:`unimp.fp8.recipe.FP8Recipe.select`'s, the one rule of every backend's
``fp8_layers``: layer kinds by class-name prefix, ``exclude`` globs over dotted paths, the
recipe policy's override patterns kept out, and the first and the last capable layer in higher
precision by default. Convolutions are not built in block-scaled formats, so only ``Dense`` and
``Linear`` kinds are taken.

What the published recipes keep in higher precision (:data:`GUIDANCE`): the NVFP4 pretraining
report (arXiv 2509.25149, 12B model, 10T tokens) ran about 15 % of the linear layers (the
last blocks) in BF16, with attention, normalization, embeddings and the output head; the MXFP8
report (arXiv 2506.08027) quantizes every linear layer of the transformer blocks with E4M3 and
keeps the rest in BF16; Transformer Engine's recipes apply to its ``Linear`` layers only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from unimp.blockscale_linear import BlockLinearRule, block_linear_rule
from unimp.fp8.recipe import FP8Recipe, layer_recipe_from_dict

__all__ = ["BLOCK_LAYERS", "GUIDANCE", "BlockRecipe"]

#: Layer kinds that run block-scaled matmuls (Keras / flax ``Dense``, torch ``Linear``).
BLOCK_LAYERS = ("Dense", "Linear")

#: Per rule, what the published recipe keeps in higher precision (module docstring).
GUIDANCE = {
    "mxfp8": "arXiv 2506.08027: every linear layer of the transformer blocks in MXFP8 (E4M3 for "
             "every tensor, scales rounded up); embeddings, normalization, attention and the head in BF16.",
    "fp8_block": "DeepSeek-V3 (arXiv 2412.19437): the linear layers of the blocks in 1x128 / 128x128 FP8; "
                 "embeddings, the output head, normalization and attention in BF16 / FP32.",
    "nvfp4": "arXiv 2509.25149: about 15 % of the linear layers (the last blocks) in BF16, with "
             "attention, normalization, embeddings and the head; exclude them by path.",
    "mxfp4": "no published pretraining recipe in plain MXFP4: expect a loss gap; keep the first and "
             "last layers (the default) and compare against bfloat16.",
}


@dataclass(frozen=True)
class BlockRecipe:
    """The block-scaled part of a recipe: which Dense / Linear layers run ``rule``.

    Args:
        rule: a :class:`unimp.blockscale_linear.BlockLinearRule` or its name (``"mxfp8"``,
            ``"fp8_block"``, ``"nvfp4"``, ``"mxfp4"``).
        layers: class-name prefixes of the layers that run it, each starting with ``Dense`` or
            ``Linear``.
        exclude: glob patterns over dotted layer paths kept out (as ``FP8Recipe.exclude``).
        exclude_first_last: keep the first and the last capable layer in higher precision
            (default True, as the FP8 recipes).
        seed: the seed of the stochastic rounding's bits (NVFP4's gradients), an int.

    Raises:
        ValueError: an unknown rule, a layer kind that is not Dense / Linear (a convolution:
            not built), bad patterns or flags (named).
        TypeError: a rule that is neither a name nor a rule, a seed that is not an int.

    Example:
        >>> BlockRecipe("nvfp4").select([("fc1", "Linear"), ("fc2", "Linear"), ("fc3", "Linear")])
        ('fc2',)
    """

    rule: BlockLinearRule = field(default_factory=lambda: block_linear_rule("mxfp8"))
    layers: tuple[str, ...] = BLOCK_LAYERS
    exclude: tuple[str, ...] = ()
    exclude_first_last: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "rule", block_linear_rule(self.rule))
        if isinstance(self.layers, str) or not all(isinstance(k, str) and k for k in self.layers):
            raise ValueError(f"BlockRecipe.layers must be a tuple of non-empty strings, got {self.layers!r}.")
        for kind in self.layers:
            if not kind.startswith(BLOCK_LAYERS):
                raise ValueError(
                    f"BlockRecipe.layers: {kind!r} is not a layer kind unimp runs block-scaled; each entry "
                    f"is a class-name prefix starting with one of {list(BLOCK_LAYERS)} (block-scaled "
                    "convolutions are not built: keep them in the recipe's compute dtype)."
                )
        if isinstance(self.seed, (bool, np.bool_)) or not isinstance(self.seed, (int, np.integer)):
            raise TypeError(f"BlockRecipe.seed must be an int, got {type(self.seed).__name__} {self.seed!r}.")
        object.__setattr__(self, "seed", int(self.seed))
        checked = self._selection()  # the FP8 recipes' checks of exclude and exclude_first_last
        object.__setattr__(self, "layers", checked.layers)
        object.__setattr__(self, "exclude", checked.exclude)
        object.__setattr__(self, "exclude_first_last", checked.exclude_first_last)

    def _selection(self) -> FP8Recipe:
        return FP8Recipe(layers=tuple(self.layers), exclude=tuple(self.exclude),
                         exclude_first_last=self.exclude_first_last).with_kept_out(self.kept_out)

    @property
    def kept_out(self) -> tuple[str, ...]:
        """The recipe policy's override patterns: those layers keep their dtypes (not a field)."""
        return getattr(self, "_kept_out", ())

    def with_kept_out(self, patterns: Sequence[str]) -> BlockRecipe:
        """A copy whose :attr:`kept_out` is ``patterns``."""
        out = dataclasses.replace(self)
        object.__setattr__(out, "_kept_out", tuple(patterns))
        return out

    def select(self, layers: Sequence[tuple[str, str]]) -> tuple[str, ...]:
        """The dotted paths, in model order, of the layers that run the rule:
        :meth:`unimp.fp8.recipe.FP8Recipe.select` with this recipe's kinds, patterns and
        first/last rule.

        Args:
            layers: ``(path, kind)`` of every layer of the model, in model order.

        Raises:
            ValueError: as :meth:`unimp.fp8.recipe.FP8Recipe.select`.
        """
        return self._selection().select(layers)

    @property
    def guidance(self) -> str:
        """What the published recipe of this rule keeps in higher precision (:data:`GUIDANCE`)."""
        return GUIDANCE[self.rule.name]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, one key per field (``rule`` as its name)."""
        return {"rule": self.rule.name, "layers": list(self.layers), "exclude": list(self.exclude),
                "exclude_first_last": self.exclude_first_last, "seed": self.seed}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BlockRecipe:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: not a dict, an unknown key (named), or a bad value.
        """
        return layer_recipe_from_dict(cls, d, "a block-scaled recipe")

    def describe(self) -> str:
        """One line: the rule, the layer kinds and what is kept out."""
        out = f"block-scaled {self.rule.name} ({self.rule.preset}) on {'/'.join(self.layers)}"
        if self.rule.hadamard:
            out += ", random Hadamard transform of the weight-gradient GEMM's operands"
        if self.exclude_first_last:
            out += ", first and last layers excluded"
        if self.exclude:
            out += f", excluding {list(self.exclude)}"
        if self.kept_out:
            out += f", policy overrides {list(self.kept_out)} kept out"
        return out
