"""TensorFlow / Keras 3 backend: Keras dtype policies, a LossScaleOptimizer on unimp's rule, a train step.

Targets Keras 3 on the TensorFlow backend (TensorFlow >= 2.16). The loss-scale rule is not written
here: :class:`LossScaleOptimizer` runs :func:`unimp.loss_scale.update_arrays` on TensorFlow tensors
(``tf.where`` and friends), so it traces under ``tf.function``, compiles under ``jit_compile`` and
matches the NumPy reference bit for bit.

No fused loss-scale update, unlike torch: torch runs eagerly, one kernel launch per op, so its
GradScaler.update runs the rule through a fused kernel (in ``torch/scaling.py``); here
:func:`~unimp.loss_scale.update_arrays` runs inside the traced graph, which fuses the rule's small ops already.

Importing this module imports TensorFlow and Keras and checks that Keras runs on TensorFlow.
unimp itself sets no environment variable and writes no file (importing TensorFlow sets a few of
its own, e.g. ``TF2_BEHAVIOR``; Keras may create ``~/.keras/keras.json``).

Modules (the same names in every backend package, see :data:`unimp.backends._base.BACKEND_MODULES`):

* ``devices``: the Keras 3 / TensorFlow-backend check (run first, on import),
  :func:`framework_version`, device parsing and placement, :func:`device_info`.
* ``precision``: :func:`matmul_precision` (the recipe's float32 matmul precision for a block),
  :func:`current_matmul_precision`.
* ``casting``: :func:`to_dtype`, :func:`cast_tree`, :func:`keras_policy_name`.
* ``overflow``: :func:`all_finite`, the gradients' global norm, the replica re-sync warning.
* ``scaling``: the rule's array namespace over TF tensors, unscaling (dense and
  ``IndexedSlices``), the config fields a traced graph builds in.
* ``optimizer``: :class:`LossScaleOptimizer` (a Keras optimizer holding the loss-scale state; a
  skipped step leaves the variables and the inner optimizer's state unchanged), and
  :class:`LossScaleCheck` (its ``max_consecutive_skips`` / ``floor_action`` checks as a
  ``model.fit`` callback), and :func:`half_update` (Kahan-compensated or stochastically rounded
  updates of half variables: a :class:`LossScaleOptimizer` with ``update=``).
* ``stats``: :func:`tensor_stats` (:mod:`unimp.stats` on the device) and the layer-call
  recording a statistics step traces with (``train_step(..., stats_every=k)``).
* ``step``: :class:`TrainStep` and its ``StepOps``: the phases :func:`unimp.trainstep.run_step`
  (the step's algorithm, written once in the core) runs while a ``tf.function`` traces.
* ``overrides``: :func:`layer_paths` (layer names from the model down), :func:`apply_overrides`
  (each covered layer given its override's dtype policy), :func:`dtype_policy_map` (the same
  as a ``keras.dtype_policies.DTypePolicyMap``).
* ``mixed_precision``: :class:`MixedPrecision`.
* ``fp8``: :mod:`unimp.fp8`'s rules on native tensors (:data:`unimp.backends._base.FP8_API`).
* ``blockscale``: :mod:`unimp.blockscale_linear`'s block-scaled linear rule (MXFP8, block FP8,
  NVFP4, MXFP4) as a custom-gradient matmul, its layer, and a recipe's layer swap.

This ``__init__`` only re-exports; import the public names from here.

Example:
    >>> import unimp
    >>> import keras
    >>> mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    >>> with mp.autocast():
    ...     layer = keras.layers.Dense(4)
    >>> layer.compute_dtype, layer.variable_dtype
    ('float16', 'float32')
"""

from unimp.backends._base import export
from unimp.backends.tensorflow import devices  # noqa: F401  (first: checks that Keras 3 runs on TensorFlow)
from unimp.backends.tensorflow.blockscale import BlockScaledDense, block_scaled_matmul, block_swap
from unimp.backends.tensorflow.casting import cast_tree, keras_policy_name, to_dtype
from unimp.backends.tensorflow.devices import device_info, framework_version
from unimp.backends.tensorflow.fp8 import (
    FP8Dense,
    FP8Ops,
    fp8_amax,
    fp8_initial_state,
    fp8_quantize_dequantize,
    fp8_state_from_numpy,
    fp8_state_to_numpy,
    fp8_step,
)
from unimp.backends.tensorflow.mixed_precision import MixedPrecision
from unimp.backends.tensorflow.optimizer import (
    LossScaleCheck,
    LossScaleOptimizer,
    export_update_state,
    half_update,
    import_update_state,
)
from unimp.backends.tensorflow.overflow import all_finite
from unimp.backends.tensorflow.overrides import apply_overrides, dtype_policy_map, layer_paths
from unimp.backends.tensorflow.precision import current_matmul_precision, matmul_precision
from unimp.backends.tensorflow.stats import tensor_stats
from unimp.backends.tensorflow.step import TrainStep
from unimp.loss_scale import ReplicaDesyncWarning
from unimp.step import StepResult

__all__ = [
    "BlockScaledDense",
    "block_scaled_matmul",
    "block_swap",
    "FP8Ops",
    "FP8Dense",
    "fp8_amax",
    "fp8_initial_state",
    "fp8_quantize_dequantize",
    "fp8_state_from_numpy",
    "fp8_state_to_numpy",
    "fp8_step",
    "current_matmul_precision",
    "matmul_precision",
    "LossScaleCheck",
    "LossScaleOptimizer",
    "MixedPrecision",
    "ReplicaDesyncWarning",
    "StepResult",
    "TrainStep",
    "all_finite",
    "apply_overrides",
    "cast_tree",
    "device_info",
    "dtype_policy_map",
    "framework_version",
    "export_update_state",
    "half_update",
    "import_update_state",
    "keras_policy_name",
    "layer_paths",
    "tensor_stats",
    "to_dtype",
]

export(__name__, globals())
