"""Plain transcriptions of each implementation's FP8 scaling rule, written from their sources
(file and commit in docs/fp8.md), one Python step at a time in float32 NumPy scalars and in each
implementation's own layout. tests/test_fp8.py checks unimp's presets against them.

Each ``run_*`` takes a list of per-step maxima and returns, per step, the float32 multiplier the
implementation quantizes that step with (Keras and flax divide by a stored divisor ``d``; their
multiplier here is ``1 / d`` in float32, what XLA computes for ``x / d``).
"""

from __future__ import annotations

import numpy as np
import torch

F = np.float32
F32MAX = F(np.finfo(np.float32).max)


def run_keras(amaxes, L, fmax=448.0, margin=0):
    """keras/src/layers/core/dense.py _float8_call + quantizers.compute_float8_scale /
    compute_float8_amax_history: quantize with the stored divisor, then compute the next one from
    max(history) BEFORE the current amax is written (roll -1, set [0])."""
    d, hist, used = F(1.0), np.zeros(L, F), []
    with np.errstate(all="ignore"):
        for a in amaxes:
            used.append(F(1.0) / d)
            amax = F(np.max(hist))
            r = F(1.0) / d
            sf = F(F(F(fmax) / amax) / F(2**margin))
            if not amax > 0.0:
                sf = r
            if not np.isfinite(amax):
                sf = r
            d = F(1.0) / sf
            hist = np.roll(hist, -1)
            hist[0] = F(a)
    return used


def run_flax(amaxes, L, fmax=448.0):
    """flax/linen/fp8_ops.py quantize_dequantize_update: update_fp8_meta (compute_scale from
    max(history), then compute_amax_history) and quantize with the UPDATED divisor."""
    d, hist, used = F(1.0), np.zeros(L, F), []
    with np.errstate(all="ignore"):
        for a in amaxes:
            amax = F(np.max(hist))
            s = F(1.0) / d
            sf = F(F(F(fmax) / amax) / F(1))
            sf = sf if amax > 0.0 else s
            sf = sf if np.isfinite(amax) else s
            d = F(1.0) / sf
            hist = np.roll(hist, -1)
            hist[0] = F(a)
            used.append(F(1.0) / d)
    return used


def run_te_delayed(amaxes, L, fmax=448.0, margin=0, algo="max"):
    """transformer_engine/common/recipe/delayed_scaling.cu kernel_bulk (the fused update torch
    uses): the forward writes amax_history[0]; the update rolls (unless that amax is 0), takes
    fmaxf over the window from 0 (skips NaN), then scale = scaled_max / amax or keeps it."""
    scale, hist, used = F(1.0), np.zeros(L, F), []
    scaled_max = F(F(fmax) * F(2.0 ** -margin))
    with np.errstate(all="ignore"):
        for a in amaxes:
            used.append(scale)
            hist[0] = F(a)  # written by the forward pass
            last = hist[0]
            amax = F(0.0)
            if last != 0.0:
                new = np.zeros(L, F)
                for i in range(L):
                    v = hist[i + 1] if i < L - 1 else last
                    amax = F(np.fmax(amax, v))
                    new[i] = v if i > 0 else F(0.0)
                hist = new
            if algo == "most_recent":
                amax = last
            if np.isfinite(amax) and amax > 0:
                s = F(scaled_max / amax)
            else:
                s = scale
            if np.isinf(s):
                s = F32MAX
            scale = s
    return used


def run_te_current(amaxes, fmax=448.0, pow2=False):
    """recipe_common.cuh compute_scale_from_amax (epsilon 0, float32 input)."""
    used = []
    with np.errstate(all="ignore"):
        for a in amaxes:
            amax = F(a)
            if np.isinf(amax) or amax == 0.0 or np.isnan(amax):
                s = F(1.0)
            else:
                s = F(F(fmax) / amax)
                if np.isinf(s):
                    s = F32MAX
                if pow2:
                    s = np.array(s, F).view(np.uint32) & np.uint32(0xFF800000)
                    s = F(s.view(F))
            used.append(s)
    return used


def run_torchao(amaxes, fp8_dtype=torch.float8_e4m3fn, pow2=False):
    """torchao/float8/float8_utils.py amax_to_scale, run in torch (float64 division, EPS 1e-12,
    then float32; _round_scale_down_to_power_of_2 = exp2(floor(log2)))."""
    used = []
    for a in amaxes:
        amax = torch.tensor(float(F(a)), dtype=torch.float32).to(torch.float64)
        res = (torch.finfo(fp8_dtype).max / torch.clamp(amax, min=1e-12)).to(torch.float32)
        if pow2:
            res = torch.exp2(torch.floor(torch.log2(res)))
        used.append(F(res.item()))
    return used
