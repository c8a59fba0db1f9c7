"""TensorFlow dtype trace: every op of a step's traced graph, with its input and output dtypes.

Nothing runs: the step's ``tf.function`` is traced to a concrete function (or its existing
trace is reused) and its graph is read, with the bodies of conditionals and calls. Layers come
from Keras's name scopes (one per layer call, mapped back to the layer names of the model);
``gradient_tape/`` marks the backward pass, the train step's ``forward/`` scope the forward
pass, and what follows the backward pass is the update.
"""

from __future__ import annotations

import re
from typing import Any

import tensorflow as tf

from unimp.trace import KERAS_NOTES, PLUMBING, OpRecord, Trace, fp8_scope

__all__ = ["NOTES", "native_op", "trace"]

# op type -> shared vocabulary (unimp.trace.OPS)
_NATIVE = {
    "MatMul": "matmul", "BatchMatMulV2": "matmul", "BatchMatMulV3": "matmul", "Einsum": "matmul",
    "Conv2D": "conv", "Conv2DBackpropInput": "conv", "Conv2DBackpropFilter": "conv",
    "Conv1D": "conv", "DepthwiseConv2dNative": "conv", "AddV2": "add", "Add": "add",
    "AddN": "add", "BiasAdd": "add", "BiasAddGrad": "reduce_sum", "Sub": "sub", "Mul": "mul",
    "RealDiv": "div", "DivNoNan": "div", "Neg": "neg", "Exp": "exp", "Log": "log",
    "Log1p": "log", "Pow": "pow", "Square": "pow", "Sqrt": "sqrt", "Rsqrt": "rsqrt",
    "RsqrtGrad": "rsqrt", "SqrtGrad": "sqrt", "Tanh": "tanh", "TanhGrad": "tanh",
    "Sigmoid": "sigmoid", "SigmoidGrad": "sigmoid", "Relu": "relu", "ReluGrad": "relu",
    "Gelu": "gelu", "Softmax": "softmax", "LogSoftmax": "log_softmax",
    "SparseSoftmaxCrossEntropyWithLogits": "cross_entropy",
    "SoftmaxCrossEntropyWithLogits": "cross_entropy", "FusedBatchNormV3": "batch_norm",
    "FusedBatchNormGradV3": "batch_norm", "Sum": "reduce_sum", "Mean": "reduce_mean",
    "Max": "reduce_max", "Maximum": "maximum", "Minimum": "minimum", "SelectV2": "select",
    "Select": "select", "Equal": "compare", "NotEqual": "compare", "Less": "compare",
    "Greater": "compare", "LessEqual": "compare", "GreaterEqual": "compare",
    "IsFinite": "is_finite", "All": "is_finite", "Cast": "cast", "Reshape": "reshape",
    "ExpandDims": "reshape", "Squeeze": "reshape", "Transpose": "transpose",
    "BroadcastTo": "broadcast", "Tile": "broadcast", "ConcatV2": "concat", "Pack": "concat",
    "StridedSlice": "slice", "Slice": "slice", "Split": "slice", "GatherV2": "gather",
    "ResourceGather": "gather", "Fill": "fill", "ZerosLike": "fill", "OnesLike": "fill",
    "StatelessRandomUniformV2": "random", "StatelessRandomGetKeyCounter": "random",
    "RandomUniform": "random", "AssignVariableOp": "assign", "AssignAddVariableOp": "assign",
    "AssignSubVariableOp": "assign", "StopGradient": "copy",
    "ResourceApplyAdam": "optimizer_update",
}  # fmt: skip
# Keras layers whose ops take the layer's name (TensorFlow builds them from primitive ops)
_LAYER_OPS = {
    "LayerNormalization": "layer_norm",
    "BatchNormalization": "batch_norm",
    "RMSNormalization": "rms_norm",
    "Softmax": "softmax",
}
# ops that run function bodies (conditionals, loops, calls): read through
_CALLS = frozenset(
    {"If", "StatelessIf", "While", "StatelessWhile", "PartitionedCall",
     "StatefulPartitionedCall", "Case", "StatelessCase"}
)  # fmt: skip
# graph plumbing that computes nothing, and the calls whose bodies are read instead
_IGNORED = _CALLS | {
    "Placeholder", "Const", "NoOp", "Identity", "IdentityN", "ReadVariableOp", "VarHandleOp",
    "Shape", "ShapeN", "Size", "Rank",
}  # fmt: skip
_SUFFIX = re.compile(r"_\d+$")
_FORWARD = re.compile(r"forward(_\d+)?")
_GRADIENT = re.compile(r"gradient_tape(_\d+)?")

#: Why Keras runs an op in a dtype other than the recipe's: ``{op: (dtype, why)}``.
NOTES = KERAS_NOTES


def native_op(name: str) -> str:
    """The shared name of a TensorFlow op type (``"MatMul"`` -> ``"matmul"``); unknown kept."""
    return _NATIVE.get(name, name)


def _layers(model: Any) -> dict[str, str]:
    """``{layer name: class name}`` of the model and every layer inside it."""
    out: dict[str, str] = {}
    if model is None:
        return out
    stack = [model]
    while stack:
        layer = stack.pop()
        out.setdefault(layer.name, type(layer).__name__)
        inner = getattr(layer, "_flatten_layers", None)
        if callable(inner):
            stack.extend(inner(include_self=False, recursive=False))
    return out


def _dtypes(tensors: Any) -> tuple[str, ...]:
    return tuple(
        t.dtype.name for t in tensors if t.dtype not in (tf.resource, tf.variant)
    )


class _Walker:
    def __init__(self, layers: dict[str, str], root: str | None) -> None:
        self.layers = layers
        self.root = root
        self.pending: list[tuple] = []
        self.functions: dict[str, Any] = {}

    def _layer(self, scopes: list[str]) -> tuple[str, str | None]:
        """The layer path from the name scopes, and the innermost layer's class."""
        if not self.layers:  # no model: the scopes as they are, without uniquifying suffixes
            return "/".join(_SUFFIX.sub("", s) for s in scopes), None
        path, kind = [], None
        for s in scopes:
            name = s if s in self.layers else _SUFFIX.sub("", s)
            if name in self.layers:
                path.append(name)
                kind = self.layers[name]
        if path and path[0] == self.root:
            path = path[1:]
        return "/".join(path), kind

    def _bodies(self, op: Any) -> list[Any]:
        if op.type not in _CALLS:
            return []
        out = []
        for attr in op.node_def.attr.values():
            names = [attr.func.name] if attr.func.name else [f.name for f in attr.list.func]
            for n in names:
                fn = self.functions.get(n)
                if fn is not None:
                    out.append(fn.graph)
        return out

    def walk(self, graph: Any, outer: str | None, outer_phase: str | None) -> None:
        self.functions.update(getattr(graph, "_functions", {}))
        for op in graph.get_operations():
            scopes = op.name.split("/")[:-1]
            phase = outer_phase
            # the scopes of a second micro-batch are uniquified: forward_1, gradient_tape_1
            if scopes and _GRADIENT.fullmatch(scopes[0]):
                phase, scopes = "backward", scopes[1:]
            if scopes and _FORWARD.fullmatch(scopes[0]):
                phase, scopes = phase or "forward", scopes[1:]
            fp8_op, scopes = fp8_scope(scopes)  # the float8 rule's amax / scale update
            layer, kind = self._layer(scopes)
            if outer:
                layer = "/".join(p for p in (outer, layer) if p)
            for body in self._bodies(op):
                self.walk(body, layer, phase)
            if op.type in _IGNORED:
                continue
            name = native_op(op.type)
            if kind in _LAYER_OPS and name not in PLUMBING:
                name = _LAYER_OPS[kind]
            if fp8_op is not None and name not in PLUMBING:
                name = fp8_op
            self.pending.append(
                (name, op.type, layer, phase, _dtypes(op.inputs), _dtypes(op.outputs))
            )

    def records(self) -> list[OpRecord]:
        """Ops outside the named scopes take their phase from where they are: before the
        first backward op, forward; up to the last one, backward (the tape's ``AddN`` that
        sums a gradient used twice); after it, the update."""
        back = [i for i, p in enumerate(self.pending) if p[3] == "backward"]
        first, last = (back[0], back[-1]) if back else (len(self.pending), -1)
        out = []
        for i, (name, native, layer, phase, ins, outs) in enumerate(self.pending):
            if phase is None:
                phase = "forward" if i < first else "backward" if i < last else "update"
            out.append(OpRecord("tensorflow", name, native, layer, phase, ins, outs))
        return out


def trace(fn: Any, *args: Any, model: Any = None, recipe: str = "", **kwargs: Any) -> Trace:
    """Records the ops of one call of ``fn(*args, **kwargs)`` with their dtypes.

    Nothing runs: the function is traced to a graph (a train step's existing trace is reused).

    Args:
        fn: a :class:`~unimp.backends.tensorflow.TrainStep` (traced on ``args[0]``, the batch),
            a ``tf.function``, or a Python function (wrapped in ``tf.function`` to trace it).
        *args, **kwargs: what ``fn`` is called with.
        model: the Keras model whose layer names label the ops (a train step's model by
            default).
        recipe: a label for reports.

    Returns:
        :class:`unimp.trace.Trace`.
    """
    from unimp.backends.tensorflow.step import TrainStep, _batch_to_tensors
    from unimp.step import micro_batches

    if isinstance(fn, TrainStep):
        (batch,) = args
        if fn.grad_accum_steps > 1:
            batch = micro_batches(batch, fn.grad_accum_steps)
        batch = _batch_to_tensors(batch)
        if fn.strategy is not None and not isinstance(batch, tf.distribute.DistributedValues):
            batch = fn._split(batch)
        model = fn.model if model is None else model
        concrete = fn.function.get_concrete_function(batch)
    elif hasattr(fn, "get_concrete_function"):
        concrete = fn.get_concrete_function(*args, **kwargs)
    else:
        concrete = tf.function(fn).get_concrete_function(*args, **kwargs)
    walker = _Walker(_layers(model), getattr(model, "name", None))
    walker.walk(concrete.graph, None, None)
    return Trace(walker.records(), "tensorflow", recipe)
