"""A range audit in PyTorch: float32 steps with statistics, read as "what would float16 do".

This is what `unimp audit --to float16` runs: a float32 recipe with a static loss scale equal to
float16's initial scale (2**15), statistics on every step, then `audit_stats` names each layer
whose outputs or gradients would overflow or flush to zero, with the fix. The weights of `l1` are
multiplied by 1e5 (as `--plant l1=1e5` does), so the audit finds an overflow starting at `l1`.

    python examples/guides/audit_torch.py
"""

from __future__ import annotations

import argparse

if __name__ == "__main__":  # --help answers before torch is imported
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

from collections import OrderedDict  # noqa: E402

import torch  # noqa: E402

import unimp  # noqa: E402
from unimp.compare.audit import audit_stats, initial_scale  # noqa: E402


def main() -> list:
    torch.manual_seed(0)
    model = torch.nn.Sequential(OrderedDict(
        l1=torch.nn.Linear(8, 32), act=torch.nn.ReLU(), l2=torch.nn.Linear(32, 4)))
    with torch.no_grad():
        model.l1.weight.mul_(1e5)         # the planted fault
    scale = initial_scale("float16")      # 32768.0
    mp = unimp.mixed_precision("float32", loss_scale=f"static:{scale:g}", backend="torch", device="cpu")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    step = mp.train_step(model, opt, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                         stats_every=1)
    steps = [step((torch.randn(16, 8), torch.randint(0, 4, (16,)))).stats for _ in range(3)]

    findings = audit_stats(steps, "float16")
    for f in findings:
        print(f"{f.kind:20} {f.layer:4} step {f.step}: {f.fraction:.0%} of {f.tensor}; fix: {f.fix}")
    return findings


if __name__ == "__main__":
    main()
