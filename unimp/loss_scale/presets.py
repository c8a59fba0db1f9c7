"""The dynamic loss-scale presets: each framework's and large-scale trainer's own defaults and
rule, as :class:`~unimp.loss_scale.DynamicLossScale` fields (``DynamicLossScale.preset(name)``).

=============  ======  ========  ===========  ==========  ==========  =====================
preset         init    interval  min / max    hysteresis  at floor    source
=============  ======  ========  ===========  ==========  ==========  =====================
``torch``      2**16   2000      none / none  1           keep        torch.amp.GradScaler
``keras``      2**15   2000      none / none  1           keep        Keras 3 LossScaleOptimizer
``tf_keras``   2**15   2000      1 / none     1           keep        tf.keras 2 LossScaleOptimizer
``jmp``        2**15   2000      1 / none     1           keep        jmp.DynamicLossScale
``flax``       2**16   2001      none / fmax  1           keep        flax DynamicScale
``apex``       2**16   2000      none / 2**24 1           keep        apex.amp LossScaler
``deepspeed``  2**16   1000 (+1) 1 / none     2           raise       DeepSpeed fp16
``megatron``   2**32   1000      1 / none     2           keep        Megatron-LM
``fairseq``    2**7    16384     2**-13 / no  1, tol 0    raise       fairseq FP16Optimizer
=============  ======  ========  ===========  ==========  ==========  =====================

Every preset grows by 2 and backs off by 0.5. "none" as a floor means unimp's ``min_scale=None``
(2**-126): the frameworks without a floor would keep halving into float32 subnormals and finally
to 0 after about 140 overflows in a row; unimp stops at the smallest normal so ``1/scale`` stays
finite. flax checks ``fin_steps == growth_interval`` before counting the current step, so it
grows one clean step later than the others: its ``growth_interval=2000`` is unimp's 2001. flax
clamps growth at the largest float32, hence ``max_scale`` = float32 max.

The trainers (read at their source, commits below):

``deepspeed``: DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py``, ``DynamicLossScaler.
update_scale`` (deepspeedai/DeepSpeed edaa7221, v0.19.6), with the fp16 config defaults of
``deepspeed/runtime/precision_config.py`` (``initial_scale_power=16``,
``loss_scale_window=1000``, ``hysteresis=2``, ``consecutive_hysteresis=False``,
``min_loss_scale=1``; ``scale_factor`` fixed at 2.0, ``raise_error_at_min_scale=True``). On an
overflow: when ``delayed_shift == 1 or cur_hysteresis == 1`` it backs off to
``max(scale / 2, min_scale)`` but first raises "Current loss scale already at minimum - cannot
decrease scale anymore. Exiting run." when the scale already equals ``min_scale``; otherwise
it only decrements ``cur_hysteresis``; either way ``last_overflow_iter = cur_iter``. On a clean
step: with ``consecutive_hysteresis`` the hysteresis is refilled; ``stable_interval =
cur_iter - last_overflow_iter - 1``; when ``stable_interval > 0`` and divisible by the window
the scale doubles (and, without ``consecutive_hysteresis``, the hysteresis is refilled). So
the first growth after the start or an overflow comes on the 1001st clean step and later ones
every 1000 (``delayed_first_growth=True``). That timing came with v0.17.1 (commit e440506b,
"Improve overflow handling in ZeRO", #6976); before it the test was ``(cur_iter -
last_overflow_iter) % scale_window == 0``, growth on the 1000th clean step:
``preset("deepspeed", delayed_first_growth=False)`` reproduces DeepSpeed < 0.17.1. The scale
is a Python float with no cap.

``megatron``: Megatron-LM ``megatron/core/optimizer/grad_scaler.py``,
``DynamicGradScaler.update`` (NVIDIA/Megatron-LM d98e8a64), built in
``megatron/core/optimizer/__init__.py`` with ``growth_factor=2.0, backoff_factor=0.5``, with
the defaults of ``megatron/training/arguments.py`` / ``optimizer_config.py``
(``--initial-loss-scale 2**32``, ``--min-loss-scale 1.0``, ``--loss-scale-window 1000``,
``--hysteresis 2``). On an overflow the growth tracker restarts, the hysteresis tracker drops
by one and, once it is <= 0, the scale becomes ``max(scale * 0.5, min_scale)`` on every
overflow; on the ``growth_interval``-th clean step in a row the scale doubles and the
hysteresis is refilled. No cap (a float32 tensor that may reach inf), no stop at the floor.

``fairseq``: fairseq ``fairseq/optim/dynamic_loss_scaler.py`` (facebookresearch/fairseq
3d262bb2), built by ``fairseq/optim/fp16_optimizer.py`` from ``fairseq/dataclass/configs.py``
(``fp16_init_scale=2**7``, ``fp16_scale_window=None`` which becomes ``2**14 /
data_parallel_size / update_freq``, 16384 on one worker, ``fp16_scale_tolerance=0.0``,
``threshold_loss_scale=None``, ``min_loss_scale=1e-4``). A clean step grows the scale by 2
when ``(_iter - _last_overflow_iter) % scale_window == 0`` (the window-th clean step) and
marks a rescale. An overflow counts ``_overflows_since_rescale``; when it divided by the steps
since the last rescale reaches the tolerance, the scale halves and both restart; then, if the
scale is ``<= min_loss_scale``, the old scale is restored and ``FloatingPointError`` ("Minimum
loss scale reached") stops the run. So fairseq never holds a scale at or below
``min_loss_scale``: its lowest scale is the smallest ``init_scale * 2**-k`` above it (2**-13
for the defaults), which is this preset's ``min_scale`` (computed from ``init_scale`` unless
``min_scale`` is given), and ``floor_action="raise"`` raises on the overflow fairseq stops at.
Pass ``growth_interval`` for several workers (``16384 // world_size``).

Two rules stay unimp's in every preset: a growth that would leave float32's finite range keeps
the old scale (the trainers keep a Python float or let a float32 tensor reach inf); and a
non-finite loss (a forward overflow) skips the step without touching the scale, the hysteresis
or the tolerance counts, where the trainers see NaN gradients and back off: lowering the scale
cannot fix an overflow in the forward pass, so it must not drive the scale to the floor.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

from unimp.dtypes import finfo

_F32_MAX = finfo("float32").max

FAIRSEQ_MIN_LOSS_SCALE = 1e-4

PRESETS: dict[str, dict[str, Any]] = {
    "torch": dict(init_scale=2.0**16, growth_interval=2000, min_scale=None, max_scale=None),
    "keras": dict(init_scale=2.0**15, growth_interval=2000, min_scale=None, max_scale=None),
    "tf_keras": dict(init_scale=2.0**15, growth_interval=2000, min_scale=1.0, max_scale=None),
    "jmp": dict(init_scale=2.0**15, growth_interval=2000, min_scale=1.0, max_scale=None),
    "flax": dict(init_scale=2.0**16, growth_interval=2001, min_scale=None, max_scale=_F32_MAX),
    "apex": dict(init_scale=2.0**16, growth_interval=2000, min_scale=None, max_scale=2.0**24),
    "deepspeed": dict(
        init_scale=2.0**16, growth_interval=1000, min_scale=1.0, max_scale=None, hysteresis=2,
        consecutive_hysteresis=False, floor_action="raise", delayed_first_growth=True,
    ),
    "megatron": dict(
        init_scale=2.0**32, growth_interval=1000, min_scale=1.0, max_scale=None, hysteresis=2
    ),
    "fairseq": dict(
        init_scale=2.0**7, growth_interval=2**14, min_scale=None, max_scale=None,
        overflow_tolerance=0.0, floor_action="raise",
    ),
}

_ALIASES = {"tf.keras": "tf_keras", "tfkeras": "tf_keras", "pytorch": "torch", "megatron_lm": "megatron"}


def fairseq_floor(init_scale: float, min_loss_scale: float = FAIRSEQ_MIN_LOSS_SCALE) -> float:
    """The lowest scale fairseq holds from ``init_scale``: the smallest ``init_scale * 2**-k``
    above ``min_loss_scale`` (fairseq stops the run instead of going to or below it)."""
    s = float(init_scale)
    while math.isfinite(s) and s / 2 > min_loss_scale:
        s /= 2
    return s


def preset_fields(name: str, overrides: dict[str, Any], valid: list[str]) -> dict[str, Any]:
    """The :class:`~unimp.loss_scale.DynamicLossScale` fields of preset ``name`` with
    ``overrides`` applied; ``valid`` is the list of those fields' names (the class passes its
    own, so this table imports nothing of the configs).

    Raises:
        ValueError: unknown preset name, listing them and the closest match, or an override
            that is not a :class:`DynamicLossScale` field (listing them).
    """
    key = name.strip().lower().replace("-", "_") if isinstance(name, str) else name
    key = _ALIASES.get(key, key.replace(".", "_") if isinstance(key, str) else key)
    if key not in PRESETS:
        close = difflib.get_close_matches(str(name), list(PRESETS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown loss-scale preset {name!r}.{hint} Presets: {', '.join(PRESETS)}.")
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(
            f"DynamicLossScale.preset({name!r}): unknown field(s) {unknown}; the fields are "
            f"{', '.join(valid)}."
        )
    fields = {**PRESETS[key], **overrides}
    if key == "fairseq" and "min_scale" not in overrides:
        fields["min_scale"] = fairseq_floor(fields["init_scale"])
    return fields
