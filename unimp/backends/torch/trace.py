"""torch dtype trace: every aten op of one step, from a ``TorchDispatchMode``.

The mode sees each op as it runs below autograd, with the dtypes autocast gave its operands.
Layers come from module forward hooks (the module path of ``named_modules``); backward ops are
attributed to the module whose forward created their autograd node; ops after the backward
(unscale, clipping, the optimizer, the loss-scale update) are the ``update`` phase.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from unimp.backends.torch.fp8 import SCOPES as _FP8_SCOPES
from unimp.trace import PLUMBING, OpRecord, Trace

__all__ = ["NOTES", "native_op", "trace"]

# aten overload packet name -> shared vocabulary (unimp.trace.OPS)
_NATIVE = {
    "mm": "matmul", "addmm": "matmul", "bmm": "matmul", "baddbmm": "matmul", "matmul": "matmul",
    "linear": "matmul", "_scaled_mm": "matmul", "dot": "matmul",
    "convolution": "conv", "_convolution": "conv", "convolution_backward": "conv",
    "conv2d": "conv", "conv1d": "conv", "mkldnn_convolution": "conv",
    "add": "add", "add_": "add", "sub": "sub", "rsub": "sub", "mul": "mul", "mul_": "mul",
    "div": "div", "div_": "div", "neg": "neg", "exp": "exp", "log": "log", "pow": "pow",
    "sqrt": "sqrt", "rsqrt": "rsqrt", "tanh": "tanh", "tanh_backward": "tanh",
    "sigmoid": "sigmoid", "sigmoid_backward": "sigmoid", "relu": "relu",
    "threshold_backward": "relu", "gelu": "gelu", "gelu_backward": "gelu",
    "_softmax": "softmax", "_softmax_backward_data": "softmax",
    "_log_softmax": "log_softmax", "_log_softmax_backward_data": "log_softmax",
    "nll_loss_forward": "cross_entropy", "nll_loss_backward": "cross_entropy",
    "native_layer_norm": "layer_norm", "native_layer_norm_backward": "layer_norm",
    "_fused_rms_norm": "rms_norm",
    "native_batch_norm": "batch_norm", "_native_batch_norm_legit": "batch_norm",
    "_native_batch_norm_legit_functional": "batch_norm",
    "_native_batch_norm_legit_no_training": "batch_norm",
    "native_batch_norm_backward": "batch_norm",
    "native_dropout": "dropout", "native_dropout_backward": "dropout",
    "sum": "reduce_sum", "mean": "reduce_mean", "amax": "reduce_max", "max": "reduce_max",
    "maximum": "maximum", "minimum": "minimum", "clamp": "minimum", "clamp_min": "maximum",
    "where": "select", "eq": "compare", "ne": "compare", "lt": "compare", "gt": "compare",
    "le": "compare", "ge": "compare", "isfinite": "is_finite", "isinf": "is_finite",
    "isnan": "is_finite", "_amp_foreach_non_finite_check_and_unscale_": "is_finite",
    "_to_copy": "cast", "to": "cast", "copy_": "copy", "clone": "copy",
    "view": "reshape", "_unsafe_view": "reshape", "reshape": "reshape", "flatten": "reshape",
    "unsqueeze": "reshape", "squeeze": "reshape", "expand": "broadcast",
    "t": "transpose", "transpose": "transpose", "permute": "transpose",
    "cat": "concat", "stack": "concat", "slice": "slice", "select": "slice", "split": "slice",
    "gather": "gather", "index": "gather", "embedding": "gather",
    "zeros": "fill", "ones": "fill", "zeros_like": "fill", "ones_like": "fill", "fill_": "fill",
    "full": "fill", "empty": "fill", "empty_like": "fill", "zero_": "fill", "new_zeros": "fill",
    "bernoulli": "random", "bernoulli_": "random", "rand": "random", "randn": "random",
    "linalg_vector_norm": "reduce_sum", "norm": "reduce_sum",
    "lerp": "optimizer_update", "addcmul": "optimizer_update", "addcdiv": "optimizer_update",
}  # fmt: skip
# bookkeeping that computes nothing
_IGNORED = frozenset({"detach", "lift_fresh", "alias", "_local_scalar_dense", "set_", "_has_compatible_shallow_copy_type"})

#: Why torch runs an op in a dtype other than the recipe's compute dtype: ``{op: (dtype, why)}``,
#: shown by :func:`unimp.trace.diff` where the op ran in that dtype. autocast's float32 list
#: differs by device: on CUDA it holds softmax, log_softmax, layer_norm and the losses; on the
#: CPU these follow their input's dtype (a float32 input, e.g. a residual stream promoted by
#: adding a float32 parameter, keeps them in float32).
NOTES = {
    "softmax": ("float32", "autocast's float32 list on CUDA; on CPU its input's dtype"),
    "log_softmax": ("float32", "autocast's float32 list on CUDA; on CPU its input's dtype"),
    "layer_norm": ("float32", "autocast's float32 list on CUDA; on CPU its input's dtype"),
    "cross_entropy": ("float32", "autocast's float32 list"),
    "batch_norm": ("float32", "float32 statistics in torch's kernels"),
}


def native_op(name: str) -> str:
    """The shared name of an aten op (``"addmm"`` -> ``"matmul"``); unknown names are kept.

    ``_foreach_*`` ops (the optimizers' multi-tensor kernels) take their element op's name.
    """
    base = name.removeprefix("_foreach_").rstrip("_") if name.startswith("_foreach_") else name
    return _NATIVE.get(name) or _NATIVE.get(base) or _NATIVE.get(base + "_") or name


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _dtypes(tree: Any) -> tuple[str, ...]:
    """The dtypes of the tensors in an op's (nested) arguments or results, in order."""
    out: list[str] = []
    stack = [tree]
    while stack:  # aten arguments nest tuples, lists (foreach ops) and the kwargs dict
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(_dtype(x))
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
    return tuple(out)


class _Recorder(TorchDispatchMode):
    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names = names
        self.records: list[OpRecord] = []
        self.stack: list[str] = []
        self.node_layer: dict[Any, str] = {}
        self.boundaries: list[set[Any]] = []
        self.backward_seen = False
        self.in_loss = 0  # inside a train step's loss function: the forward pass

    # module hooks: the layer path of forward ops, and which nodes each module created
    def pre(self, module: torch.nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        self.stack.append(name)
        leaves, _ = tree_flatten(args)
        self.boundaries.append(
            {x.grad_fn for x in leaves if isinstance(x, torch.Tensor) and x.grad_fn is not None}
        )

    def post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        name = self.names.get(id(module))
        if name is None or not self.stack:
            return
        self.stack.pop()
        stop = self.boundaries.pop()
        leaves, _ = tree_flatten(out)
        todo = [x.grad_fn for x in leaves if isinstance(x, torch.Tensor) and x.grad_fn is not None]
        while todo:  # inner modules' post hooks ran first: their nodes are already claimed
            node = todo.pop()
            if node is None or node in stop or node in self.node_layer:
                continue
            self.node_layer[node] = name
            todo.extend(n for n, _ in node.next_functions)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _IGNORED or func.namespace not in ("aten", "prims"):
            return out
        node = torch._C._current_autograd_node()
        if node is not None:
            self.backward_seen = True
            phase, layer = "backward", self.node_layer.get(node, "")
        else:
            layer = self.stack[-1] if self.stack else ""
            forward = self.stack or self.in_loss or not self.backward_seen
            phase = "forward" if forward else "update"
        op = native_op(name)
        if _FP8_SCOPES and op not in PLUMBING:  # the float8 rule's amax / scale update maths
            op = _FP8_SCOPES[-1]
        self.records.append(
            OpRecord("torch", op, f"aten.{name}", layer, phase, _dtypes((args, kwargs)), _dtypes(out))
        )
        return out


def _snapshot(step: Any, rec: _Recorder) -> Callable[[], None]:
    """Saves what a train step changes (weights and buffers, the optimizer's parameters and
    state, the loss scale, the scheduler, the step's counters) and sets the step up for a
    trace (no statistics, no step log, the loss function marked as the forward pass);
    returns the function that puts everything back."""
    model, opt = step.model, step.optimizer
    # parameters and buffers themselves, not state_dict(): in module mode (O2) its hook swaps
    # the half parameters for their float32 masters
    tensors = {id(t): (t, t.detach().clone()) for t in (*model.parameters(), *model.buffers())}
    for group in opt.param_groups:
        for p in group["params"]:
            tensors.setdefault(id(p), (p, p.detach().clone()))
    opt_state = copy.deepcopy(opt.state_dict())
    scaler = step.scaler.state_dict()
    scheduler = None if step.scheduler is None else copy.deepcopy(step.scheduler.state_dict())
    saved = {
        k: v for k, v in vars(step).items() if isinstance(v, (int, float, bool, type(None)))
    }
    recorder = vars(step).pop("_recorder", None)  # a traced step is no step of the log
    options = step.options  # nor a statistics step: the trace is of what a plain step runs
    step.options = dataclasses.replace(options, stats_every=None)
    loss_fn = step.loss_fn

    def marked(*args: Any, **kwargs: Any) -> Any:  # every micro-batch's loss is forward
        rec.in_loss += 1
        try:
            return loss_fn(*args, **kwargs)
        finally:
            rec.in_loss -= 1

    step.loss_fn = marked

    def restore() -> None:
        step.loss_fn = loss_fn
        with torch.no_grad():
            for t, old in tensors.values():
                t.copy_(old)
        opt.load_state_dict(opt_state)
        opt.zero_grad(set_to_none=True)
        step.scaler.load_state_dict(scaler)
        if scheduler is not None:
            step.scheduler.load_state_dict(scheduler)
        vars(step).update(saved)
        step.options = options
        if recorder is not None:
            step._recorder = recorder

    return restore


def trace(
    fn: Any, *args: Any, model: torch.nn.Module | None = None, recipe: str = "",
    layers: dict[int, str] | None = None, **kwargs: Any,
) -> Trace:  # fmt: skip
    """Records the ops of one call of ``fn(*args, **kwargs)`` with their dtypes.

    Args:
        fn: a :class:`~unimp.backends.torch.TrainStep` (traced on ``args[0]``, the batch;
            tracing takes no step: the model (parameters and buffers), the optimizer, the loss scale, the
            scheduler, the step's counters and the random state are restored afterwards; the
            traced call computes no statistics and writes no step log), or any callable (run
            once, as it is). The saved state is a copy of the parameters and the optimizer
            state: on a device, tracing needs about that much more memory.
        *args, **kwargs: what ``fn`` is called with.
        model: the module whose layer paths label the ops (a train step's model by default).
        recipe: a label for reports.
        layers: ``{id(module): layer path}`` for modules ``named_modules`` does not name as
            their framework does (Keras-torch's layers, named by :mod:`unimp.keras`); it
            takes the place of ``model``'s names.

    Returns:
        :class:`unimp.trace.Trace`.
    """
    from unimp.backends.torch.step import TrainStep

    if isinstance(fn, TrainStep):
        model = fn.model if model is None else model
    # module paths as the other frameworks write layer paths: "attn/q" for torch's "attn.q"
    names = {id(m): n.replace(".", "/") for n, m in model.named_modules()} if model is not None else {}
    if layers is not None:
        names = dict(layers)
    rec = _Recorder(names)
    restore = _snapshot(fn, rec) if isinstance(fn, TrainStep) else None
    hooks = [
        torch.nn.modules.module.register_module_forward_pre_hook(rec.pre),
        torch.nn.modules.module.register_module_forward_hook(rec.post, always_call=True),
    ]
    # the random state too (dropout draws in the traced call must not shift the run's)
    cuda = sorted(
        {t.device.index or 0 for t in (model.parameters() if model is not None else ()) if t.is_cuda}
    )
    try:
        with torch.random.fork_rng(devices=cuda), rec:
            fn(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
        if restore is not None:
            restore()
    return Trace(rec.records, "torch", recipe)
