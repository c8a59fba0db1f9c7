"""The dtype Policy: which dtype parameters are stored in, computed in, and returned in.

Framework-free. Names from jmp, Keras, Apex, PyTorch Lightning and Hugging Face Accelerate are
parsed into one :class:`Policy`.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, fields
from typing import Any

from unimp.dtypes import DTYPE_ALIASES, HALF_DTYPES, canonical_dtype
from unimp.overrides import match_overrides, normalize_overrides
from unimp.precision import check_matmul_precision
from unimp.rounding import check_update_mode

__all__ = ["Policy", "get_policy", "policy_names"]


@dataclass(frozen=True)
class Policy:
    """A mixed-precision dtype policy.

    Attributes:
        param_dtype: dtype the parameters (master weights) are stored and updated in.
        compute_dtype: dtype the forward and backward maths run in.
        output_dtype: dtype the model's floating outputs are cast to (the loss is computed
            from them). It is a cast of the outputs, not the dtype of the output layer: every
            layer, the last one included, computes in ``compute_dtype``, and the result is
            cast, in every backend (torch wraps ``forward``, Keras ``call`` at ``prepare``, JAX
            ``mp.apply``), as jmp's ``cast_to_output``. So one recipe is one computation
            everywhere. A layer that must compute in float32 (the Keras guide's float32 softmax)
            says so itself (Keras: ``dtype=mp.output_dtype_policy``), or through ``overrides``.
        overrides: per-layer policies, ``((pattern, Policy), ...)`` sorted by pattern; accepts a
            dict ``{pattern: policy_or_dtype}`` (e.g. ``{"head": "float32", "*norm*":
            "float32"}``). Patterns are fnmatch globs over dotted layer / parameter paths that
            cover a path or its dotted prefix; a dtype ``d`` means ``Policy(param_dtype, d,
            d)``; patterns matching one path must agree. The rule is :mod:`unimp.overrides`;
            :meth:`policy_for` applies it to one path.
        matmul_precision: internal precision of float32 matmuls and convolutions during
            unimp's train step and ``mp.autocast()``: ``"highest"``, ``"high"``, ``"medium"``
            (torch's names; :data:`unimp.precision.MATMUL_PRECISION_TABLE` maps them to each
            framework), or ``None`` (default): the framework's own setting, as before.
        reduce_dtype: dtype the gradients are all-reduced in across data-parallel replicas
            (cast before the all-reduce, back after it), or ``None`` (default): the
            gradients' own dtype, as before.
        accum_dtype: dtype ``grad_accum_steps`` sums the micro-batch gradients in, or
            ``None`` (default): float32, or the parameters' dtype when wider, as before.
        update: how a half-precision parameter takes its update (:mod:`unimp.rounding`):
            ``"nearest"`` (default: rounded to nearest, as every framework does),
            ``"kahan"`` (Kahan-compensated, a compensation buffer in the parameter's dtype,
            as the ``optimi`` optimizers for torch) or ``"stochastic"`` (stochastic rounding
            from a counter-based hash, bfloat16 parameters only, as torchao's
            ``bf16_stochastic_round``). Only for half parameters (pure ``bf16-true``
            training): float32 master weights take every update as float32 rounds it, so
            the other modes are refused there.

    The dtype fields hold canonical dtype names (``"float64"``, ``"float32"``, ``"float16"``,
    ``"bfloat16"``); any spelling :func:`unimp.dtypes.canonical_dtype` accepts is normalised
    on construction. ``str(policy)`` parses back to an equal policy with :func:`get_policy`
    (the optional fields appear only when set: ``...,matmul=highest,reduce=bfloat16,accum=float32``).

    Raises:
        ValueError: a field is not a supported floating dtype, ``matmul_precision`` or
            ``update`` is not one of the names (the message lists them), or ``update`` is
            not ``"nearest"`` with parameters that are not half precision.

    Example:
        >>> p = Policy("f32", "bf16", "f32")
        >>> str(p)
        'params=float32,compute=bfloat16,output=float32'
        >>> get_policy(str(p)) == p
        True
    """

    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    output_dtype: str = "float32"
    matmul_precision: str | None = None
    reduce_dtype: str | None = None
    accum_dtype: str | None = None
    update: str = "nearest"
    overrides: tuple[tuple[str, Policy], ...] = ()

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype", "reduce_dtype", "accum_dtype"):
            value = getattr(self, field)
            if value is None and field in _OPTIONAL:
                continue
            try:
                canonical = canonical_dtype(value)
            except ValueError as e:
                raise ValueError(f"Policy.{field}: {e}") from None
            object.__setattr__(self, field, canonical)
        precision = check_matmul_precision(self.matmul_precision, "Policy.matmul_precision")
        object.__setattr__(self, "matmul_precision", precision)
        object.__setattr__(self, "update", _check_update(self.update, self.param_dtype))
        object.__setattr__(self, "overrides", normalize_overrides(
            self.overrides, lambda pattern, value: _override_policy(pattern, value, self.param_dtype)
        ))

    def __str__(self) -> str:
        base = f"params={self.param_dtype},compute={self.compute_dtype},output={self.output_dtype}"
        base += "".join(
            f",{key}={getattr(self, field)}"
            for field, key in _OPTIONAL.items()
            if getattr(self, field) != _OPTIONAL_DEFAULTS.get(field)
        )
        return base + "".join(f";{p}:{_override_text(self, v)}" for p, v in self.overrides)

    def __repr__(self) -> str:
        # the dataclass repr, leaving out fields at their defaults after the three dtypes (so a
        # policy without overrides reads as it always has)
        shown = [
            f"{f.name}={getattr(self, f.name)!r}"
            for i, f in enumerate(dataclasses.fields(self))
            if f.repr and (i < 3 or getattr(self, f.name) != f.default)
        ]
        return f"Policy({', '.join(shown)})"

    def policy_for(self, path: str) -> Policy:
        """The policy a layer or parameter at dotted ``path`` runs under.

        The override covering ``path`` (see :mod:`unimp.overrides`), else this policy without
        its overrides.

        Raises:
            ValueError: two patterns cover ``path`` with different policies.

        Example:
            >>> p = Policy("float32", "float16", "float32", overrides={"head": "float32"})
            >>> p.policy_for("head.weight").compute_dtype, p.policy_for("body").compute_dtype
            ('float32', 'float16')
        """
        hit = match_overrides(self.overrides, path)
        return hit[1] if hit is not None else dataclasses.replace(self, overrides=())

    @property
    def is_mixed(self) -> bool:
        """True when compute runs in a half dtype while parameters are stored wider."""
        return self.compute_dtype in HALF_DTYPES and self.param_dtype not in HALF_DTYPES

    @property
    def is_float32(self) -> bool:
        """True when every dtype is float32: the recipe changes nothing."""
        return self.param_dtype == self.compute_dtype == self.output_dtype == "float32" and all(
            v.is_float32 for _, v in self.overrides
        )

    def with_(self, **changes: Any) -> Policy:
        """A copy with some fields replaced (``param_dtype=``, ``compute_dtype=``, ``output_dtype=``,
        ``overrides=``, ...); dtype values of the overrides are resolved again only when
        ``overrides`` is given."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        unknown = set(changes) - set(values)
        if unknown:
            raise TypeError(
                f"unknown Policy field(s) {sorted(unknown)}; fields are {sorted(values)}"
            )
        values.update(changes)
        return Policy(**values)


#: The optional fields and their keys in ``str(policy)``, written there only when they differ
#: from their default (``None``: as before; ``update``: ``"nearest"``).
_OPTIONAL = {
    "matmul_precision": "matmul",
    "reduce_dtype": "reduce",
    "accum_dtype": "accum",
    "update": "update",
}
_OPTIONAL_DEFAULTS = {"update": "nearest"}


def _check_update(mode: Any, param_dtype: str) -> str:
    """``Policy.update`` checked against the parameters' dtype (see :class:`Policy`)."""
    try:
        mode = check_update_mode(mode, param_dtype if param_dtype in HALF_DTYPES else None)
    except ValueError as e:
        raise ValueError(f"Policy.update: {e}") from None
    if mode != "nearest" and param_dtype not in HALF_DTYPES:
        raise ValueError(
            f"Policy.update={mode!r} is for half-precision parameters (pure bfloat16 training, "
            f"'bf16-true,update={mode}'); these parameters are {param_dtype} (master weights), "
            "which take every update as float32 rounds it, so no compensation or stochastic "
            "rounding is needed: drop update=, or use the recipe 'bf16-kahan' / 'bf16-stochastic'."
        )
    return mode


_F32 = "float32"
_F16 = "float16"
_BF16 = "bfloat16"
_F64 = "float64"

# Keras names, Apex opt levels, Lightning precision strings, Accelerate mixed_precision values.
# Keras's mixed policies return the compute dtype from layers; unimp casts the model output to
# float32 so the loss and a final softmax run in float32.
_NAMED: dict[str, Policy] = {
    # Keras
    "mixed_float16": Policy(_F32, _F16, _F32),
    "mixed_bfloat16": Policy(_F32, _BF16, _F32),
    # Apex amp opt levels (O2 keeps float32 master weights in the optimizer; O3 is pure float16)
    "O0": Policy(_F32, _F32, _F32),
    "O1": Policy(_F32, _F16, _F32),
    "O2": Policy(_F32, _F16, _F32),
    "O3": Policy(_F16, _F16, _F16),
    # PyTorch Lightning precision
    "16-mixed": Policy(_F32, _F16, _F32),
    "bf16-mixed": Policy(_F32, _BF16, _F32),
    "32-true": Policy(_F32, _F32, _F32),
    "16-true": Policy(_F16, _F16, _F16),
    "bf16-true": Policy(_BF16, _BF16, _BF16),
    # unimp: pure bfloat16 whose updates are Kahan-compensated / stochastically rounded
    "bf16-kahan": Policy(_BF16, _BF16, _BF16, update="kahan"),
    "bf16-stochastic": Policy(_BF16, _BF16, _BF16, update="stochastic"),
    "64-true": Policy(_F64, _F64, _F64),
    "16": Policy(_F32, _F16, _F32),
    # Lightning's legacy "bf16" and Accelerate's "fp16"/"bf16" are mixed (float32 params),
    # so these names win over the dtype aliases of the same spelling.
    "bf16": Policy(_F32, _BF16, _F32),
    "32": Policy(_F32, _F32, _F32),
    "64": Policy(_F64, _F64, _F64),
    # Hugging Face Accelerate mixed_precision
    "no": Policy(_F32, _F32, _F32),
    "fp16": Policy(_F32, _F16, _F32),
}

#: why float8 with float16 compute is refused, by name (``transformer-engine-float16``) and in a
#: recipe (a file's ``mixed_float16`` policy with an ``[fp8]`` table) alike: one rule
FP8_FLOAT16 = (
    "FP8 with float16 compute ('transformer-engine-float16', or a recipe with a float16 policy "
    "and fp8) is not supported: unimp's float8 recipes compute in bfloat16 outside the float8 "
    "matmuls, with no loss scale; use get_recipe('transformer-engine') (bfloat16) or a float16 "
    "recipe without fp8 ('16-mixed')."
)

_UNSUPPORTED = {
    "fp8": "'fp8' is a recipe, not a dtype policy: use unimp.get_recipe('fp8') (its policy is mixed_bfloat16).",
    "fp8-delayed": "'fp8-delayed' is a recipe, not a dtype policy: use unimp.get_recipe('fp8-delayed').",
    "fp8-current": "'fp8-current' is a recipe, not a dtype policy: use unimp.get_recipe('fp8-current').",
    "transformer-engine": "'transformer-engine' is a recipe, not a dtype policy: use unimp.get_recipe('transformer-engine').",
    "transformer-engine-float16": FP8_FLOAT16,
}

_KEYS = {
    "p": "param_dtype",
    "params": "param_dtype",
    "param": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
    "matmul": "matmul_precision",
    "matmul_precision": "matmul_precision",
    "reduce": "reduce_dtype",
    "reduce_dtype": "reduce_dtype",
    "accum": "accum_dtype",
    "accum_dtype": "accum_dtype",
    "update": "update",
}
_KEYS_TEXT = "p|params, c|compute, o|output, matmul, reduce, accum, update"


def policy_names() -> list[str]:
    """The named policies :func:`get_policy` accepts besides dtype names and jmp's grammar."""
    return sorted(_NAMED)


def _suggestions(name: str) -> str:
    candidates = list(_NAMED) + list(DTYPE_ALIASES) + ["half"]
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"{hint} Valid names: dtype names ({', '.join(sorted(DTYPE_ALIASES))}, half), "
        f"named policies ({', '.join(policy_names())}), or jmp's grammar "
        f"'params=float32,compute=float16,output=float32' (keys {_KEYS_TEXT})."
    )


def _dtype(value: str, platform: str | None, name: str) -> str:
    key = value.strip().lower()
    if key == "half":
        return _BF16 if (platform or "").lower() == "tpu" else _F16
    try:
        return canonical_dtype(key)
    except ValueError:
        raise ValueError(
            f"unknown dtype {value!r} in policy {name!r}.{_suggestions(value)}"
        ) from None


def _is_dtype(text: str, platform: str | None, name: str) -> bool:
    """``text`` names a dtype as a whole policy name may (``half``, ``torch.float16``, ...)."""
    try:
        _dtype(text, platform, name)
    except ValueError:
        return False
    return True


_ACCEPTED_OBJECTS = (
    "a policy name (str), unimp.Policy, a Keras DTypePolicy, a jmp Policy or a dtype "
    "(torch.float16, tf.bfloat16, jnp.float16, numpy.float16)"
)


def _framework_policy(obj: Any, platform: str | None) -> Policy:
    """A framework's policy object or dtype as a :class:`Policy` (see :func:`get_policy`)."""
    kind = type(obj).__name__
    if getattr(obj, "quantization_mode", None) is not None:  # Keras QuantizedDTypePolicy
        raise ValueError(
            f"Keras policy {obj.name!r} quantizes weights for inference ({obj.quantization_mode}), "
            "which unimp does not train; for float8 training use unimp.get_recipe('fp8')."
        )
    if hasattr(obj, "default_policy") and hasattr(obj, "variable_dtype"):  # DTypePolicyMap
        if len(obj):
            raise ValueError(
                f"this DTypePolicyMap gives {len(obj)} layer(s) their own policy: write them as "
                f"unimp overrides on its default, e.g. get_policy('{obj.default_policy.name};"
                "head:float32') (patterns match layer names from the model down)."
            )
        return _framework_policy(obj.default_policy, platform)
    if hasattr(obj, "variable_dtype") and isinstance(getattr(obj, "name", None), str):
        return get_policy(obj.name, platform=platform)  # Keras DTypePolicy, tf.keras 2 Policy
    if all(hasattr(obj, f) for f in ("param_dtype", "compute_dtype", "output_dtype")):  # jmp
        try:
            dtypes = [canonical_dtype(getattr(obj, f)) for f in ("param_dtype", "compute_dtype", "output_dtype")]
        except ValueError as e:
            raise ValueError(f"{kind} {obj!r}: {e}") from None
        return Policy(*dtypes)
    if not isinstance(obj, type) and hasattr(type(obj), "__array__") or obj is None or isinstance(obj, (bool, int, float)):
        raise TypeError(f"get_policy takes {_ACCEPTED_OBJECTS}; got {kind}.")
    try:
        dtype = canonical_dtype(obj)
    except (TypeError, ValueError) as e:
        raise TypeError(f"get_policy takes {_ACCEPTED_OBJECTS}; got {kind} {obj!r}: {e}") from None
    return get_policy(dtype, platform=platform)


def get_policy(name: Any, *, platform: str | None = None) -> Policy:
    """Parses a policy name into a :class:`Policy`.

    Accepted forms:

    * jmp's grammar and defaulting rules: ``"params=float32,compute=float16,output=float32"``
      with keys ``p|params``, ``c|compute``, ``o|output``; params default to float32, compute
      follows params, output follows compute. Without ``=``, one dtype for all three
      (``"float16"``, ``"bf16"``, ``"half"``); a float32 name (``"float32"``, ``"f32"``)
      also sets ``matmul_precision="highest"``. The optional keys ``matmul`` (a name of
      :data:`unimp.precision.MATMUL_PRECISIONS`), ``reduce`` and ``accum`` (dtypes) set the
      fields of the same name (``matmul_precision``, ``reduce_dtype``, ``accum_dtype``).
    * Keras: ``mixed_float16``, ``mixed_bfloat16`` (params float32, compute half, output
      float32); plain dtype names give one dtype for all three.
    * Apex opt levels ``O0`` .. ``O3``.
    * PyTorch Lightning precision: ``16-mixed``, ``bf16-mixed``, ``32-true``, ``16-true``,
      ``bf16-true``, ``64-true`` and the legacy ``16``, ``bf16``, ``32``, ``64``.
    * Hugging Face Accelerate: ``no``, ``fp16``, ``bf16``.
    * The frameworks' own objects, read without importing a framework: a Keras
      ``DTypePolicy`` (``keras.mixed_precision.Policy("mixed_float16")``, tf.keras 2's
      ``Policy``) by its name; a jmp ``Policy`` by its three dtypes; a dtype (``torch.float16``,
      ``tf.bfloat16``, ``jnp.float16``, a NumPy dtype) as the dtype's name.
    * Per-layer overrides, as ``str(policy)`` writes them: any of the above followed by
      ``;pattern:value`` clauses, ``"mixed_float16;head:float32;*norm*:float32"``, where a value
      is a dtype or a policy in jmp's grammar (see :mod:`unimp.overrides`).

    Note that ``"bf16"`` and ``"fp16"`` follow Lightning and Accelerate (mixed, float32
    params) rather than meaning one dtype for all three; write ``"bfloat16"`` / ``"float16"``
    or ``"p=bf16"`` for pure half precision.

    Args:
        name: the policy name, a :class:`Policy` (returned unchanged), or a framework's
            policy object or dtype.
        platform: ``"tpu"`` makes ``"half"`` mean bfloat16; otherwise it means float16.

    Returns:
        The parsed :class:`Policy`.

    Raises:
        ValueError: unknown name or dtype; the message names the closest valid name. For
            ``fp8`` and the other FP8 recipe names, says to use :func:`unimp.get_recipe`.
        TypeError: ``name`` is none of those (an array, ``None``, ...).
        ValueError: a Keras ``DTypePolicyMap`` with per-layer entries or a quantized Keras
            policy (the message names what to write instead).

    Example:
        >>> get_policy("c=f16")
        Policy(param_dtype='float32', compute_dtype='float16', output_dtype='float16')
        >>> get_policy("mixed_bfloat16")
        Policy(param_dtype='float32', compute_dtype='bfloat16', output_dtype='float32')
    """
    if isinstance(name, Policy):
        return name
    if not isinstance(name, str):
        return _framework_policy(name, platform)
    text = name.strip()
    if not text:
        raise ValueError(f"empty policy name.{_suggestions('')}")
    if ";" in text:
        return _parse_overrides(text, platform)
    lower = text.lower()
    if lower in _UNSUPPORTED:
        raise ValueError(_UNSUPPORTED[lower])
    if text in _NAMED:
        return _NAMED[text]
    if lower in _NAMED:
        return _NAMED[lower]
    if text.upper() in ("O0", "O1", "O2", "O3"):
        return _NAMED[text.upper()]
    if "=" not in text:
        if "," in text:
            raise ValueError(
                f"policy {name!r} has ',' but no '=': write key=dtype pairs.{_suggestions(text)}"
            )
        try:
            dtype = _dtype(text, platform, name)
        except ValueError:
            raise ValueError(f"unknown policy {name!r}.{_suggestions(text)}") from None
        # the float32 reference pins true float32 matmuls, so that float32 runs agree across
        # frameworks on a GPU as on a CPU (TF32 is on by default in TensorFlow and JAX)
        return Policy(dtype, dtype, dtype, "highest" if dtype == _F32 else None)
    values: dict[str, str] = {}
    parts = text.split(",")
    head = parts[0].strip()
    base = None  # a named policy with its optional fields set: "mixed_float16,matmul=high"
    if "=" not in head and head.lower() in _UNSUPPORTED:
        raise ValueError(_UNSUPPORTED[head.lower()])
    if "=" not in head and (head in _NAMED or head.lower() in _NAMED or head.upper() in _NAMED):
        base = get_policy(head, platform=platform)
        parts = parts[1:]
    elif "=" not in head and _is_dtype(head, platform, name):  # "float16,matmul=high", "half,..."
        base = get_policy(head, platform=platform)
        parts = parts[1:]
    for part in parts:
        if "=" not in part:
            raise ValueError(
                f"policy {name!r}: part {part.strip()!r} is not key=dtype.{_suggestions(part.strip())}"
            )
        key, _, value = part.partition("=")
        key = key.strip().lower()
        if key not in _KEYS:
            close = difflib.get_close_matches(key, list(_KEYS), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"policy {name!r}: unknown key {key!r}.{hint} Keys are {_KEYS_TEXT}."
            )
        field = _KEYS[key]
        if base is not None and field not in _OPTIONAL:
            raise ValueError(
                f"policy {name!r}: after a named policy only "
                f"{', '.join(k + '=' for k in _OPTIONAL.values())} may follow, got {key}=; or "
                f"write every key ({head!r} is {str(base)!r})."
            )
        if field in values:
            raise ValueError(f"policy {name!r}: {field} given twice.")
        if field == "matmul_precision" and value.strip().lower() == "none":
            values[field] = None  # the string spelling of None: the framework's own setting
        elif field == "matmul_precision":
            values[field] = check_matmul_precision(value, f"policy {name!r}: matmul")
        elif field == "update":
            values[field] = value  # checked (and normalized) with the params' dtype by Policy
        else:
            try:
                values[field] = _dtype(value, platform, name)
            except ValueError:  # name the key; only dtype names fit there, not named policies
                close = difflib.get_close_matches(value.strip().lower(), [*DTYPE_ALIASES, "half"], n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"policy {name!r}: {key}={value.strip()} is not a dtype.{hint} A dtype is one "
                    f"of {', '.join(sorted([*DTYPE_ALIASES, 'half']))}."
                ) from None
    if base is not None:
        return base.with_(**values)
    # jmp's defaulting: params float32, compute follows params, output follows compute.
    param = values.get("param_dtype", _F32)
    compute = values.get("compute_dtype", param)
    output = values.get("output_dtype", compute)
    return Policy(param, compute, output, **{f: values[f] for f in _OPTIONAL if f in values})


def _override_text(parent: Policy, value: Policy) -> str:
    """An override's value in ``str(policy)``: its dtype when it is what that dtype means
    (:mod:`unimp.overrides`), else the full policy in jmp's grammar."""
    d = value.compute_dtype
    if value == Policy(parent.param_dtype, d, d):  # no optional field set: a dtype says it all
        return d
    return str(value)


def _parse_overrides(text: str, platform: str | None) -> Policy:
    """``base;pattern:value;...`` -> a Policy with overrides."""
    base, *clauses = text.split(";")
    parent = get_policy(base, platform=platform)
    pairs = []
    for clause in clauses:
        pattern, sep, value = clause.strip().partition(":")
        if not sep or not pattern.strip() or not value.strip():
            raise ValueError(
                f"policy {text!r}: override {clause.strip()!r} is not pattern:value; write e.g. "
                "'mixed_float16;head:float32'."
            )
        pairs.append((pattern.strip(), value.strip()))
    return parent.with_(overrides=pairs)


#: Policy fields that apply to the whole step (the matmul precision switch, the all-reduce, the
#: gradient accumulation and the optimizer's update), never to one layer: an override that sets
#: one is refused.
_WHOLE_MODEL = ("matmul_precision", "reduce_dtype", "accum_dtype", "update")


def _override_policy(pattern: str, value: Any, parent_param_dtype: str) -> Policy:
    """The checked policy of one ``Policy.overrides`` value (a policy, a policy name or a dtype
    name, which keeps the parent's param dtype); the rules are in :mod:`unimp.overrides`."""
    if isinstance(value, Policy):
        policy = value
    elif isinstance(value, str):
        try:
            d = canonical_dtype(value.strip())
        except ValueError:
            try:
                policy = get_policy(value)
            except ValueError as e:
                raise ValueError(
                    f"Policy.overrides[{pattern!r}]: {value!r} is neither a dtype nor a policy: {e}"
                ) from None
        else:
            policy = Policy(parent_param_dtype, d, d)
    else:
        raise TypeError(
            f"Policy.overrides[{pattern!r}]: a value must be a Policy, a policy name or a dtype "
            f"name like 'float32', got {type(value).__name__}."
        )
    if policy.overrides:
        raise ValueError(
            f"Policy.overrides[{pattern!r}]: an override's policy cannot have overrides of its "
            "own; write each pattern at the top level."
        )
    whole = {
        f: getattr(policy, f) for f in _WHOLE_MODEL if getattr(policy, f) != _OPTIONAL_DEFAULTS.get(f)
    }
    if whole:
        given = ", ".join(f"{f}={v!r}" for f, v in whole.items())
        raise ValueError(
            f"Policy.overrides[{pattern!r}]: an override sets a layer's dtypes only; {given} "
            "applies to the whole step: set it on the top-level policy, and give the override "
            f"its dtypes (e.g. {policy.compute_dtype!r})."
        )
    return policy
