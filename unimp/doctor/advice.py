"""The fixes whose advice depends on the run's config: what the log header's loss-scale config
and recipe already have is never suggested; the next step is, or nothing (see
:mod:`unimp.doctor`)."""

from __future__ import annotations

from typing import Any

from unimp.doctor.findings import Fix

#: The backoff_factor suggested for a gentler backoff (a config at or above it gets none).
GENTLE_BACKOFF = 0.8
#: The max_consecutive_skips suggested to stop a run stuck at its floor.
STOP_AFTER = 100

_BF16 = (
    "use bfloat16 instead of float16 where the device has it (recipe 'mixed_bfloat16': "
    "float32's range, no loss scaling); `unimp info` lists which devices do"
)
_HYST = (
    "back off more gently, so a run of overflows does not drag the scale down: a "
    "backoff_factor nearer 1 (e.g. 0.8) in DynamicLossScale, or hysteresis=2 (DeepSpeed's and "
    "Megatron's rule: a lone overflow does not back off)"
)
_HYST2 = "hysteresis=2 (DeepSpeed's and Megatron's rule: a lone overflow does not back off)"
_CONSECUTIVE = (
    "consecutive_hysteresis=True (DeepSpeed's: the hysteresis refills on every clean step, "
    "not only when the scale grows, so overflows with clean steps between them back off less)"
)


class Advice:
    """The fixes for one log, given its header's loss-scale config and recipe.

    Args:
        loss_scale: :attr:`unimp.steplog.StepLog.loss_scale` (``to_dict()`` form; a field
            left out is at its default), or None when unknown.
        recipe: :attr:`unimp.steplog.StepLog.recipe` (``Recipe.to_dict()`` form), or None.
    """

    def __init__(self, loss_scale: dict[str, Any] | None, recipe: dict[str, Any] | None) -> None:
        self.cfg = loss_scale
        self.compute = self.param = None
        if recipe is not None:
            from unimp.policy import get_policy

            policy = get_policy(recipe["policy"])
            self.compute, self.param = policy.compute_dtype, policy.param_dtype

    @property
    def float16(self) -> bool:
        """The run computes in float16, or its recipe is unknown (then assumed)."""
        return self.compute in (None, "float16")

    def bfloat16(self) -> list[Fix]:
        """``[bfloat16]``, or ``[]`` when the recipe already computes in bfloat16 or float32."""
        return [Fix("bfloat16", _BF16)] if self.float16 else []

    def keep(self, layer: str) -> list[Fix]:
        """``[keep_float32]`` for ``layer`` (bfloat16 named as the other way where the run is
        not already in it); ``[]`` when the recipe computes in float32 already."""
        if self.compute == "float32":
            return []
        text = (
            f"keep layer {layer} in float32 (run it outside the {self.compute or 'float16'} "
            "policy)"
        )
        if self.float16:
            text += ", or use bfloat16, whose range is float32's"
        return [Fix("keep_float32", text, layer)]

    def gentler(self, spread: bool = False) -> list[Fix]:
        """``[hysteresis]``: a gentler backoff, naming only the knobs the config has not
        turned: ``backoff_factor`` below :data:`GENTLE_BACKOFF` (suggests it),
        ``hysteresis`` 1 (suggests 2), and, where ``spread`` (the overflows had clean steps
        between them), ``hysteresis`` >= 2 without ``consecutive_hysteresis`` (suggests it:
        DeepSpeed's ``deepspeed/runtime/fp16/loss_scaler.py`` refills the hysteresis on every
        clean step with it, else only when the scale grows). The generic advice when the
        config is unknown; ``[]`` for a static scale or none (nothing backs off) and when
        every knob is already turned."""
        cfg = self.cfg
        if cfg is None:
            return [Fix("hysteresis", _HYST)]
        if cfg.get("kind") != "dynamic":
            return []
        backoff = float(cfg.get("backoff_factor", 0.5))
        hysteresis = int(cfg.get("hysteresis", 1))
        consecutive = bool(cfg.get("consecutive_hysteresis", False))
        parts, has = [], []
        if backoff < GENTLE_BACKOFF:
            parts.append(f"a backoff_factor nearer 1 (now {backoff:g}; e.g. {GENTLE_BACKOFF:g})")
        else:
            has.append(f"backoff_factor={backoff:g}")
        if hysteresis == 1:
            parts.append(_HYST2)
        else:
            has.append(f"hysteresis={hysteresis}")
            if spread and not consecutive:
                parts.append(_CONSECUTIVE)
            elif consecutive:
                has.append("consecutive_hysteresis=True")
        if not parts:
            return []
        text = (
            "back off more gently, so a run of overflows does not drag the scale down: in "
            "DynamicLossScale, " + ", or ".join(parts)
            + (f"; the config already has {', '.join(has)}" if has else "")
        )
        return [Fix("hysteresis", text)]

    def stop_early(self, stuck: int) -> list[Fix]:
        """``[stop_early]`` after ``stuck`` overflows at the floor: ``max_consecutive_skips``
        when the config sets none (a lower one when it sets one above :data:`STOP_AFTER`);
        ``[]`` when the config's ``floor_action`` is ``"raise"`` (the run already stops
        there) or its limit is already low, or the config is not dynamic."""
        cfg = self.cfg or {"kind": "dynamic"}
        if cfg.get("kind") != "dynamic" or cfg.get("floor_action") == "raise":
            return []
        limit = cfg.get("max_consecutive_skips")
        if limit is None:
            what = f"set max_consecutive_skips (e.g. {STOP_AFTER})"
        elif limit > STOP_AFTER:
            what = f"lower max_consecutive_skips (now {limit}; e.g. {STOP_AFTER})"
        else:
            return []
        text = (
            f"{what} so a scale stuck at its floor stops the run with LossScaleError instead "
            f"of skipping {stuck} steps"
        )
        return [Fix("stop_early", text)]
