"""FP8 (float8) training: one per-tensor scaling rule, the quantize-dequantize rule, presets.

Framework-free, like :mod:`unimp.loss_scale`: the rule is written once, in
:func:`step_arrays` and :func:`qdq_arrays`, over a small array namespace; the NumPy reference
(:class:`NumpyOps`) and every backend's ``fp8`` module run the same functions on their own
tensors, bit for bit.

Formats: ``float8_e4m3fn`` (max 448, no inf) for inputs and weights, ``float8_e5m2`` (max
57344) for gradients (``HYBRID``, Transformer Engine's default; Keras and flax always).

Presets (:func:`fp8_preset`) reproduce each implementation, timing and edge cases included
(sources and commits in docs/fp8.md):

============================  ==============================  ==========================================
preset                        scale used at step t from       amax 0 / inf / NaN
============================  ==============================  ==========================================
``keras``                     steps t-L-1 .. t-2 (2 late)     window max 0/inf/NaN: keep (1/(1/s), may drift 1 ulp)
``flax``                      steps t-L .. t-1 (1 late)       as keras
``transformer_engine``        steps t-L .. t-1 (1 late)       0: step not recorded; NaN skipped by max; inf: keep
``unimp_delayed`` (default)   steps t-L .. t-1 (1 late)       window max 0/inf/NaN: keep the scale exactly
``transformer_engine_current``  step t                        scale 1
``torchao``                   step t                          0: 4.48e14 (e4m3), inf: 0, NaN: NaN
============================  ==============================  ==========================================

This ``__init__`` only re-exports.
"""

from unimp.fp8.config import (
    FORMATS,
    FP8_MAX,
    LAYER_TENSORS,
    PRESETS,
    ROLES,
    STATE_FIELDS,
    CurrentScaling,
    DelayedScaling,
    FP8Config,
    FP8State,
    check_state,
    check_tensor,
    fp8_from_dict,
    fp8_preset,
)
from unimp.fp8.layers import (
    NATIVE_ENV,
    NATIVE_MULTIPLE,
    FP8EmulationWarning,
    FP8NativeFallbackWarning,
    layer_config,
    layer_flag,
    layer_size,
    native_refusal,
    native_requested,
    refuse_non_float,
    warn_emulated,
    warn_native_fallback,
)
from unimp.fp8.portable import STATE_FORMAT, from_state_dict, state_dict
from unimp.fp8.rule import (
    NumpyOps,
    amax_of,
    ieee_reciprocal,
    qdq_arrays,
    quantize_arrays,
    quantize_dequantize,
    recorded_amax,
    simulate,
    step,
    step_arrays,
    window_merge,
)

__all__ = [
    "FORMATS",
    "FP8_MAX",
    "LAYER_TENSORS",
    "NATIVE_ENV",
    "NATIVE_MULTIPLE",
    "PRESETS",
    "ROLES",
    "STATE_FIELDS",
    "STATE_FORMAT",
    "CurrentScaling",
    "DelayedScaling",
    "FP8State",
    "FP8Config",
    "FP8EmulationWarning",
    "FP8NativeFallbackWarning",
    "NumpyOps",
    "amax_of",
    "ieee_reciprocal",
    "recorded_amax",
    "window_merge",
    "check_state",
    "check_tensor",
    "fp8_from_dict",
    "fp8_preset",
    "layer_config",
    "layer_flag",
    "layer_size",
    "native_refusal",
    "native_requested",
    "from_state_dict",
    "qdq_arrays",
    "quantize_arrays",
    "quantize_dequantize",
    "refuse_non_float",
    "simulate",
    "state_dict",
    "step",
    "step_arrays",
    "warn_emulated",
    "warn_native_fallback",
]
