"""Tensor statistics: how a tensor's values would fare in float16 and bfloat16. Framework-free.

One definition, computed on the device by every backend (``unimp.backends.<name>.stats``) and
here in NumPy as the reference the backends are tested against. For a tensor ``x`` read at a
``scale`` (the loss scale for gradients, 1 for activations), with ``v = |x| * scale`` computed in
float32 (the scale is a power of two in every dynamic rule, so the product is exact):

* ``amax``: the largest ``|x|`` (unscaled); ``min_nonzero``: the smallest nonzero ``|x|``
  (``inf`` when every element is zero); ``zeros``: exact zeros; ``nonfinite``: inf or NaN.
* for each target dtype, with round-to-nearest-even as every framework's cast does:

  - ``overflow``: ``v >= overflow_at`` (rounds to inf: 65520 for float16, ``(2 - 2**-8) *
    2**127`` for bfloat16), inf included;
  - ``flush``: ``0 < v <= flush_at`` (rounds to zero: half the smallest subnormal, 2**-25
    for float16, 2**-134 for bfloat16);
  - ``subnormal``: ``flush_at < v < subnormal_below`` (rounds to a nonzero subnormal:
    below the smallest normal less half a subnormal step).

* ``headroom``: ``log2(dtype_max / (amax * scale))``, in bits (powers of two) before the
  largest element overflows; negative means it already does; ``inf`` for an all-zero tensor.
* for each block-scaled format asked for (``formats``, names of :data:`BLOCK_FORMATS`: the block
  recipes' rules, off by default), what quantizing the unscaled ``x`` in that format does to it
  (:func:`unimp.blockscale_presets.quantization_sums` of the rule's preset, blocks of the
  rule's activations along the last axis, elements rounded to nearest even, the last axis
  padded with zeros to whole blocks):

  - ``<format>_underflow`` and ``<format>_nonzero`` (counts): finite nonzero elements that
    quantize to zero, and finite nonzero elements (counted beside them, by the same mask:
    where a framework reads float32 subnormals as zero in one fused kernel and not in another,
    the share stays a share); :meth:`TensorStats.underflow` is their ratio;
  - ``<format>_error`` and ``<format>_energy`` (sums): ``sum(((q - x) / unit)**2)`` and
    ``sum((x / unit)**2)`` over the elements finite before and after, ``unit`` being
    ``block_unit``, the largest finite ``|x|``; :meth:`TensorStats.relative_mse` is their
    ratio. Sums in a common unit add up, so the outputs of a layer called twice merge
    (:func:`merge_block_sums`).

Counts are exact in every backend; magnitudes agree to float32 rounding. Where a framework
reads float32 subnormals as zero on the device (denormals-are-zero: TensorFlow and XLA on the
CPU, measured; XLA and CUDA kernels built with flush-to-zero on GPUs), an element below
float32's smallest normal (``|x| < 2**-126``) counts as a zero, not as a float16 or bfloat16
flush nor as a bfloat16 subnormal, and is left out of ``min_nonzero``; a product ``|x| * scale``
that lands there (only with a scale below 1) counts as a bfloat16 flush. So there, bfloat16
subnormals are never seen, and a tensor holding float32 subnormals gets other zero and flush
counts than in torch; tensors without them get the same counts everywhere. torch (CPU and
CUDA) keeps float32 subnormals, as NumPy does.

Counts are int32 on the device: a tensor of 2**31 elements or more is out of range.

The block formats' counts are exact and their sums agree to float32 rounding (summation order)
in every backend where no step of the quantization meets a float32 subnormal, which those
frameworks flush: elements at or above 2**-126 and a largest magnitude above about 1e-34
(NVFP4's tensor scale ``amax / 2688`` stays normal). A tensor holding inf or NaN is counted
non-finite above; the formats here return those blocks (NVFP4: the whole tensor) non-finite and
leave them out of the sums, and no finite tensor comes back non-finite in them.

Each backend's ``stats`` module computes one tensor's statistics with ``tensor_stats(x,
scale, formats=())`` (two device arrays, no host sync), and ``train_step(..., stats_every=k,
stats_formats=())`` takes them for every gradient and layer output on steps 0, k, 2k, ...:
:class:`StepStats`, read from ``StepResult.stats``.

Example:
    >>> s = reference_stats([65519.0, 65520.0, 2.0**-25, 0.0])
    >>> s.counts["float16_overflow"], s.counts["float16_flush"], s.counts["zeros"]
    (1, 1, 1)
    >>> s.headroom("float16") < 0  # 65520 is past float16's largest value, 65504
    True
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from unimp.blockscale_linear import BLOCK_LINEAR_RULES
from unimp.blockscale_presets import quantization_sums
from unimp.fp8.rule import NumpyOps
from unimp.recipe import BLOCK_RECIPES

__all__ = [
    "BLOCK_FORMATS",
    "COUNT_FIELDS",
    "LIMITS",
    "TARGETS",
    "THRESHOLDS",
    "RangeLimits",
    "StepStats",
    "TensorStats",
    "block_error_arrays",
    "block_layout",
    "check_formats",
    "count_fields",
    "first_nonfinite",
    "first_nonfinite_gradient",
    "layer_of",
    "magnitude_fields",
    "merge_block_sums",
    "output_leaves",
    "reference_stats",
    "top_layer",
]


@dataclass(frozen=True)
class RangeLimits:
    """Where float32 values land when cast to a narrower float (round to nearest even).

    Attributes:
        dtype: canonical name.
        max: largest finite value.
        overflow_at: ``|v| >= overflow_at`` rounds to inf.
        subnormal_below: ``|v| < subnormal_below`` rounds below the smallest normal.
        flush_at: ``0 < |v| <= flush_at`` rounds to zero.
    """

    dtype: str
    max: float
    overflow_at: float
    subnormal_below: float
    flush_at: float


LIMITS: dict[str, RangeLimits] = {
    "float16": RangeLimits("float16", 65504.0, 65520.0, 2.0**-14 - 2.0**-25, 2.0**-25),
    "bfloat16": RangeLimits(
        "bfloat16",
        (2 - 2.0**-7) * 2.0**127,
        (2 - 2.0**-8) * 2.0**127,
        2.0**-126 - 2.0**-134,
        2.0**-134,
    ),
}
#: The dtypes every statistic is computed for, in order.
TARGETS = tuple(LIMITS)
#: Per target, ``(overflow_at, subnormal_below, flush_at)`` as Python floats that are exactly
#: float32 values (each limit is a float32 number): what the backends compare ``v`` against.
THRESHOLDS: dict[str, tuple[float, float, float]] = {
    t: tuple(float(np.float32(x)) for x in (lim.overflow_at, lim.subnormal_below, lim.flush_at))
    for t, lim in LIMITS.items()
}
#: The integer counts a backend returns, in order: per tensor, then per target.
COUNT_FIELDS = ("zeros", "nonfinite") + tuple(
    f"{t}_{k}" for t in TARGETS for k in ("overflow", "subnormal", "flush")
)
#: The block-scaled formats the statistics can measure (``formats=``, ``stats_formats=``): the
#: rules of the block recipes (:data:`unimp.recipe.BLOCK_RECIPES`' values; the recipe
#: ``fp8-block`` is the rule ``fp8_block``), keys of :data:`unimp.blockscale_linear.BLOCK_LINEAR_RULES`.
BLOCK_FORMATS = tuple(BLOCK_RECIPES.values())
#: The width the last axis is padded to with zeros (a multiple of every format's block):
#: zeros change no block's or tensor's amax, so a partial block quantizes over the elements it
#: has, as Transformer Engine quantizes a partial last tile.
BLOCK_PAD = math.lcm(*(BLOCK_LINEAR_RULES[f].tile("activation")[1] for f in BLOCK_FORMATS))


def check_formats(formats: Any) -> tuple[str, ...]:
    """The block formats to measure, checked: a name or a sequence of names of
    :data:`BLOCK_FORMATS` (a recipe's spelling, ``"fp8-block"``, is taken too), each once.

    Returns:
        The canonical names, in the order given.

    Raises:
        ValueError: an unknown name (listing the valid ones and the closest match) or one given
            twice.
        TypeError: neither a string nor a sequence of strings.

    Example:
        >>> check_formats("mxfp8"), check_formats(["nvfp4", "fp8-block"])
        (('mxfp8',), ('nvfp4', 'fp8_block'))
    """
    names = (formats,) if isinstance(formats, str) else formats
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"formats must be a block format name or a list of them ({', '.join(BLOCK_FORMATS)}), "
            f"got {formats!r}."
        )
    out: list[str] = []
    for name in names:
        key = BLOCK_RECIPES.get(name.strip().lower(), name.strip().lower())
        if key not in BLOCK_FORMATS:
            close = difflib.get_close_matches(key, BLOCK_FORMATS, n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"unknown block format {name!r} for the statistics; choose among "
                f"{', '.join(BLOCK_FORMATS)}.{hint}"
            )
        if key in out:
            raise ValueError(f"block format {key!r} is given twice in {formats!r}; give each once.")
        out.append(key)
    return tuple(out)


def count_fields(formats: Sequence[str] = ()) -> tuple[str, ...]:
    """The integer counts a backend returns with ``formats`` measured, in order:
    :data:`COUNT_FIELDS`, then ``<format>_underflow`` and ``<format>_nonzero`` per format."""
    return COUNT_FIELDS + tuple(f"{f}_{k}" for f in formats for k in ("underflow", "nonzero"))


def magnitude_fields(formats: Sequence[str] = ()) -> tuple[str, ...]:
    """The float32 values a backend returns with ``formats`` measured, in order: ``amax``,
    ``min_nonzero``, then (with any format) ``block_unit`` and ``<format>_error``,
    ``<format>_energy`` per format."""
    if not formats:
        return ("amax", "min_nonzero")
    return ("amax", "min_nonzero", "block_unit") + tuple(
        f"{f}_{k}" for f in formats for k in ("error", "energy")
    )


def block_layout(shape: Sequence[int]) -> tuple[int, int, int]:
    """How a tensor of ``shape`` is blocked for the block formats' statistics: ``(rows,
    columns, padded columns)``, rows being the product of every axis but the last (1 for a
    0-d or 1-d tensor), columns the last axis, padded with zeros to a multiple of
    :data:`BLOCK_PAD`.

    Raises:
        ValueError: a dimension that is not static (a traced shape with ``None``).

    Example:
        >>> block_layout((4, 10, 200)), block_layout(()), block_layout((0, 3))
        ((40, 200, 256), (1, 1, 128), (0, 3, 128))
    """
    dims = tuple(shape)
    if any(d is None for d in dims):
        raise ValueError(
            f"the block formats' statistics need static shapes, got {dims}: give the traced step "
            "an input signature with the batch size (tf.function(input_signature=...))."
        )
    rows = math.prod(dims[:-1]) if dims else 1
    cols = int(dims[-1]) if dims else 1
    return int(rows), cols, -(-cols // BLOCK_PAD) * BLOCK_PAD


def block_error_arrays(a: Any, formats: Sequence[str], ops: Any = NumpyOps) -> tuple[list[Any], list[Any]]:
    """What quantizing a tensor in each of ``formats`` does to it, on the device: the rule
    every backend's ``tensor_stats`` runs on its own tensors (the module docstring).

    Args:
        a: float32 ``(rows, padded columns)`` (:func:`block_layout`): the tensor's magnitudes
            ``|x|`` (unscaled; the formats here are symmetric, so ``|q(x)| = q(|x|)``) with
            zeros after its last column. Not empty.
        formats: names of :data:`BLOCK_FORMATS` (checked by :func:`check_formats`).
        ops: the array namespace (default NumPy, the reference; a backend's ``FP8Ops``).

    Returns:
        ``(counts, sums)``: lists of 0-d arrays, ``counts`` int32 in
        ``count_fields(formats)[len(COUNT_FIELDS):]`` order, ``sums`` float32 in
        ``magnitude_fields(formats)[2:]`` order.
    """
    counts, sums = [], []
    unit = None
    for f in formats:
        rule = BLOCK_LINEAR_RULES[f]
        q = quantization_sums(a, rule.preset, "activation", rule.format("activation"), ops=ops)
        counts += [q.underflow, q.nonzero]
        sums += [q.error, q.energy]
        unit = q.unit
    return counts, ([unit] + sums if formats else [])


def merge_block_sums(unit_a: Any, sums_a: Any, unit_b: Any, sums_b: Any, where: Callable[..., Any]) -> tuple[Any, Any]:
    """Two tensors' block sums taken together: ``unit = max(unit_a, unit_b)`` and each sum
    rescaled to it, ``sums_a * (unit_a / unit)**2 + sums_b * (unit_b / unit)**2`` (float32;
    a share too small to matter rounds to 0). Written once for every backend's merge.

    Args:
        unit_a, unit_b: float32 ``block_unit`` values (finite, > 0), any shape that broadcasts
            against the sums (``(1,)`` beside a vector).
        sums_a, sums_b: float32 ``<format>_error`` / ``_energy`` values.
        where: the backend's ``where(condition, x, y)``.

    Returns:
        ``(unit, sums)``.

    Example:
        >>> u, s = merge_block_sums(np.float32(2), np.float32(1), np.float32(4), np.float32(1), np.where)
        >>> float(u), float(s)  # 1 * (2 / 4)**2 + 1
        (4.0, 1.25)
    """
    unit = where(unit_a >= unit_b, unit_a, unit_b)
    ra, rb = unit_a / unit, unit_b / unit
    return unit, sums_a * (ra * ra) + sums_b * (rb * rb)



@dataclass(frozen=True)
class TensorStats:
    """The statistics of one tensor at one scale (see the module docstring for definitions).

    Attributes:
        size: elements.
        scale: float, the scale the range counts were taken at.
        amax: float, largest ``|x|`` (unscaled; NaN if any element is NaN).
        min_nonzero: float, smallest nonzero ``|x|`` (``inf`` when none).
        counts: ``{name: int}`` for every name in :data:`COUNT_FIELDS`, and
            ``<format>_underflow``, ``<format>_nonzero`` for each block format measured.
        sums: ``{name: float}``: with block formats measured, ``block_unit`` and
            ``<format>_error``, ``<format>_energy`` for each (:func:`magnitude_fields`);
            empty without.

    Raises:
        ValueError: a count of :data:`COUNT_FIELDS` missing, or a measured block format
            without its sums.
    """

    size: int
    scale: float
    amax: float
    min_nonzero: float
    counts: Mapping[str, int] = field(default_factory=dict)
    sums: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [k for k in count_fields(self.formats) if k not in self.counts]
        missing += [k for k in magnitude_fields(self.formats)[2:] if k not in self.sums]
        if missing:
            raise ValueError(f"TensorStats is missing {missing}.")

    @property
    def formats(self) -> tuple[str, ...]:
        """The block formats measured (names of :data:`BLOCK_FORMATS`), in the order taken."""
        return tuple(k[: -len("_underflow")] for k in self.counts if k.endswith("_underflow"))

    @classmethod
    def from_arrays(
        cls, size: int, scale: float, counts: Any, magnitudes: Any, formats: Sequence[str] = ()
    ) -> TensorStats:
        """Builds the record from a backend's two host arrays.

        Args:
            size: elements of the tensor.
            scale: the scale the counts were taken at.
            counts: int array, shape ``(len(count_fields(formats)),)``, in that order.
            magnitudes: float array, shape ``(len(magnitude_fields(formats)),)``: ``amax``,
                ``min_nonzero``, then the block sums.
            formats: the block formats the arrays hold (:func:`check_formats`'s names).
        """
        names, values = count_fields(formats), magnitude_fields(formats)
        c = np.asarray(counts).reshape(-1)
        m = np.asarray(magnitudes, dtype=np.float64).reshape(-1)
        if c.shape != (len(names),) or m.shape != (len(values),):
            raise ValueError(
                f"expected {len(names)} counts and {len(values)} magnitudes, got {c.shape} and {m.shape}."
            )
        return cls(
            int(size),
            float(scale),
            float(m[0]),
            float(m[1]),
            {k: int(v) for k, v in zip(names, c, strict=True)},
            {k: float(v) for k, v in zip(values[2:], m[2:], strict=True)},
        )

    def fraction(self, name: str) -> float:
        """``counts[name] / size`` (0 for an empty tensor), e.g. ``fraction("float16_flush")``."""
        if name not in self.counts:
            raise KeyError(f"unknown count {name!r}; choose one of {', '.join(self.counts)}.")
        return self.counts[name] / self.size if self.size else 0.0

    def _measured(self, fmt: str) -> str:
        key = check_formats(fmt)[0]
        if key not in self.formats:
            raise KeyError(
                f"block format {key!r} was not measured ({', '.join(self.formats) or 'none'} were): "
                f"take it with train_step(..., stats_formats=[{key!r}]) or tensor_stats(x, formats=...)."
            )
        return key

    def underflow(self, fmt: str) -> float:
        """The share of the finite nonzero elements that quantize to zero in the block format
        ``fmt`` (0 when there are none).

        Raises:
            KeyError: ``fmt`` was not measured. ValueError: not a block format.
        """
        key = self._measured(fmt)
        nonzero = self.counts[f"{key}_nonzero"]
        return self.counts[f"{key}_underflow"] / nonzero if nonzero > 0 else 0.0

    def relative_mse(self, fmt: str) -> float:
        """``sum((q - x)**2) / sum(x**2)`` in the block format ``fmt``, over the elements
        finite before and after quantizing (0 when there are none).

        Raises:
            KeyError: ``fmt`` was not measured. ValueError: not a block format.
        """
        key = self._measured(fmt)
        energy = self.sums[f"{key}_energy"]
        return self.sums[f"{key}_error"] / energy if energy > 0 else 0.0

    def headroom(self, dtype: str) -> float:
        """Bits (powers of two) between ``amax * scale`` and the dtype's largest value.

        Raises:
            KeyError: ``dtype`` is not one of :data:`TARGETS`.
        """
        limit = _limits(dtype).max
        top = self.amax * self.scale
        if math.isnan(top):
            return math.nan
        if top == 0:
            return math.inf
        if math.isinf(top):
            return -math.inf
        return math.log2(limit / top)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (``inf`` as the float), with fractions and headroom added,
        and per block format measured its underflow share and relative MSE (``block``)."""
        out = asdict(self)
        out["counts"] = dict(self.counts)
        out["sums"] = dict(self.sums)
        out["headroom"] = {t: self.headroom(t) for t in TARGETS}
        out["fractions"] = {k: self.fraction(k) for k in self.counts}
        out["block"] = {
            f: {"underflow": self.underflow(f), "relative_mse": self.relative_mse(f)} for f in self.formats
        }
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TensorStats:
        """Inverse of :meth:`to_dict` (derived keys are ignored)."""
        return cls(
            int(d["size"]), float(d["scale"]), float(d["amax"]), float(d["min_nonzero"]),
            dict(d["counts"]), dict(d["sums"]),
        )  # fmt: skip


def _limits(dtype: str) -> RangeLimits:
    try:
        return LIMITS[dtype]
    except KeyError:
        raise KeyError(f"no range statistics for {dtype!r}; choose one of {', '.join(TARGETS)}.") from None


@dataclass(frozen=True)
class StepStats:
    """Statistics of one step: per parameter gradient and per layer output (activation).

    Attributes:
        step: the step index the statistics were taken at (0-based, counted by the train step).
        gradients: ``{parameter name: TensorStats}`` of the unscaled gradients before clipping,
            at the step's loss scale, in the parameters' order (names as the framework spells
            them: ``l1.weight`` in torch, ``model/l1/kernel`` (``variable.path``) in Keras,
            ``w1`` or ``l1/kernel`` as the JAX pytree path).
        activations: ``{layer name: TensorStats}`` of layer outputs in the forward pass, at
            scale 1, in the order the forward pass produced them; all the outputs of a layer
            called more than once in the step (every micro-batch, shared weights) together.
            Empty where nothing was seen (JAX without flax linen or
            ``unimp.backends.jax.observe``).

    Example:
        >>> s = StepStats(0, {"w": reference_stats([2.0**-30, 1.0], scale=2.0**10)}, {})
        >>> s.gradients["w"].fraction("float16_flush"), s.gradients["w"].headroom("float16")
        (0.0, 5.999...)
    """

    step: int
    gradients: Mapping[str, TensorStats]
    activations: Mapping[str, TensorStats]

    @classmethod
    def from_arrays(
        cls,
        step: int,
        gradients: Mapping[str, tuple[Any, Any, Any, Any]],
        activations: Mapping[str, tuple[Any, Any, Any, Any]],
        order: tuple[list[str], list[str]] | None = None,
        formats: Sequence[str] = (),
    ) -> StepStats:
        """Builds the record from a backend's host arrays.

        Args:
            step: the step index.
            gradients: ``{name: (size, scale, counts, magnitudes)}`` as
                :meth:`TensorStats.from_arrays` takes them.
            activations: the same for the activations.
            order: ``(gradient names, activation names)`` in the order to keep (the model's
                parameter order, the forward pass's call order); names not listed follow,
                sorted. Compiled steps return dicts sorted by name, so the order is passed
                along on the side.
            formats: the block formats the arrays hold (the step's ``stats_formats``).
        """
        order = order or ([], [])

        def build(group: Mapping[str, Any], first: list[str], kind: str) -> dict[str, TensorStats]:
            names = [n for n in first if n in group]
            names += sorted(set(group) - set(names))
            return _Named(kind, {n: TensorStats.from_arrays(*group[n], formats) for n in names})

        return cls(
            int(step), build(gradients, order[0], "gradient"), build(activations, order[1], "activation")
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values."""
        return {
            "step": self.step,
            "gradients": {k: v.to_dict() for k, v in self.gradients.items()},
            "activations": {k: v.to_dict() for k, v in self.activations.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepStats:
        """Inverse of :meth:`to_dict`."""
        return cls(
            int(d["step"]),
            _Named("gradient", {k: TensorStats.from_dict(v) for k, v in d["gradients"].items()}),
            _Named("activation", {k: TensorStats.from_dict(v) for k, v in d["activations"].items()}),
        )


class _Named(dict):
    """A ``{name: TensorStats}`` dict, indexed by the names of one rule in every backend: from
    the model down, without the model's own name (``l1.weight`` in torch, ``l1/kernel`` in
    Keras and JAX; the layer ``l1`` everywhere). A key that is not a name resolves when exactly
    one name matches it part for part, ``.`` and ``/`` alike: its trailing parts (a bare layer
    or weight name, ``"fc1"`` for ``"mlp/fc1"``), or with a prefix (``"sequential/l1"``, a
    Keras ``layer.path``). A missing or ambiguous key names the ones there are."""

    __slots__ = ("kind",)

    def __init__(self, kind: str, items: Mapping[str, Any]) -> None:
        super().__init__(items)
        self.kind = kind

    def __missing__(self, key: Any) -> Any:
        want = tuple(re.split(r"[./]", str(key)))
        n = len(want)
        found = [
            name for name in self
            if (parts := tuple(re.split(r"[./]", name)))[-n:] == want or want[-len(parts):] == parts
        ]
        if len(found) == 1:
            return self[found[0]]
        if found:
            raise KeyError(f"{self.kind} name {key!r} is ambiguous: write one of {', '.join(found)}.")
        # closest first, by whole names and by any run of as many parts as the key has
        tails: dict[str, str] = {}
        for name in self:
            parts = re.split(r"[./]", name)
            for i in range(max(len(parts) - n + 1, 1)):
                tails.setdefault("/".join(parts[i:i + n]), name)
        close = difflib.get_close_matches(str(key), list(self), n=1, cutoff=0.3)
        close = close or [tails[t] for t in difflib.get_close_matches("/".join(want), tails, n=1, cutoff=0.3)]
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"no {self.kind} named {key!r}.{hint} Names: {', '.join(self) or 'none'}.")

    def __reduce__(self) -> Any:  # pickles as the plain dict it is
        return (dict, (dict(self),))


def check_scale(scale: Any) -> float:
    """A host ``scale`` for the statistics, checked: a finite number > 0 (not a bool).

    Returns:
        The scale as a float.

    Raises:
        ValueError: anything else, naming what was given.
    """
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float, np.number))
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}.")
    return float(scale)


def reference_stats(x: Any, scale: float = 1.0, formats: Any = ()) -> TensorStats:
    """The statistics of ``x`` computed in NumPy: the reference every backend matches.

    Args:
        x: array-like of any floating dtype and shape (read as float32).
        scale: float > 0, the scale the range counts are taken at.
        formats: block formats whose quantization error to take (:func:`check_formats`:
            a name or names of :data:`BLOCK_FORMATS`); none by default.

    Returns:
        :class:`TensorStats`.

    Raises:
        ValueError: ``scale`` is not a finite number > 0, or an unknown block format.

    Example:
        >>> s = reference_stats([2.0**-k for k in range(41)], scale=1.0)
        >>> s.counts["float16_flush"], s.counts["float16_subnormal"]
        (16, 10)

        In MXFP8 a block's elements more than 2**17 below its largest one round to 0:

        >>> s = reference_stats([1.0, 2.0**-20, 0.5, 0.0], formats="mxfp8")
        >>> s.underflow("mxfp8"), s.relative_mse("mxfp8") < 1e-11
        (0.333..., True)
    """
    scale = check_scale(scale)
    formats = check_formats(formats)
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x).reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        v = a * np.float32(scale)
    finite = np.isfinite(a)
    counts = {"zeros": int(np.sum(a == 0)), "nonfinite": int(np.sum(~finite))}
    for t in TARGETS:
        lim = LIMITS[t]
        with np.errstate(invalid="ignore"):
            counts[f"{t}_overflow"] = int(np.sum(v >= np.float32(lim.overflow_at)))
            counts[f"{t}_subnormal"] = int(
                np.sum((v > np.float32(lim.flush_at)) & (v < np.float32(lim.subnormal_below)))
            )
            counts[f"{t}_flush"] = int(np.sum((a > 0) & (v <= np.float32(lim.flush_at))))
    nonzero = a[a > 0]
    amax = float(np.max(a)) if a.size else 0.0
    if a.size and np.isnan(a).any():
        amax = math.nan
    block_counts, block_sums = block_error_arrays(_padded_magnitudes(x), formats) if formats else ([], [])
    counts.update(zip(count_fields(formats)[len(COUNT_FIELDS):], map(int, block_counts), strict=True))
    return TensorStats(
        int(a.size),
        float(scale),
        amax,
        float(np.min(nonzero)) if nonzero.size else math.inf,
        counts,
        dict(zip(magnitude_fields(formats)[2:], map(float, block_sums), strict=True)),
    )


def _padded_magnitudes(x: np.ndarray) -> np.ndarray:
    """``|x|`` as :func:`block_layout`'s float32 ``(rows, padded columns)``, zeros after the
    last column: what every backend hands :func:`block_error_arrays`."""
    rows, cols, padded = block_layout(x.shape)
    a = np.abs(x).reshape(rows, cols)
    return np.pad(a, ((0, 0), (0, padded - cols)))


def layer_of(tensor: str) -> str:
    """A parameter's layer: its name less the last part, in any backend's spelling
    (``l1.weight``, ``l1/kernel``, ``l1/w1`` -> ``l1``; ``w1`` -> ``w1``)."""
    cut = max(tensor.rfind("."), tensor.rfind("/"))
    return tensor[:cut] if cut > 0 else tensor


def top_layer(name: str) -> str:
    """The top-level layer of a parameter or layer name (``attn.q.weight``, ``attn/query``
    -> ``attn``): how the frameworks' names line up in reports."""
    return re.split(r"[./]", name, maxsplit=1)[0]


def first_nonfinite(stats: Mapping[str, Any] | None) -> tuple[str, str, str] | None:
    """``(phase, layer, tensor)`` of a step's first non-finite tensor from its statistics
    (:meth:`StepStats.to_dict`, as a step log holds them): the first layer output in forward
    order with a non-finite element, else the first gradient in backward order (the
    parameters' order reversed); None when every counted tensor is finite or there are none.
    """
    st = stats or {}
    for name, t in (st.get("activations") or {}).items():
        if (t.get("counts") or {}).get("nonfinite"):
            return "forward", name, name
    for name, t in reversed(list((st.get("gradients") or {}).items())):
        if (t.get("counts") or {}).get("nonfinite"):
            return "backward", layer_of(name), name
    return None


def first_nonfinite_gradient(
    names: Sequence[str], finite: Sequence[bool]
) -> tuple[str, str, str] | None:
    """``("backward", layer, tensor)`` of the first non-finite gradient in backward order (the
    parameters' order reversed), from one finite flag per gradient; None when all are finite.

    What a step log names on a logged step without statistics (the same rule as
    :func:`first_nonfinite` without the activations, which only statistics steps record).

    Args:
        names: the gradients' names, in the parameters' order (as the statistics name them).
        finite: one bool per name: the gradient has no inf or NaN.

    Raises:
        ValueError: ``names`` and ``finite`` differ in length.
    """
    if len(names) != len(finite):
        raise ValueError(f"{len(names)} gradient names but {len(finite)} finite flags.")
    for name, ok in zip(reversed(list(names)), reversed(list(finite)), strict=True):
        if not ok:
            return "backward", layer_of(name), name
    return None


def output_leaves(
    out: Any, name: str, is_floating: Callable[[Any], bool]
) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for each floating tensor of a layer's output, named by the one rule
    every backend uses: the layer's name for a tensor, ``name.0`` / ``name.key`` for the items
    of a tuple, list or dict (nested: ``name.0.key``).

    Args:
        out: a layer's output (a tensor, or tuples, lists and dicts of them).
        name: the layer's name.
        is_floating: the backend's test for a floating tensor (False for anything else).
    """
    if isinstance(out, (tuple, list)):
        for i, o in enumerate(out):
            yield from output_leaves(o, f"{name}.{i}", is_floating)
    elif isinstance(out, Mapping):
        for k, o in out.items():
            yield from output_leaves(o, f"{name}.{k}", is_floating)
    elif is_floating(out):
        yield name, out
