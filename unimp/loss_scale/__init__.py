"""Loss-scale configs and the reference loss-scale algorithm.

This module is the definition every backend matches bit for bit. The algorithm is written once,
in :func:`update_arrays`, over a tiny array namespace (``where``, ``minimum``, ``maximum``,
``isfinite`` and float32 / int32 constructors). The reference runs it on NumPy float32 / int32
scalars; each backend runs the *same function* on its own device tensors, so no backend
re-decides a rule and no step needs a host-device sync or a Python branch on a tensor.

The rule (dynamic scale):

* finite gradients: the counter grows by one; when it reaches ``growth_interval`` the scale is
  multiplied by ``growth_factor`` (in float32), clamped to ``max_scale``, kept at its old value
  if the product is not finite, and the counter restarts at 0. Matches torch.amp.GradScaler:
  grows on the growth_interval-th consecutive finite step.
* non-finite gradients (overflow): the step is skipped, the scale is multiplied by
  ``backoff_factor`` and floored at ``min_scale`` (``None`` floors at the smallest normal
  float32, 2**-126, so ``1/scale`` stays finite), the counter restarts, and a skip is counted.
* non-finite loss (overflow in the forward pass): the step is skipped and counted, but the
  scale and the counter are left alone: loss scaling cannot fix a forward overflow, so it must
  not drive the scale down.
* the large-scale trainers' rules (off by default): ``hysteresis`` (back off only after several
  overflows; DeepSpeed, Megatron-LM), ``overflow_tolerance`` (fairseq), ``floor_action`` (warn or
  raise when an overflow hits the floor; DeepSpeed, fairseq) and ``delayed_first_growth``
  (DeepSpeed >= 0.17.1); see :func:`update_arrays` and :mod:`unimp.loss_scale.presets`.

Static and disabled scales never change their scale; they still skip non-finite steps (a NaN
update would destroy the parameters) and count the skips.

Modules:

* ``config``: the configs (:class:`DynamicLossScale`, :class:`StaticLossScale`,
  :class:`NoLossScale`) with their validation and presets, :class:`LossScaleState`, the errors
  and warnings, :func:`loss_scale_from_dict`.
* ``rule``: the algorithm, :func:`update_arrays` over an array namespace, and its NumPy
  reference (:func:`update`, :func:`simulate`, :func:`check_state`).
* ``presets``: the table behind ``DynamicLossScale.preset``: each framework's and trainer's
  (DeepSpeed, Megatron-LM, fairseq) defaults and rule, with the source each was read from.
* ``portable``: the portable state_dict format (:data:`STATE_FORMAT`, :func:`state_dict`,
  :func:`from_state_dict`), the same in every backend.

This ``__init__`` only re-exports; import the names from ``unimp.loss_scale``.
"""

from unimp.loss_scale.config import (
    EXTRA_FIELDS,
    FLOOR_ACTIONS,
    DynamicLossScale,
    LossScaleConfig,
    LossScaleError,
    LossScaleFloorWarning,
    LossScaleState,
    NoLossScale,
    ReplicaDesyncWarning,
    StaticLossScale,
    loss_scale_from_dict,
    warn_replica_desync,
)
from unimp.loss_scale.portable import STATE_FORMAT, from_state_dict, state_dict
from unimp.loss_scale.rule import (
    FitCheck,
    FloorWatch,
    check_state,
    fields_in_use,
    simulate,
    skip_counts,
    tracks_extra,
    unchanged_fields,
    update,
    update_arrays,
)

__all__ = [
    "FitCheck",
    "EXTRA_FIELDS",
    "FloorWatch",
    "FLOOR_ACTIONS",
    "STATE_FORMAT",
    "DynamicLossScale",
    "LossScaleConfig",
    "LossScaleError",
    "LossScaleFloorWarning",
    "LossScaleState",
    "NoLossScale",
    "ReplicaDesyncWarning",
    "StaticLossScale",
    "check_state",
    "fields_in_use",
    "from_state_dict",
    "loss_scale_from_dict",
    "simulate",
    "skip_counts",
    "state_dict",
    "tracks_extra",
    "unchanged_fields",
    "update",
    "update_arrays",
    "warn_replica_desync",
]

for _name in __all__:  # pickles and reprs name the public path, unimp.loss_scale.X
    if isinstance(globals()[_name], type) and globals()[_name].__module__.startswith(__name__ + "."):
        globals()[_name].__module__ = __name__
del _name
