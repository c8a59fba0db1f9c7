"""Keras 3 on whichever backend ``KERAS_BACKEND`` selects (TensorFlow, JAX or torch): the pieces
of unimp written against Keras's own API (``keras.ops``, layers, dtype policies) only.

* ``casting``: :func:`to_dtype`, :func:`cast_tree` (``keras.ops.cast``), :func:`keras_policy_name`.
* ``overrides``: :func:`layer_paths`, :func:`apply_overrides`, :func:`dtype_policy_map`:
  :mod:`unimp.overrides` matched on layer names, each covered layer given its Keras dtype policy.
* ``optimizer``: :class:`LossScaleOptimizer`, unimp's loss-scale rule in a Keras optimizer
  (``model.fit``, custom loops, Keras's stateless step on JAX), and :class:`KerasOps`, the
  rule's array namespace over ``keras.ops``, and :class:`LossScaleCheck`, the ``fit`` callback
  acting on the config's ``max_consecutive_skips`` and ``floor_action``; :func:`half_update`
  and :func:`export_update_state` / :func:`import_update_state`, the policy's ``update`` rule
  for half variables and its portable state (as every backend's).
* ``mixed_precision``: :class:`MixedPrecision`, the recipe bound to Keras (dtype policies,
  ``prepare``, overrides, ``train_step``): ``unimp.mixed_precision(..., backend="keras-jax")``
  or ``"keras-torch"`` returns it.
* ``step``: :class:`~unimp.keras.step.TrainStep`, the custom-loop step (the core's
  :func:`unimp.trainstep.run_step` over ``keras.ops``, the backward pass the engine's own).
* ``devices``: :func:`framework_version`.
* ``overflow``: :func:`all_finite`, the finite check of the optimizer and the step.
* ``stats``: :func:`tensor_stats` (:mod:`unimp.stats` on ``keras.ops``) and the layer
  recording of a statistics step (``train_step(..., stats_every=k)``), which the TensorFlow
  backend's step uses too.

On Keras's TensorFlow backend, :mod:`unimp.backends.tensorflow` is the whole backend and builds
on this package (its ``MixedPrecision`` subclasses this one, its overrides are these) and adds
``tf.distribute``, Horovod, a traced train step and its float8 layers. Importing this
package imports Keras (and the backend Keras selects).

This ``__init__`` only re-exports; import the public names from here.
"""

from unimp.keras.casting import cast_tree, keras_policy_name, to_dtype
from unimp.keras.devices import framework_version
from unimp.keras.mixed_precision import MixedPrecision
from unimp.keras.optimizer import (
    KerasOps,
    LossScaleCheck,
    LossScaleOptimizer,
    export_update_state,
    half_update,
    import_update_state,
)
from unimp.keras.overflow import all_finite
from unimp.keras.overrides import apply_overrides, dtype_policy_map, layer_paths
from unimp.keras.stats import tensor_stats

__all__ = [
    "KerasOps",
    "LossScaleCheck",
    "LossScaleOptimizer",
    "MixedPrecision",
    "all_finite",
    "apply_overrides",
    "cast_tree",
    "dtype_policy_map",
    "export_update_state",
    "framework_version",
    "half_update",
    "import_update_state",
    "keras_policy_name",
    "layer_paths",
    "tensor_stats",
    "to_dtype",
]
