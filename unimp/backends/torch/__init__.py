"""The PyTorch backend: torch.amp autocast, a GradScaler that follows unimp's loss-scale rule,
module-mode casting with float32 master weights (Apex O2), and a train step.

Everything runs on the device the user picks (``device="cuda"``, ``"cpu"``, ``"xpu"``, ...)
through the same code path. Taking a step never waits for the device: non-finite checks and
loss-scale updates stay on the device (``torch._amp_foreach_non_finite_check_and_unscale_``
and :func:`unimp.loss_scale.update_arrays` over device tensors), and a skipped optimizer step is
undone on the device (see :class:`GradScaler`).

Modules (the same names in every backend package, see :data:`unimp.backends._base.BACKEND_MODULES`):

* ``devices``: :func:`framework_version`, :func:`default_device`, device parsing, :func:`device_info`.
* ``precision``: :func:`matmul_precision` (the recipe's float32 matmul precision for a block),
  :func:`current_matmul_precision`.
* ``casting``: :func:`to_dtype`, :func:`cast_tree`, module mode's float32 master weights and
  their checkpoints, :func:`master_params`.
* ``overflow``: :func:`all_finite`, the gradients' global norm, the step's overflow flags, and
  the replicas' agreement over torch.distributed (re-exported by :mod:`unimp.distributed.torch`).
* ``scaling``: :class:`GradScaler` (drop-in for ``torch.amp.GradScaler``), the rule's array
  namespace over device tensors (``LossScaleOps``), and the fused path ``GradScaler.update``
  runs it through (torch only: torch runs eagerly, one kernel launch per op, so the rule's ~17
  small ops need a fused kernel; TensorFlow and JAX run :func:`unimp.loss_scale.update_arrays`
  inside a traced graph / one XLA program, which fuses them already).
* ``optimizer``: the skip-safe ``optimizer.step`` (a skipped step leaves parameters and optimizer
  state bitwise unchanged, no host sync) and :func:`half_update` (Kahan-compensated or
  stochastically rounded updates of half parameters, on any ``torch.optim`` optimizer).
* ``stats``: :func:`tensor_stats` (:mod:`unimp.stats` on the device) and the forward hooks of
  a statistics step (``train_step(..., stats_every=k)``).
* ``step``: :class:`TrainStep` and its ``StepOps``: the phases :func:`unimp.trainstep.run_step`
  (the step's algorithm, written once in the core) runs, eagerly.
* ``overrides``: :func:`layer_paths` (module names), :func:`apply_overrides` (each covered
  module under its override policy: autocast to its dtype or off, or held in it in module mode).
* ``mixed_precision``: :class:`MixedPrecision`.
* ``fp8``: :mod:`unimp.fp8`'s rules on native tensors (:data:`unimp.backends._base.FP8_API`).
* ``blockscale``: :mod:`unimp.blockscale_linear`'s block-scaled linear rule (MXFP8, block FP8,
  NVFP4, MXFP4) as a custom-gradient matmul, its layer, and a recipe's layer swap.

This ``__init__`` only re-exports; import the public names from here.

Example:
    >>> import torch, unimp
    >>> mp = unimp.mixed_precision("mixed_bfloat16", backend="torch", device="cpu")
    >>> mp.compute_dtype
    torch.bfloat16
    >>> mp.cast_to_compute({"x": torch.ones(2), "n": torch.tensor([1, 2])})["x"].dtype
    torch.bfloat16
"""

from unimp.backends._base import export
from unimp.backends.torch.blockscale import BlockScaledLinear, block_scaled_matmul, block_swap
from unimp.backends.torch.casting import cast_tree, master_params, to_dtype
from unimp.backends.torch.devices import default_device, device_info, framework_version
from unimp.backends.torch.fp8 import (
    FP8Dense,
    FP8Ops,
    fp8_amax,
    fp8_initial_state,
    fp8_quantize_dequantize,
    fp8_state_from_numpy,
    fp8_state_to_numpy,
    fp8_step,
)
from unimp.backends.torch.mixed_precision import MixedPrecision
from unimp.backends.torch.optimizer import export_update_state, half_update, import_update_state
from unimp.backends.torch.overflow import all_finite
from unimp.backends.torch.overrides import apply_overrides, layer_paths
from unimp.backends.torch.precision import current_matmul_precision, matmul_precision
from unimp.backends.torch.scaling import GradScaler
from unimp.backends.torch.stats import tensor_stats
from unimp.backends.torch.step import TrainStep
from unimp.step import StepResult

__all__ = [
    "BlockScaledLinear",
    "block_scaled_matmul",
    "block_swap",
    "FP8Ops",
    "FP8Dense",
    "fp8_amax",
    "fp8_initial_state",
    "fp8_quantize_dequantize",
    "fp8_state_from_numpy",
    "fp8_state_to_numpy",
    "fp8_step",  # COMMON_API (unimp.backends._base) and torch's own pieces
    "current_matmul_precision",
    "matmul_precision",
    "MixedPrecision",
    "StepResult",
    "all_finite",
    "apply_overrides",
    "cast_tree",
    "device_info",
    "framework_version",
    "export_update_state",
    "half_update",
    "import_update_state",
    "layer_paths",
    "tensor_stats",
    "to_dtype",
    "GradScaler",
    "TrainStep",
    "default_device",
    "master_params",
]

export(__name__, globals())
