"""Dtype traces: which ops of a training step ran in which dtype, in one framework-neutral form.

Framework-free. Each backend's ``trace`` module records one step (torch from a dispatch mode,
JAX from the step's jaxpr, TensorFlow from the traced graph) as :class:`OpRecord` s whose op
names are mapped onto :data:`OPS`, the shared vocabulary; this module summarizes a trace and
lines traces of several frameworks up (:func:`diff`).

The compute dtype of an op (:func:`compute_dtype`) is the dtype its maths runs in: the dtype of
its floating inputs when they agree (a float16 matmul with a float32 accumulator, as JAX's
``preferred_element_type`` or a GPU's tensor cores do, is a float16 matmul), else the dtype of
its floating output; a cast's is its output dtype.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "FLOAT8_DTYPES",
    "FP8_SCOPES",
    "FLOAT_DTYPES",
    "HALF_DTYPES",
    "KERAS_NOTES",
    "OPS",
    "PHASES",
    "PLUMBING",
    "DiffRow",
    "OpRecord",
    "Trace",
    "compute_dtype",
    "diff",
    "fp8_cast_op",
    "fp8_scope",
]

#: Why Keras runs an op in a dtype other than the recipe's, on every engine: ``{op: (dtype,
#: why)}`` (the TensorFlow backend's notes, and each Keras engine's in ``unimp compare``).
KERAS_NOTES = {
    "softmax": ("float32", "keras.ops.dot_product_attention (MultiHeadAttention) takes it in float32"),
    "layer_norm": ("float32", "Keras normalizes float16/bfloat16 inputs in float32"),
    "batch_norm": ("float32", "Keras normalizes float16/bfloat16 inputs in float32"),
}

#: The shared op vocabulary: every backend maps its native op names onto these; an op with
#: no entry keeps its framework name.
OPS = (
    "matmul",
    "conv",
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "exp",
    "log",
    "pow",
    "sqrt",
    "rsqrt",
    "tanh",
    "sigmoid",
    "relu",
    "gelu",
    "softmax",
    "log_softmax",
    "cross_entropy",
    "layer_norm",
    "rms_norm",
    "batch_norm",
    "dropout",
    "reduce_sum",
    "reduce_mean",
    "reduce_max",
    "maximum",
    "minimum",
    "select",
    "compare",
    "is_finite",
    "cast",
    "copy",
    "reshape",
    "transpose",
    "broadcast",
    "concat",
    "slice",
    "gather",
    "fill",
    "random",
    "assign",
    "optimizer_update",
    "all_reduce",
    "fp8_quantize",
    "fp8_dequantize",
    "fp8_amax",
    "fp8_scale_update",
)
#: Scopes the float8 rule (:mod:`unimp.fp8`) runs its amax reduction and its scale update in
#: (a JAX ``named_scope``, a TensorFlow ``name_scope``, a marker torch's trace reads): the ops
#: inside (their maths; casts, compares and selects keep their names) are recorded under the
#: scope's name (:func:`fp8_scope`), in the layer the rule serves.
FP8_SCOPES = ("fp8_amax", "fp8_scale_update")
#: float8 formats (:mod:`unimp.fp8`): a cast into one is ``fp8_quantize``, out of one
#: ``fp8_dequantize`` (:func:`fp8_cast_op`), in every backend's trace.
FLOAT8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
#: Where in the step an op ran.
PHASES = ("forward", "backward", "update")
FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")
HALF_DTYPES = ("bfloat16", "float16")
_RANK = {d: i for i, d in enumerate(("float16", "bfloat16", "float32", "float64"))}
#: Ops listed in a trace but left out of dtype summaries, and that keep their own name inside
#: a library function or layer a backend names an op after (JAX's ``jax.nn.softmax``,
#: Keras's ``LayerNormalization``): casts, data movement, random bits, and the comparisons /
#: selects of masks and finiteness checks (no rounding happens in them).
PLUMBING = frozenset(
    {"cast", "fp8_quantize", "fp8_dequantize", "reshape", "transpose", "broadcast", "copy", "slice", "concat", "gather", "fill",
     "assign", "compare", "select", "is_finite", "random"}
)  # fmt: skip


def _is_float(dtype: str) -> bool:
    return dtype.startswith("float") or dtype == "bfloat16"


def compute_dtype(op: str, inputs: Sequence[str], outputs: Sequence[str]) -> str:
    """The dtype an op computes in (see the module docstring).

    Args:
        op: canonical op name (``"cast"`` takes its output dtype).
        inputs, outputs: canonical dtype names of the op's operands and results.

    Returns:
        A dtype name; the first non-floating dtype for an op with no floating operand or
        result (``"int32"``, ``"bool"``), or ``""`` for an op with neither.
    """
    fin = [d for d in inputs if _is_float(d)]
    fout = [d for d in outputs if _is_float(d)]
    if op == "cast" and fout:
        return fout[0]
    if fin and len(set(fin)) == 1:
        return fin[0]
    if fout:
        return fout[0]
    if fin:  # mixed floating inputs, no floating output (a comparison): the widest input
        return max(fin, key=lambda d: _RANK.get(d, -1))
    rest = list(outputs) + list(inputs)
    return rest[0] if rest else ""


def fp8_cast_op(op: str, inputs: Sequence[str], outputs: Sequence[str]) -> str:
    """A cast's name in a float8 trace: ``"fp8_quantize"`` when it casts into a float8 format
    (the rounding step of :func:`unimp.fp8.quantize_arrays`), ``"fp8_dequantize"`` when it
    casts a float8 tensor back to a wider dtype; any other op keeps ``op``. One rule for every
    backend (applied by :class:`OpRecord`)."""
    if op != "cast":
        return op
    if any(d in FLOAT8_DTYPES for d in outputs):
        return "fp8_quantize"
    if any(d in FLOAT8_DTYPES for d in inputs):
        return "fp8_dequantize"
    return op


def fp8_scope(parts: Sequence[str]) -> tuple[str | None, list[str]]:
    """Splits the float8 rule's scopes (:data:`FP8_SCOPES`) out of a scope path.

    Args:
        parts: a scope / layer path split into names (``["mlp", "fc1", "fp8_amax", "abs"]``).

    Returns:
        ``(the innermost float8 scope or None, the parts without the float8 scopes)``.
    """
    found = [p for p in parts if p in FP8_SCOPES]
    return (found[-1] if found else None), [p for p in parts if p not in FP8_SCOPES]


@dataclass(frozen=True)
class OpRecord:
    """One op of a traced step.

    Attributes:
        framework: ``torch``, ``tensorflow`` or ``jax``; ``keras-jax``, ``keras-torch`` or
            ``keras-tensorflow``: Keras on that engine (:mod:`unimp.keras`).
        op: the shared name (:data:`OPS`), or the native name where there is none.
        native: the framework's name (``aten.addmm``, ``MatMul``, ``dot_general``).
        layer: the module / layer path the op ran in (``l1``, ``encoder/attn``), ``""``
            where the framework does not say.
        phase: ``forward``, ``backward`` or ``update`` (:data:`PHASES`).
        inputs, outputs: canonical dtype names of the operands / results.
        compute: the compute dtype (:func:`compute_dtype`).
    """

    framework: str
    op: str
    native: str
    layer: str
    phase: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    compute: str = field(default="")

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}.")
        object.__setattr__(self, "op", fp8_cast_op(self.op, self.inputs, self.outputs))
        if not self.compute:
            object.__setattr__(self, "compute", compute_dtype(self.op, self.inputs, self.outputs))

    @property
    def floating(self) -> bool:
        """The op computes in a floating dtype."""
        return _is_float(self.compute)

    @property
    def counted(self) -> bool:
        """Floating maths (not a cast, a data movement, a comparison or a select): what dtype
        summaries and :func:`diff` count."""
        return self.floating and self.op not in PLUMBING

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["inputs"], out["outputs"] = list(self.inputs), list(self.outputs)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OpRecord:
        return cls(
            d["framework"],
            d["op"],
            d["native"],
            d["layer"],
            d["phase"],
            tuple(d["inputs"]),
            tuple(d["outputs"]),
            d.get("compute", ""),
        )


class Trace(Sequence[OpRecord]):
    """The records of one traced step, in execution (or graph) order, with summaries.

    Args:
        records: the :class:`OpRecord` s.
        framework: the backend name.
        recipe: the recipe's name or description, for reports.
    """

    def __init__(self, records: Iterable[OpRecord], framework: str, recipe: str = "") -> None:
        self._records = tuple(records)
        self.framework = framework
        self.recipe = recipe

    def __getitem__(self, i: Any) -> Any:
        return self._records[i]

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[OpRecord]:
        return iter(self._records)

    def __repr__(self) -> str:
        by = dict(self.by_dtype())
        return f"Trace({self.framework}, {len(self)} ops; maths ops by compute dtype {by})"

    def select(
        self, *, op: str | None = None, layer: str | None = None, phase: str | None = None
    ) -> list[OpRecord]:
        """Records matching every given filter (``layer`` matches the path or a prefix ``l1/``)."""
        return [
            r
            for r in self._records
            if (op is None or r.op == op)
            and (phase is None or r.phase == phase)
            and (layer is None or r.layer == layer or r.layer.startswith(layer + "/"))
        ]

    def by_dtype(self, phase: str | None = None) -> Counter:
        """Counted ops (:attr:`OpRecord.counted`: floating maths, not casts, data movement,
        comparisons or selects) per compute dtype; ``len(trace)`` counts every op."""
        return Counter(r.compute for r in self._records if r.counted and phase in (None, r.phase))

    def by_layer(self, phase: str | None = "forward") -> dict[str, Counter]:
        """``{layer: Counter(compute dtype)}`` of counted ops (``""``: outside any layer)."""
        out: dict[str, Counter] = {}
        for r in self._records:
            if r.counted and phase in (None, r.phase):
                out.setdefault(r.layer, Counter())[r.compute] += 1
        return out

    def by_op(self, phase: str | None = None) -> dict[str, Counter]:
        """``{op: Counter(compute dtype)}`` of counted ops."""
        out: dict[str, Counter] = {}
        for r in self._records:
            if r.counted and phase in (None, r.phase):
                out.setdefault(r.op, Counter())[r.compute] += 1
        return out

    def casts(self) -> list[OpRecord]:
        """The dtype conversions (``op == "cast"`` between different floating dtypes)."""
        return [
            r
            for r in self._records
            if r.op == "cast"
            and r.inputs[:1] != r.outputs[:1]
            and all(_is_float(d) for d in r.inputs[:1] + r.outputs[:1])
        ]

    def summary(self) -> dict[str, Any]:
        """Plain JSON-able summary: op counts per phase, per compute dtype, per layer, per op."""
        return {
            "framework": self.framework,
            "recipe": self.recipe,
            "ops": len(self),
            "by_phase": dict(Counter(r.phase for r in self._records)),
            "by_dtype": dict(self.by_dtype()),
            "by_layer": {k: dict(v) for k, v in sorted(self.by_layer(None).items())},
            "by_op": {k: dict(v) for k, v in sorted(self.by_op().items())},
            "casts": len(self.casts()),
        }

    def to_dict(self) -> dict[str, Any]:
        """The summary and every record (``json.dumps``-able)."""
        return {**self.summary(), "records": [r.to_dict() for r in self._records]}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Trace:
        return cls(
            (OpRecord.from_dict(r) for r in d["records"]), d["framework"], d.get("recipe", "")
        )


@dataclass(frozen=True)
class DiffRow:
    """Where traces disagree: one op or layer and the compute dtypes each trace ran it in.

    Attributes:
        kind: ``"op"`` (a shared op name, all layers) or ``"layer"`` (a layer path, all ops).
        key: the op or layer name.
        phase: the phase compared.
        dtypes: ``{trace label: sorted compute dtypes}``; an empty tuple: the trace has no
            such op / layer.
        notes: ``{trace label: why}`` where the backend documents the choice.
    """

    kind: str
    key: str
    phase: str
    dtypes: Mapping[str, tuple[str, ...]]
    notes: Mapping[str, str] = field(default_factory=dict)
    reference: tuple[str, ...] = ()

    def __str__(self) -> str:
        parts, ref = [], []
        for label, ds in self.dtypes.items():
            text = "/".join(ds) if ds else "-"
            note = self.notes.get(label)
            (ref if label in self.reference else parts).append(
                f"{label} {text}" + (f" ({note})" if note else "")
            )
        what = self.key if self.kind == "op" else f"layer {self.key or '(outside layers)'}"
        return f"{what}: {', '.join(parts)}" + (f"  [reference: {', '.join(ref)}]" if ref else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "key": self.key,
            "phase": self.phase,
            "dtypes": {k: list(v) for k, v in self.dtypes.items()},
            "notes": dict(self.notes),
            "reference": list(self.reference),
        }


def _top(layer: str) -> str:
    return layer.split("/", 1)[0]


def diff(
    traces: Mapping[str, Trace],
    *,
    reference: Mapping[str, Trace] | None = None,
    phase: str = "forward",
    notes: Mapping[str, Mapping[str, tuple[str, str]]] | None = None,
) -> list[DiffRow]:
    """Lines traces up and keeps what differs: per shared op and per top-level layer.

    An op (or layer) is listed when two traces or more have it and the sets of compute dtypes
    it ran in differ between those that have it; a trace without it shows ``-`` (torch folds
    the bias into ``addmm``: no ``add``), and an op or layer only one trace has (TensorFlow's
    ``SquaredDifference``, Keras's ``Add`` layer) is left out. Counted ops only (no casts, no
    data movement, no comparisons).

    Args:
        traces: ``{label: Trace}`` compared with each other, e.g. ``{"torch": ..., "tensorflow":
            ..., "jax": ...}``.
        reference: ``{label: Trace}`` shown beside each row but not compared (a float32 run).
        phase: which phase to compare (``forward`` by default: where the recipes differ).
        notes: ``{label: {op or layer: (dtype, why)}}``: a backend's explanation of running an op
            in ``dtype`` (each backend's ``trace.NOTES``), shown where the op ran in it.

    Returns:
        :class:`DiffRow` s: ops first (in vocabulary order), then layers (sorted).

    Raises:
        ValueError: ``phase`` is not one of :data:`PHASES`, or fewer than two traces.
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}.")
    if len(traces) < 2:
        raise ValueError(f"diff needs two traces or more, got {len(traces)}.")
    notes = notes or {}
    everything = {**traces, **(reference or {})}
    rows: list[DiffRow] = []
    for kind in ("op", "layer"):
        per: dict[str, dict[str, set[str]]] = {}
        for label, t in everything.items():
            for r in t:
                if r.counted and r.phase == phase:
                    key = r.op if kind == "op" else _top(r.layer)
                    per.setdefault(key, {}).setdefault(label, set()).add(r.compute)
        order = sorted(per, key=lambda k: (OPS.index(k) if k in OPS else len(OPS), k))
        for key in order:
            found = per[key]
            if kind == "layer" and not key:
                continue  # "outside any layer" is not a layer: compared as ops instead
            # compared among the traces that have it: torch folding the bias into addmm (no
            # "add") is a different op sequence, not a different dtype
            sets = {frozenset(found[label]) for label in traces if label in found}
            if sum(1 for label in traces if label in found) < 2 or len(sets) == 1:
                continue  # one trace's own op / layer, or the same dtypes wherever it ran
            dtypes = {
                label: tuple(sorted(found.get(label, ()), key=lambda d: _RANK.get(d, 9)))
                for label in everything
            }
            why = {}
            for label in traces:  # a float32 reference needs no reason for float32
                dtype, text = notes.get(label, {}).get(key, ("", ""))
                if dtype in dtypes[label]:
                    why[label] = text
            rows.append(DiffRow(kind, key, phase, dtypes, why, tuple(reference or ())))
    return rows
