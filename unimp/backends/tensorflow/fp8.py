"""TensorFlow FP8: :mod:`unimp.fp8`'s scaling and quantize-dequantize rules on TensorFlow
tensors (they trace under ``tf.function``), and :class:`FP8Dense`, a float8 Keras Dense layer:
emulated by default, with an opt-in native path (XLA-compiled GEMMs of float8 tensors, which XLA's
GPU ``gemm_rewriter`` turns into cuBLASLt float8 GEMMs).

TensorFlow flushes float32 subnormals to zero on CPU: an amax below 2**-126 is recorded as 0
here (see docs/fp8.md); unimp's own rules keep every scale and ``scale_inv`` normal.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.ops.control_flow_v2_func_graphs import (
    ControlFlowFuncGraph as _ControlFlowFuncGraph,
)
from tensorflow.python.ops.gen_resource_variable_ops import (
    assign_variable_op as _assign_variable,
)
from tensorflow.python.ops.gen_resource_variable_ops import (
    read_variable_op as _read_variable,
)

from unimp import fp8 as _fp8
from unimp.attached import attach
from unimp.backends.tensorflow.devices import _capability
from unimp.dtypes import device_support
from unimp.fp8 import FP8State
from unimp.keras import fp8 as _keras_fp8
from unimp.keras.fp8 import add_state_variables, checked_load

_FP8_DTYPES = {
    "float8_e4m3fn": tf.dtypes.experimental.float8_e4m3fn,
    "float8_e5m2": tf.dtypes.experimental.float8_e5m2,
}


class FP8Ops:
    """The FP8 rule's array namespace over TensorFlow tensors."""

    scope = staticmethod(tf.name_scope)  # names the amax and scale-update ops in traces
    where = staticmethod(tf.where)
    isfinite = staticmethod(tf.math.is_finite)
    isnan = staticmethod(tf.math.is_nan)
    isinf = staticmethod(tf.math.is_inf)
    abs = staticmethod(tf.abs)
    floor = staticmethod(tf.floor)
    exp2 = staticmethod(tf.experimental.numpy.exp2)
    log2 = staticmethod(tf.experimental.numpy.log2)

    @staticmethod
    def f32(x: Any) -> tf.Tensor:
        if isinstance(x, (int, float)):
            # through NumPy: TensorFlow caches its constants of Python numbers by value, where
            # 0.0 == -0.0, and served -0.0 for 0.0 after one -0.0
            return tf.constant(np.float32(x))
        return tf.cast(x, tf.float32)

    @staticmethod
    def reciprocal(x: tf.Tensor) -> tf.Tensor:
        # TensorFlow flushes subnormals (FTZ / DAZ): the exact rule, from bits (unimp.fp8.rule)
        return _fp8.ieee_reciprocal(FP8Ops, x)

    @staticmethod
    def bits(x: tf.Tensor) -> tf.Tensor:
        return tf.bitcast(tf.cast(x, tf.float32), tf.int32)

    @staticmethod
    def from_bits(b: tf.Tensor) -> tf.Tensor:
        return tf.bitcast(tf.cast(b, tf.int32), tf.float32)

    @staticmethod
    def to_i32(x: tf.Tensor) -> tf.Tensor:
        return tf.cast(x, tf.int32)

    @staticmethod
    def amax(x: tf.Tensor) -> tf.Tensor:
        # NaN-propagating (by hand: under jit_compile=True XLA's CPU reduce-max drops NaN); 0
        # over no element, as the reference (tf.reduce_max gives -inf there). The size is usually
        # static (a traced batch of known shape): the select is built only where it is known at
        # run time alone
        m = tf.reshape(_max_keeping_nan(x, None), ())
        n = x.shape.num_elements()
        if n is not None:
            return m if n > 0 else tf.zeros((), x.dtype)
        return tf.where(tf.size(x) > 0, m, tf.zeros((), x.dtype))

    @staticmethod
    def push(history: tf.Tensor, amax: tf.Tensor) -> tf.Tensor:
        return tf.concat([tf.reshape(tf.cast(amax, history.dtype), [1]), history[:-1]], 0)

    @staticmethod
    def clip(x: tf.Tensor, lo: float, hi: float) -> tf.Tensor:
        return tf.clip_by_value(x, lo, hi)  # NaN stays NaN

    @staticmethod
    def pow2_floor(x: tf.Tensor) -> tf.Tensor:
        bits = tf.bitwise.bitwise_and(tf.bitcast(x, tf.int32), tf.constant(-0x800000, tf.int32))
        return tf.bitcast(bits, tf.float32)

    @staticmethod
    def to_fp8(x: tf.Tensor, dtype: str) -> tf.Tensor:
        return tf.cast(x, _FP8_DTYPES[dtype])

    @staticmethod
    def to_f32(x: Any) -> tf.Tensor:
        return tf.cast(x, tf.float32)

    @staticmethod
    def round_fp8(x: tf.Tensor, dtype: str) -> tf.Tensor:
        # TensorFlow's graphs keep both casts; under jit_compile=True XLA could fold them on a
        # GPU (openxla/xla#41605), and TensorFlow has no public reduce-precision op (JAX's fix)
        return tf.cast(tf.cast(x, _FP8_DTYPES[dtype]), tf.float32)

    @staticmethod
    def cast_like(x: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
        return tf.cast(x, like.dtype)

    # the block-scaled formats' names (unimp.blockscale)
    @staticmethod
    def round(x: tf.Tensor) -> tf.Tensor:
        return tf.round(x)  # half to even

    @staticmethod
    def reshape(x: tf.Tensor, shape: tuple[int, ...]) -> tf.Tensor:
        return tf.reshape(x, shape)

    @staticmethod
    def amax_axes(x: tf.Tensor, axes: tuple[int, ...]) -> tf.Tensor:
        return _max_keeping_nan(x, list(axes))

    @staticmethod
    def sum(x: tf.Tensor) -> tf.Tensor:
        return tf.reduce_sum(x)

    @staticmethod
    def concat(xs: Any, axis: int) -> tf.Tensor:
        return tf.concat(xs, axis)


def _max_keeping_nan(x: tf.Tensor, axes: list[int] | None) -> tf.Tensor:
    """The max over ``axes`` (``None``: all), kept, NaN wherever a NaN was reduced: under
    ``jit_compile=True`` XLA's CPU reduce-max drops NaN (TensorFlow 2.21, from 16 elements)."""
    m = tf.reduce_max(x, axis=axes, keepdims=True)
    nan = tf.reduce_any(tf.math.is_nan(x), axis=axes, keepdims=True)
    return tf.where(nan, tf.constant(float("nan"), x.dtype), m)


def fp8_initial_state(config: _fp8.FP8Config, device: Any = None) -> FP8State:
    """Scale 1, zero history: an :class:`unimp.fp8.FP8State` of float32 tensors."""
    return fp8_state_from_numpy(FP8State.initial(config), device)


def fp8_state_from_numpy(state: FP8State, device: Any = None) -> FP8State:
    """The same state as float32 tensors (on ``device`` when given)."""
    with tf.device(device) if device is not None else contextlib.nullcontext():
        return FP8State(*(tf.constant(np.asarray(v, np.float32)) for v in
                          (state.scale, state.scale_inv, state.amax_history)))


def fp8_state_to_numpy(state: FP8State) -> FP8State:
    """The state as NumPy float32 (for :func:`unimp.fp8.state_dict`); one host copy."""
    return FP8State(*(np.asarray(tf.convert_to_tensor(v).numpy(), np.float32) for v in
                      (state.scale, state.scale_inv, state.amax_history)))


def fp8_amax(x: tf.Tensor, config: _fp8.FP8Config | None = None) -> tf.Tensor:
    """``max(abs(x))`` as a float32 0-d tensor (NaN-propagating; NaN elements ignored under the ``transformer_engine`` rule of ``config``, as :func:`unimp.fp8.amax_of`)."""
    return _fp8.amax_of(FP8Ops, tf.convert_to_tensor(x), config)


def fp8_step(
    config: _fp8.FP8Config, state: FP8State, amax: tf.Tensor, role: str = "forward"
) -> tuple[tuple[tf.Tensor, tf.Tensor], FP8State]:
    """One step of :func:`unimp.fp8.step_arrays` on tensors (traces under ``tf.function``).

    Returns:
        ``((scale, scale_inv) to quantize this step with, state after the step)``.
    """
    vals = [tf.convert_to_tensor(v) for v in (state.scale, state.scale_inv, state.amax_history)]
    used, new = _fp8.step_arrays(FP8Ops, config, role, *vals, FP8Ops.f32(amax))
    return used, FP8State(*new)


def fp8_quantize_dequantize(x: tf.Tensor, scale: tf.Tensor, scale_inv: tf.Tensor, dtype: str) -> tf.Tensor:
    """:func:`unimp.fp8.qdq_arrays` on a tensor: same shape and dtype as ``x``."""
    return _fp8.qdq_arrays(FP8Ops, tf.convert_to_tensor(x), scale, scale_inv, dtype, _fp8.FP8_MAX[dtype])



_TENSORS, _FIELDS = _fp8.LAYER_TENSORS, _fp8.STATE_FIELDS


def _keras_layer_base() -> type:
    import keras

    return keras.layers.Layer


def _keras_serializable() -> Any:
    import keras

    return keras.saving.register_keras_serializable(package="unimp")


@_keras_serializable()
class FP8Dense(_keras_layer_base()):  # type: ignore[misc]
    """A Keras Dense layer whose matmul is emulated float8 by :mod:`unimp.fp8`'s rule.

    unimp's own layer rather than ``Dense.quantize("float8")``: Keras's float8 path divides by a
    stored divisor and uses its two-steps-late timing, which cannot express unimp's rule (nor be
    matched bit for bit under JAX). The input and the float32 kernel are quantized to the
    forward format with their own scales, the output gradient (as it flows in backward, i.e.
    scaled when a loss scale is on) to the backward format in a ``tf.custom_gradient``; the
    matmul multiplies the float8 values and scales the float32 result once. The scaling states
    are non-trainable float32 variables (``<input|kernel|grad>_<scale|scale_inv|amax_history>``),
    stepped in training calls (traces under ``tf.function``, no host sync); the first call warns
    once that float8 is emulated (:class:`unimp.fp8.FP8EmulationWarning`).

    With ``native`` the three GEMMs run as XLA-compiled matmuls of float8 tensors
    (:func:`_xla_matmul`; the native path of :func:`_fp8_matmul`), which XLA's GPU rewriter runs
    as cuBLASLt float8 GEMMs on sm89+; elsewhere XLA converts them to float32 (emulated, and
    within float32 summation error of the default path, not bit for bit). A layer whose
    dimensions the rule refuses (:data:`unimp.fp8.NATIVE_MULTIPLE`) runs emulated with one
    :class:`unimp.fp8.FP8NativeFallbackWarning` naming it.

    Args:
        units: output features; use_bias: add a bias (in the compute dtype).
        config: a :class:`unimp.fp8.DelayedScaling` (default) or :class:`unimp.fp8.CurrentScaling`.
        native: the native float8 GEMM path; ``None`` (default) reads ``UNIMP_FP8_NATIVE`` at
            construction (``"1"``: on).

    Saved models round-trip (:meth:`get_config` holds ``units``, ``use_bias``, the scaling
    config as its ``to_dict()`` and ``native``; registered as ``"unimp>FP8Dense"``); the
    scaling states are variables, saved with the weights, and checked when loaded
    (``set_weights``, ``load_weights``, ``load_model``: as :meth:`load_fp8_state`).

    Raises:
        TypeError: ``units`` not an int (``2.7``, ``"4"``), ``use_bias`` not True or False,
            ``config`` not a DelayedScaling / CurrentScaling (a preset name: use
            :func:`unimp.fp8.fp8_preset`), ``native`` not True, False or None (the field named).
        ValueError: ``units`` below 1.

    Shapes: input ``(..., in)``, kernel ``(in, units)``, output ``(..., units)``, in the
    compute dtype; an integer or bool input is cast to the compute dtype first, as
    ``keras.layers.Dense`` computes it (its matmul promotes the input with the kernel).
    """

    def __init__(self, units: int, use_bias: bool = True, config: _fp8.FP8Config | None = None,
                 native: bool | None = None, **kwargs: Any) -> None:
        units = _fp8.layer_size(units, "units", "FP8Dense")
        use_bias = _fp8.layer_flag(use_bias, "use_bias", "FP8Dense")
        config = _fp8.layer_config(config, "FP8Dense")
        super().__init__(**kwargs)
        self.units = units
        self.use_bias = use_bias
        self.config = config
        self.native = _fp8.native_requested(native, "FP8Dense")

    def build(self, input_shape: Any) -> None:
        n_in = int(input_shape[-1])
        self.kernel = self.add_weight(name="kernel", shape=(n_in, self.units), initializer="glorot_uniform", autocast=False)
        self.bias = self.add_weight(name="bias", shape=(self.units,), initializer="zeros") if self.use_bias else None
        _add_states(self, self.config, self.native, self.name)

    def fp8_state(self, name: str) -> FP8State:
        """The state of ``"input"``, ``"kernel"`` or ``"grad"`` (current variable values)."""
        _fp8.check_tensor(name, "FP8Dense.fp8_state")
        return _state(self, name)

    def load_fp8_state(self, name: str, state: FP8State | dict[str, Any]) -> None:
        """Assigns a (NumPy or tensor) state, or its ``to_dict()``, to the variables of
        ``name``, checked first against this layer's config (:func:`unimp.fp8.check_state`).

        Raises:
            TypeError: ``state`` neither an FP8State nor a dict (:meth:`unimp.fp8.FP8State.coerce`).
            ValueError: ``name`` is not ``"input"``, ``"kernel"`` or ``"grad"``, or a bad state
                (wrong history length, a scale that is not finite and > 0, ...); nothing is
                changed.
        """
        _fp8.check_tensor(name, "FP8Dense.load_fp8_state")
        state = FP8State.coerce(state, "FP8Dense.load_fp8_state")
        checked = _fp8.check_state(state, self.config, name)
        for f in _FIELDS:
            getattr(self, f"{name}_{f}").assign(getattr(checked, f))

    def set_weights(self, weights: Any) -> None:
        """Keras's ``set_weights``, then the loaded scaling states are checked as
        :meth:`load_fp8_state` checks them (:func:`unimp.keras.fp8.checked_load`).

        Raises:
            ValueError: Keras's own refusals, or a bad scaling state (a scale of -5, ...); the
                layer's weights are then as they were.
        """
        checked_load(self, self.config, lambda: super(FP8Dense, self).set_weights(weights),
                      "FP8Dense.set_weights")

    def load_own_variables(self, store: Any) -> None:
        """Keras's ``load_own_variables`` (``model.load_weights``, ``keras.models.load_model``),
        then the loaded scaling states are checked (:func:`unimp.keras.fp8.checked_load`).

        Raises:
            ValueError: a bad scaling state in the file; this layer's weights are then as they
                were (layers loaded before it keep what they loaded).
        """
        checked_load(self, self.config, lambda: super(FP8Dense, self).load_own_variables(store),
                      "FP8Dense.load_own_variables")

    def get_config(self) -> dict[str, Any]:
        """Keras's layer config plus ``units``, ``use_bias``, ``config`` (the scaling config's
        ``to_dict()``) and ``native``: :meth:`from_config` rebuilds an equal layer."""
        return {**super().get_config(), "units": self.units, "use_bias": self.use_bias,
                "config": self.config.to_dict(), "native": self.native}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> FP8Dense:
        """Inverse of :meth:`get_config` (``config`` as a dict is read by
        :func:`unimp.fp8.fp8_from_dict`)."""
        config = dict(config)
        if isinstance(config.get("config"), dict):
            config["config"] = _fp8.fp8_from_dict(config["config"])
        return super().from_config(config)

    def call(self, inputs: Any, training: bool | None = None) -> tf.Tensor:
        y = _fp8_matmul(self, self.config, inputs, self.kernel, training)
        if self.bias is not None:
            y = y + tf.cast(self.bias, y.dtype)
        return y


def _add_states(layer: Any, config: _fp8.FP8Config, native: bool, layer_name: str) -> None:
    """The scaling states of a float8 layer: non-trainable float32 variables
    ``<input|kernel|grad>_<scale|scale_inv|amax_history>`` (never autocast); and whether it
    asked for the native GEMM, under which name (``layer_name``) it is warned about."""
    add_state_variables(layer, config, as_gradients=False)
    attach(layer).fp8_native = bool(native)
    attach(layer).fp8_name = layer_name
    attach(layer).fp8_use_native = None  # decided at the first call (host side, once per layer)


def _state(layer: Any, name: str) -> FP8State:
    return FP8State(*(tf.convert_to_tensor(getattr(layer, f"{name}_{f}")) for f in _FIELDS))


def _branch_handles(layer: Any, name: str) -> list[tf.Tensor] | None:
    """The resource handles of ``layer``'s ``name`` state variables as captured by the current
    control-flow branch graph (``tf.cond`` / ``tf.while_loop`` inside a ``tf.function``), or
    ``None`` outside one. The output gradient's state is read and assigned in the backward
    function, whose graph may not capture a variable of the eager context itself (cond_v2's
    gradient then fails with "Tensor.graph is undefined when eager execution is enabled"):
    it uses the branch's captures, which cond_v2 maps back to the outer graph."""
    if not _in_branch():
        return None
    graph = tf.compat.v1.get_default_graph()
    return [graph.capture(getattr(layer, f"{name}_{f}").handle) for f in _FIELDS]


def _in_branch() -> bool:
    """Whether the current graph is (inside) a control-flow branch of a ``tf.function``."""
    if tf.executing_eagerly():
        return False
    graph = tf.compat.v1.get_default_graph()
    while graph is not None and not isinstance(graph, _ControlFlowFuncGraph):
        graph = getattr(graph, "outer_graph", None)
    return graph is not None


def _step(layer: Any, config: _fp8.FP8Config, name: str, amax: tf.Tensor, role: str, training: bool,
          handles: list[tf.Tensor] | None = None) -> Any:
    if handles is not None:  # inside a control-flow branch: through the branch's captures
        state = FP8State(*(_read_variable(h, tf.float32) for h in handles))
    else:
        state = _state(layer, name)
    if not training and isinstance(config, _fp8.DelayedScaling):
        return state.scale, state.scale_inv
    used, new = fp8_step(config, state, amax, role)
    if training and handles is not None:  # (a window's merge would leave the branch's graph)
        for h, f in zip(handles, _FIELDS, strict=True):
            _assign_variable(h, getattr(new, f))
    elif training and _WINDOWS and not _in_branch():  # accumulating: one step per window
        # (inside a tf.cond / while branch the window's result could not leave the branch's
        # graph: there each micro-batch takes its own step, as without accumulation)
        window, key = _WINDOWS[-1], (id(layer), name)
        best = window[key][1] if key in window else None
        window[key] = (layer, _fp8.window_merge(FP8Ops, best, new, amax))
    elif training:
        for f in _FIELDS:
            getattr(layer, f"{name}_{f}").assign(getattr(new, f))
    return used


#: The open gradient-accumulation windows (innermost last): ``{(id(layer), tensor): (layer,
#: (state after the window so far, key))}``, filled while the window's micro-batches run or
#: are traced.
_WINDOWS: list[dict[tuple[int, str], tuple[Any, Any]]] = []


@contextlib.contextmanager
def fp8_window() -> Any:
    """A gradient-accumulation window over the float8 layers run inside it: every micro-batch
    quantizes with the states as they are, and on leaving (without an error) each tensor's
    state takes one step, the rule run on the window's largest amax
    (:func:`unimp.fp8.window_merge`, the convention of every backend). On an error the
    states stay as they were. The train step opens one around its micro-batches."""
    window: dict[tuple[int, str], tuple[Any, Any]] = {}
    _WINDOWS.append(window)
    try:
        yield
    finally:
        _WINDOWS.pop()
    for (_, name), (layer, (state, _)) in window.items():
        for f in _FIELDS:
            getattr(layer, f"{name}_{f}").assign(getattr(state, f))


def native_fp8_supported() -> bool:
    """Whether TensorFlow's first GPU has float8 units (compute capability 8.9 or later, where
    XLA's ``gemm_rewriter`` emits cuBLASLt float8 GEMMs: "FP8 Custom Calls require Ada, Hopper,
    or later architectures"); False without a GPU."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return False
    cap = _capability(tf.config.experimental.get_device_details(gpus[0]) or {})
    return bool(device_support("gpu", cap)["float8"])  # one rule: unimp.dtypes


@tf.function(jit_compile=True, reduce_retracing=True)
def _xla_matmul(a8: tf.Tensor, b8: tf.Tensor, transpose_a: bool, transpose_b: bool) -> tf.Tensor:
    """``a8 @ b8`` (2-D float8 tensors, e4m3 or e5m2) in float32, compiled by XLA.

    TensorFlow 2.21 refuses float8 operands in every matmul op (``MatMul``, ``BatchMatMulV3``,
    ``XlaDotV2``: "not in the list of allowed values"), so the operands are widened inside the
    XLA cluster: its HLO is ``dot(convert(f8), convert(f8))``, which XLA's GPU
    ``gemm_rewriter`` (``MatchFp8Param``: a convert of a float8 operand) rewrites into one
    cuBLASLt float8 GEMM on sm89+; XLA:CPU runs the float32 dot (checked in the optimized HLO).
    """
    return tf.matmul(tf.cast(a8, tf.float32), tf.cast(b8, tf.float32),
                     transpose_a=transpose_a, transpose_b=transpose_b)


def _use_native(layer: Any, n_in: int, units: int) -> bool:
    """Whether ``layer`` runs the native GEMMs: decided and warned on the host at its first
    call, once per layer (never traced per step)."""
    if layer._unimp.fp8_use_native is None:
        use = layer._unimp.fp8_native
        if use:
            why = _fp8.native_refusal(n_in, units, "XLA's cuBLASLt float8 GEMM")
            if why is not None:
                _fp8.warn_native_fallback("tensorflow", layer._unimp.fp8_name, why)
                use = False
        attach(layer).fp8_use_native = use
        if not (use and native_fp8_supported()):
            gpu = bool(tf.config.list_logical_devices("GPU"))
            _fp8.warn_emulated("tensorflow", "gpu" if gpu else "cpu")
    return layer._unimp.fp8_use_native


def _fp8_matmul(layer: Any, config: _fp8.FP8Config, inputs: Any, kernel: Any, training: Any) -> tf.Tensor:
    """``inputs @ kernel`` (kernel ``(in, units)``, read in float32) as a float8 matmul with
    ``layer``'s scaling states (:func:`_add_states`); the output gradient is quantized in a
    ``tf.custom_gradient``. Emulated (float32 GEMMs of the float8 values), or with the layer's
    native path the same GEMMs as :func:`_xla_matmul` of float8 tensors. Output: ``inputs``'
    dtype and leading shape."""
    training = bool(training)
    x = tf.convert_to_tensor(inputs)
    if not x.dtype.is_floating:
        # keras.layers.Dense's matmul promotes an integer (or bool) input with its kernel: the
        # output is in the compute dtype, never the input's integers (Keras autocasts floats only)
        x = tf.cast(x, layer.compute_dtype)
    w = tf.convert_to_tensor(kernel)
    units = int(w.shape[-1])
    native = _use_native(layer, int(w.shape[0]), units)
    dtype = config.dtype("forward")
    fmax = _fp8.FP8_MAX[dtype]
    sx, sinv_x = _step(layer, config, "input", fp8_amax(x, config), "forward", training)
    sw, sinv_w = _step(layer, config, "kernel", fp8_amax(w, config), "forward", training)
    qx = tf.reshape(_fp8.quantize_arrays(FP8Ops, x, sx, dtype, fmax), [-1, x.shape[-1]])
    qw = _fp8.quantize_arrays(FP8Ops, w, sw, dtype, fmax)
    out_shape = tf.concat([tf.shape(x)[:-1], [units]], 0)
    bdt = config.dtype("backward")

    def mm(a: tf.Tensor, a_fmt: str, b: tf.Tensor, b_fmt: str, ta: bool = False, tb: bool = False) -> tf.Tensor:
        if native:  # the float8 values as float8 tensors (exact casts)
            return _xla_matmul(FP8Ops.to_fp8(a, a_fmt), FP8Ops.to_fp8(b, b_fmt), ta, tb)
        return tf.matmul(a, b, transpose_a=ta, transpose_b=tb)

    handles = _branch_handles(layer, "grad")

    @tf.custom_gradient
    def matmul(x_, w_):
        y = tf.cast(mm(qx, dtype, qw, dtype) * (sinv_x * sinv_w), x_.dtype)

        def grad(g):
            g2 = tf.reshape(g, [-1, units])
            sg, sinv_g = _step(layer, config, "grad", fp8_amax(g2, config), "backward", training, handles)
            qg = _fp8.quantize_arrays(FP8Ops, g2, sg, bdt, _fp8.FP8_MAX[bdt])
            dx = mm(qg, bdt, qw, dtype, tb=True) * (sinv_g * sinv_w)
            dw = mm(qx, dtype, qg, bdt, ta=True) * (sinv_x * sinv_g)
            return tf.cast(tf.reshape(dx, tf.shape(x_)), x_.dtype), tf.cast(dw, w_.dtype)

        return tf.reshape(y, out_shape), grad

    return matmul(x, w)


def _fp8_dense_call(self: Any, inputs: Any, training: Any = None) -> tf.Tensor:
    """``keras.layers.Dense.call`` with the matmul replaced by :func:`_fp8_matmul` (bias and
    activation as Keras adds them)."""
    y = _fp8_matmul(self, self._unimp.fp8_config, inputs, self._kernel, training)
    if self.bias is not None:
        y = y + tf.cast(self.bias, y.dtype)
    if self.activation is not None:
        y = self.activation(y)
    return y


def fp8_model_layers(model: Any) -> list[tuple[str, str, Any]]:
    """:func:`unimp.keras.fp8.fp8_model_layers`, unimp's FP8Dense counted as a ``"Dense"``."""
    return _keras_fp8.fp8_model_layers(model, (FP8Dense,))


def fp8_select(model: Any, recipe: Any) -> tuple[str, ...]:
    """:func:`unimp.keras.fp8.fp8_select`, unimp's FP8Dense counted as a ``"Dense"``.

    Raises:
        ValueError: a shared selected layer, named with its places.
    """
    return _keras_fp8.fp8_select(model, recipe, (FP8Dense,))


def fp8_swap(model: Any, recipe: Any) -> tuple[str, ...]:
    """Puts unimp's float8 matmul into the Dense layers of a built Keras model that ``recipe``
    (an :class:`unimp.fp8.recipe.FP8Recipe`) selects, in place, and returns their paths: each
    gets its scaling states (non-trainable float32 variables, added the way Keras's own
    ``Dense.quantize`` adds its float8 variables: tracker unlocked, then locked) and a ``call``
    whose matmul is :func:`_fp8_matmul` (native per ``UNIMP_FP8_NATIVE``, named by its path in
    warnings). Layers already done (or FP8Dense) are kept; a selected
    layer that is not a Dense stays as it is, with a warning naming it.

    Raises:
        ValueError: a selected Dense layer is not built yet (build the model first), uses LoRA
            or Keras's own quantization, or is called at several places
            (:func:`unimp.keras.fp8.swappable`); nothing is changed.
    """
    import types

    def install(layer: Any, path: str) -> None:
        layer._tracker.unlock()
        try:
            _add_states(layer, recipe.scaling, _fp8.native_requested(None, "fp8_swap"), path)
        finally:
            layer._tracker.lock()
        layer.call = types.MethodType(_fp8_dense_call, layer)

    return _keras_fp8.swap_layers(model, recipe, (FP8Dense,), install)
