"""Plain-Python transcriptions of the large-scale trainers' loss-scale rules, written from their
sources (read at the commits named in :mod:`unimp.loss_scale.presets`), to check unimp's presets
step for step. Each has ``step(overflow)``: the scale afterwards, or :class:`FloorStop` where the
trainer stops the run. Not unimp code: the reference the presets must reproduce.
"""

from __future__ import annotations

import numpy as np


class FloorStop(Exception):
    """The trainer stopped the run at its floor (DeepSpeed's Exception, fairseq's
    FloatingPointError)."""


class DeepSpeed:
    """deepspeed/runtime/fp16/loss_scaler.py DynamicLossScaler.update_scale (v0.19.6); with
    ``before_0_17_1`` the growth test of DeepSpeed < 0.17.1. The scale is a Python float."""

    def __init__(self, init_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=2,
                 consecutive_hysteresis=False, before_0_17_1=False):
        self.cur_scale = float(init_scale)
        self.cur_iter, self.last_overflow_iter = 0, -1
        self.scale_window, self.min_scale = scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.before_0_17_1 = before_0_17_1

    def step(self, overflow: bool) -> float:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise FloorStop("Current loss scale already at minimum")
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            since = self.cur_iter - self.last_overflow_iter
            if self.before_0_17_1:
                grow = since % self.scale_window == 0
            else:
                grow = since - 1 > 0 and (since - 1) % self.scale_window == 0
            if grow:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2.0
        self.cur_iter += 1
        return self.cur_scale


class Megatron:
    """megatron/core/optimizer/grad_scaler.py DynamicGradScaler.update with the factors of
    megatron/core/optimizer/__init__.py (2.0, 0.5); the scale is a float32 tensor."""

    def __init__(self, initial_scale=2.0**32, min_scale=1.0, growth_interval=1000, hysteresis=2):
        self._scale = np.float32(initial_scale)
        self.min_scale = np.float32(min_scale)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._growth_tracker, self._hysteresis_tracker = 0, hysteresis

    def step(self, found_inf: bool) -> float:
        with np.errstate(over="ignore"):
            if found_inf:
                self._growth_tracker = 0
                self._hysteresis_tracker -= 1
                if self._hysteresis_tracker <= 0:
                    self._scale = max(self._scale * np.float32(0.5), self.min_scale)
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self.growth_interval:
                    self._growth_tracker = 0
                    self._hysteresis_tracker = self.hysteresis
                    self._scale = self._scale * np.float32(2.0)
        return float(self._scale)


class Fairseq:
    """fairseq/optim/dynamic_loss_scaler.py DynamicLossScaler as FP16Optimizer drives it: an
    overflow goes through check_overflow (and the step is skipped), a clean step through update().
    """

    def __init__(self, init_scale=2.0**7, scale_window=2**14, tolerance=0.0, min_loss_scale=1e-4):
        self.loss_scale = init_scale
        self.scale_window, self.tolerance, self.min_loss_scale = scale_window, tolerance, min_loss_scale
        self._iter, self._last_overflow_iter, self._last_rescale_iter = 0, -1, -1
        self._overflows_since_rescale = 0

    def step(self, overflow: bool) -> float:
        if not overflow:
            if (self._iter - self._last_overflow_iter) % self.scale_window == 0:
                self.loss_scale *= 2.0
                self._last_rescale_iter = self._iter
            self._iter += 1
            return self.loss_scale
        prev_scale = self.loss_scale
        iter_since_rescale = self._iter - self._last_rescale_iter
        self._last_overflow_iter = self._iter
        self._overflows_since_rescale += 1
        if self._overflows_since_rescale / float(iter_since_rescale) >= self.tolerance:
            self.loss_scale /= 2.0
            self._last_rescale_iter = self._iter
            self._overflows_since_rescale = 0
        if self.loss_scale <= self.min_loss_scale:
            self.loss_scale = prev_scale
            raise FloorStop("Minimum loss scale reached")
        self._iter += 1
        return self.loss_scale
