"""JAX dtype trace: every equation of a step's jaxpr, with its operand and result dtypes.

Nothing runs: the step is traced with ``jax.make_jaxpr``. Layers come from ``jax.named_scope``
(flax modules, or the user's own scopes); ``jvp(...)`` in an equation's name stack marks the
forward pass, ``transpose(...)`` the backward pass, and what follows the backward pass is the
update. JAX has no softmax or layer-norm primitive: equations are named after the library
function they ran in where the traceback shows one (``jax.nn.softmax``, optax's cross-entropy,
flax's ``LayerNorm``), else after the primitive.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jax

from unimp.trace import PLUMBING, OpRecord, Trace, fp8_scope

__all__ = ["NOTES", "native_op", "trace"]

# primitive name -> shared vocabulary (unimp.trace.OPS)
_NATIVE = {
    "dot_general": "matmul", "conv_general_dilated": "conv", "add": "add", "add_any": "add",
    "sub": "sub", "mul": "mul", "div": "div", "neg": "neg", "exp": "exp", "exp2": "exp",
    "log": "log", "log1p": "log", "pow": "pow", "integer_pow": "pow", "sqrt": "sqrt",
    "rsqrt": "rsqrt", "tanh": "tanh", "logistic": "sigmoid", "reduce_sum": "reduce_sum",
    "reduce_max": "reduce_max", "max": "maximum", "min": "minimum", "select_n": "select",
    "eq": "compare", "ne": "compare", "lt": "compare", "gt": "compare", "le": "compare",
    "ge": "compare", "is_finite": "is_finite", "convert_element_type": "cast",
    "reshape": "reshape", "squeeze": "reshape", "expand_dims": "reshape",
    "transpose": "transpose", "broadcast_in_dim": "broadcast", "concatenate": "concat",
    "slice": "slice", "dynamic_slice": "slice", "dynamic_update_slice": "slice",
    "gather": "gather", "scatter-add": "gather", "iota": "fill", "copy": "copy",
    "copy_p": "copy", "random_bits": "random", "random_wrap": "random",
    "random_unwrap": "random", "threefry2x32": "random", "stop_gradient": "copy",
    # collectives under shard_map: sums over replicas are maths, the rest moves or annotates
    "psum": "all_reduce", "pmean": "all_reduce", "pmax": "all_reduce", "pmin": "all_reduce",
    "psum_invariant": "all_reduce", "all_gather": "gather", "all_to_all": "transpose",
    "ppermute": "copy", "pvary": "copy", "axis_index": "fill",
}  # fmt: skip
# library functions an equation ran in: (file suffix, qualified-name pattern, shared name)
_FUNCTIONS = (
    ("jax/_src/nn/functions.py", r"(_)?softmax(_deprecated)?", "softmax"),
    ("jax/_src/nn/functions.py", r"(_)?log_softmax", "log_softmax"),
    ("jax/_src/nn/functions.py", r"relu", "relu"),
    ("jax/_src/nn/functions.py", r"gelu", "gelu"),
    ("jax/_src/nn/functions.py", r"standardize", "layer_norm"),
    ("optax/losses/_classification.py", r".*cross_entropy.*", "cross_entropy"),
    ("flax/linen/normalization.py", r"LayerNorm\..*", "layer_norm"),
    ("flax/linen/normalization.py", r"RMSNorm\..*", "rms_norm"),
    ("flax/linen/normalization.py", r"BatchNorm\..*", "batch_norm"),
    ("flax/nnx/nn/normalization.py", r"LayerNorm\..*", "layer_norm"),
    ("flax/nnx/nn/normalization.py", r"RMSNorm\..*", "rms_norm"),
    ("flax/nnx/nn/normalization.py", r"BatchNorm\..*", "batch_norm"),
)

_TRANSFORM = re.compile(r"[A-Za-z_]\w*\(|\)")

#: Why JAX runs an op in a dtype other than the recipe's: ``{op: (dtype, why)}``.
NOTES = {
    "softmax": ("float32", "jnp.sum accumulates half-precision inputs in float32"),
    "reduce_sum": ("float32", "jnp.sum accumulates half-precision inputs in float32"),
}


def native_op(name: str) -> str:
    """The shared name of a JAX primitive (``"dot_general"`` -> ``"matmul"``); unknown kept."""
    return _NATIVE.get(name, name)


@functools.lru_cache(maxsize=4096)
def _frame_op(file_name: str, function_name: str) -> str | None:
    path = file_name.replace("\\", "/")
    for suffix, pattern, op in _FUNCTIONS:
        if path.endswith(suffix) and re.fullmatch(pattern, function_name):
            return op
    return None


def _library_op(eqn: Any) -> str | None:
    tb = eqn.source_info.traceback
    if tb is None:
        return None
    for frame in tb.frames:  # innermost first: jax.nn.log_softmax inside optax's loss wins
        op = _frame_op(frame.file_name, frame.function_name)
        if op is not None:
            return op
    return None


_DTYPE_NAMES: dict[Any, str | None] = {}


def _dtype(v: Any) -> str | None:
    dtype = getattr(getattr(v, "aval", None), "dtype", None)
    if dtype is None:
        return None
    name = _DTYPE_NAMES.get(dtype)
    if name is None and dtype not in _DTYPE_NAMES:
        name = _DTYPE_NAMES[dtype] = None if str(dtype) == "float0" else str(dtype)
    return name


def _sub_jaxprs(eqn: Any) -> list[Any]:
    out = []
    for value in eqn.params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if hasattr(item, "jaxpr") and hasattr(item, "consts"):  # ClosedJaxpr
                out.append(item.jaxpr)
            elif type(item).__name__ == "Jaxpr":
                out.append(item)
    return out


#: reduce-precision's (exponent bits, mantissa bits) -> the float8 format it rounds to.
_ROUNDED_TO = {(4, 3): "float8_e4m3fn", (5, 2): "float8_e5m2"}


class _Walker:
    def __init__(self) -> None:
        self.records: list[OpRecord] = []
        self.backward_seen = False

    def walk(self, jaxpr: Any, outer_layer: str, outer_phase: str | None, outer_op: str | None) -> None:
        for eqn in jaxpr.eqns:
            stack = str(eqn.source_info.name_stack)
            layer = _TRANSFORM.sub("", stack).strip("/")
            layer = "/".join(p for p in (outer_layer, layer) if p)
            phase = outer_phase
            if "transpose(" in stack:
                phase = "backward"
            elif "jvp(" in stack and phase is None:
                phase = "forward"
            lib = _library_op(eqn) or outer_op
            subs = _sub_jaxprs(eqn)
            if subs:  # pjit, custom_jvp_call, scan, cond, shard_map, ...: record what is inside
                for sub in subs:
                    self.walk(sub, layer, phase, lib)
                continue
            if phase == "backward":
                self.backward_seen = True
            elif phase is None:
                phase = "update" if self.backward_seen else "forward"
            name = eqn.primitive.name
            op = native_op(name)
            if lib is not None and op not in PLUMBING:
                op = lib  # the maths of jax.nn.softmax is softmax; its reshapes stay reshapes
            scope, parts = fp8_scope(layer.split("/"))
            if scope is not None:  # the float8 rule's amax / scale update, in the layer it serves
                layer = "/".join(parts)
                op = scope if op not in PLUMBING else op
            fmt = _ROUNDED_TO.get((eqn.params.get("exponent_bits"), eqn.params.get("mantissa_bits")))
            if name == "reduce_precision" and fmt is not None:
                # the float8 rounding, written in reduce-precision so that XLA keeps it
                # (unimp.backends.jax.fp8.round_fp8): the quantize and dequantize it stands for
                ins = tuple(d for d in map(_dtype, eqn.invars) if d)
                self.records.append(OpRecord("jax", "fp8_quantize", name, layer, phase, ins, (fmt,)))
                self.records.append(OpRecord("jax", "fp8_dequantize", name, layer, phase, (fmt,), ins))
                continue
            self.records.append(
                OpRecord(
                    "jax",
                    op,
                    name,
                    layer,
                    phase,
                    tuple(d for d in map(_dtype, eqn.invars) if d),
                    tuple(d for d in map(_dtype, eqn.outvars) if d),
                )
            )


def trace(fn: Any, *args: Any, recipe: str = "", **kwargs: Any) -> Trace:
    """Records the equations of one call of ``fn(*args, **kwargs)`` with their dtypes.

    Nothing runs and nothing is compiled: the function is traced to a jaxpr.

    Args:
        fn: a :class:`~unimp.backends.jax.TrainStep` (traced on ``args[0]``, the batch, with
            its current params, optimizer and loss-scale state), or any function of arrays.
        *args, **kwargs: what ``fn`` is called with.
        recipe: a label for reports.

    Returns:
        :class:`unimp.trace.Trace`.
    """
    from unimp.backends.jax.step import TrainStep

    if isinstance(fn, TrainStep):
        (batch,) = args
        fn._check_batch(batch)
        state = (fn.params, fn.opt_state, fn.loss_scale, batch)
        if fn._stateful:
            state = (*state, fn.model_state)
        if fn._mesh is None:
            count = fn._traces
            try:
                closed = jax.make_jaxpr(fn._step)(*state)
            finally:
                fn._traces = count  # a look at the step, not a compilation
        else:  # collectives need the mesh: trace the jitted shard_map
            count = fn._traces
            try:
                closed = jax.make_jaxpr(fn._jitted)(*state)
            finally:
                fn._traces = count
    else:
        closed = jax.make_jaxpr(fn)(*args, **kwargs)
    walker = _Walker()
    walker.walk(closed.jaxpr, "", None, None)
    return Trace(walker.records, "jax", recipe)
