"""Tensor statistics in PyTorch: `train_step(..., stats_every=k)` on steps 0, k, 2k, ...

Per parameter gradient (unscaled) and per layer output: the largest magnitude, and for float16
and bfloat16 the share that would overflow or flush to zero and the headroom in bits. They stay
on the device until `result.stats` is read; the other steps run exactly as without the option.

    python examples/guides/stats_torch.py
"""

from __future__ import annotations

import argparse

if __name__ == "__main__":  # --help answers before torch is imported
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

from collections import OrderedDict  # noqa: E402

import torch  # noqa: E402

import unimp  # noqa: E402


def main() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(OrderedDict(
        l1=torch.nn.Linear(8, 32), act=torch.nn.ReLU(), l2=torch.nn.Linear(32, 4)))
    mp = unimp.mixed_precision("mixed_float16", backend="torch", device="cpu")
    model, opt = mp.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    step = mp.train_step(model, opt, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                         stats_every=2)
    taken, stats = [], None
    for i in range(4):
        r = step((torch.randn(16, 8), torch.randint(0, 4, (16,))))
        if r.stats is not None:           # steps 0 and 2 (None on the others)
            stats = r.stats
            g, a = stats.gradients["l1.weight"], stats.activations["l1"]
            print(f"step {i}: l1.weight grad amax {g.amax:.3g}, float16 headroom "
                  f"{g.headroom('float16'):.1f} bits, flushed {g.fraction('float16_flush'):.1%}; "
                  f"l1 output amax {a.amax:.3g}")
            taken.append(i)
    print(f"statistics steps: {taken}; gradients {sorted(stats.gradients)}, "
          f"layer outputs {sorted(stats.activations)}")
    return {"steps": taken, "stats": stats}


if __name__ == "__main__":
    main()
