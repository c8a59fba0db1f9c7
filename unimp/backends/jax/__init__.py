"""The JAX backend: jmp-style casting, the loss-scale pytree, optax and flax integration.

JAX has no autocast: a recipe is applied by casting at function and module boundaries, as jmp
and haiku do, and by passing ``dtype`` / ``param_dtype`` to flax modules. The loss scale is an
immutable pytree, :class:`LossScale`: the core's :class:`unimp.LossScaleState` (of ``jnp``
scalars) registered as a pytree, with its config as static data, whose update is
:func:`unimp.loss_scale.update_arrays` run on ``jnp`` arrays, so it traces under ``jit``,
``vmap``, ``lax.scan`` and ``shard_map`` and matches the NumPy reference bit for bit.

No fused loss-scale update, unlike torch: torch runs eagerly, one kernel launch per op, so its
GradScaler.update runs the rule through a fused kernel (in ``torch/scaling.py``); here
:func:`~unimp.loss_scale.update_arrays` runs inside one XLA program, which fuses the rule's small ops already.

Pieces:

* :class:`MixedPrecision`: a recipe bound to JAX (casts, ``apply``, flax ``module_kwargs``,
  ``prepare`` and a jitted ``train_step``).
* :class:`LossScale`: the loss scale of any config (one class, as torch's one ``GradScaler``
  and Keras's one ``LossScaleOptimizer``; ``LossScale(config, state=None)``,
  ``LossScale.from_config(spec)``, ``LossScale.from_state_dict(d)``, ``LossScale.preset(name)``)
  with jmp's method names (``loss_scale``, ``scale``, ``unscale``, ``adjust``). jmp's classes
  (``DynamicLossScale``, ``StaticLossScale``, ``NoOpLossScale``) and constructors are
  :mod:`unimp.compat.jmp`'s; ``unimp.DynamicLossScale`` & co are the configs.
* :func:`loss_scaling`: an optax ``GradientTransformation`` carrying the loss scale in its
  state; :func:`get_loss_scale` reads it back; :class:`MultiSteps` is ``optax.MultiSteps``
  with the accumulator reset to exact zeros after every window.
* :func:`all_finite`, :func:`select_tree`, :func:`cast_tree`.
* :func:`tensor_stats`, :func:`observe`: tensor statistics (:mod:`unimp.stats`).

Modules (the same names in every backend package, see :data:`unimp.backends._base.BACKEND_MODULES`):

* ``devices``: :func:`framework_version`, device parsing, committing state to a device,
  :func:`device_info`.
* ``precision``: :func:`matmul_precision` (the recipe's float32 matmul precision for a block),
  :func:`current_matmul_precision`.
* ``casting``: :func:`to_dtype`, :func:`cast_tree`.
* ``overflow``: :func:`all_finite` (optionally reduced over a mesh axis), the gradients' global
  norm, :func:`select_tree`, :func:`sync_loss_scale`.
* ``scaling``: :class:`LossScale` and the rule's array namespace over ``jnp`` arrays.
* ``optimizer``: :func:`loss_scaling` (optax), :func:`get_loss_scale`, :class:`MultiSteps`,
  :func:`half_update` (Kahan-compensated or stochastically rounded updates of half parameters).
* ``stats``: :func:`tensor_stats` (:mod:`unimp.stats` on the device), :func:`observe` (names
  an activation for a statistics step, ``train_step(..., stats_every=k)``).
* ``step``: :class:`TrainStep` and its ``StepOps``: the phases :func:`unimp.trainstep.run_step`
  (the step's algorithm, written once in the core) runs while ``jax.jit`` traces.
* ``overrides``: :func:`layer_paths` (pytree key paths), :func:`apply_overrides` (a tree cast by
  path, unmatched patterns warned), per-path casting behind ``mp.cast_to_compute`` /
  ``mp.cast_to_param`` and ``mp.module_kwargs(path)``.
* ``mixed_precision``: :class:`MixedPrecision`.
* ``fp8``: :mod:`unimp.fp8`'s rules on native tensors (:data:`unimp.backends._base.FP8_API`).
* ``blockscale``: :mod:`unimp.blockscale_linear`'s block-scaled linear rule (MXFP8, block FP8,
  NVFP4, MXFP4) as a custom-gradient matmul, its layer, and a recipe's layer swap.

This ``__init__`` only re-exports; import the public names from here.
"""

from unimp.backends._base import export
from unimp.backends.jax.blockscale import (
    block_matmul,
    block_scaled_dot_general,
    block_scaled_matmul,
)
from unimp.backends.jax.casting import cast_tree, to_dtype
from unimp.backends.jax.devices import device_info, framework_version
from unimp.backends.jax.fp8 import (
    FP8Ops,
    fp8_amax,
    fp8_dot_general,
    fp8_initial_state,
    fp8_quantize_dequantize,
    fp8_state_from_numpy,
    fp8_state_to_numpy,
    fp8_step,
    fp8_update,
)
from unimp.backends.jax.mixed_precision import MixedPrecision
from unimp.backends.jax.optimizer import (
    HalfUpdateState,
    LossScaleOptState,
    MultiSteps,
    export_update_state,
    get_loss_scale,
    half_update,
    import_update_state,
    loss_scaling,
)
from unimp.backends.jax.overflow import all_finite, select_tree, sync_loss_scale
from unimp.backends.jax.overrides import apply_overrides, layer_paths
from unimp.backends.jax.precision import current_matmul_precision, matmul_precision
from unimp.backends.jax.scaling import LossScale
from unimp.backends.jax.stats import observe, tensor_stats
from unimp.backends.jax.step import TrainStep
from unimp.loss_scale import ReplicaDesyncWarning
from unimp.step import StepResult

__all__ = [
    "block_matmul",
    "block_scaled_dot_general",
    "block_scaled_matmul",
    "FP8Ops",
    "fp8_dot_general",
    "fp8_update",
    "fp8_amax",
    "fp8_initial_state",
    "fp8_quantize_dequantize",
    "fp8_state_from_numpy",
    "fp8_state_to_numpy",
    "fp8_step",
    "current_matmul_precision",
    "matmul_precision",
    "HalfUpdateState",
    "LossScale",
    "LossScaleOptState",
    "MixedPrecision",
    "MultiSteps",
    "ReplicaDesyncWarning",
    "StepResult",
    "TrainStep",
    "all_finite",
    "apply_overrides",
    "cast_tree",
    "device_info",
    "framework_version",
    "get_loss_scale",
    "export_update_state",
    "half_update",
    "import_update_state",
    "layer_paths",
    "loss_scaling",
    "observe",
    "select_tree",
    "sync_loss_scale",
    "tensor_stats",
    "to_dtype",
]

export(__name__, globals())
