"""Matmul precision in PyTorch: the policy's `matmul_precision` is set for the train step only.

`"mixed_bfloat16,matmul=high"` asks for TF32 float32 matmuls (torch's `fp32_precision` switches,
or `set_float32_matmul_precision` before torch 2.9) inside the step and `mp.autocast()`; the
previous setting comes back after each call. On a CPU every setting computes full float32.

    python examples/guides/precision_torch.py
"""

from __future__ import annotations

import argparse

if __name__ == "__main__":  # --help answers before torch is imported
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

import torch  # noqa: E402

import unimp  # noqa: E402
from unimp.backends.torch import current_matmul_precision  # noqa: E402


def main() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    mp = unimp.mixed_precision("mixed_bfloat16,matmul=high", backend="torch", device="cpu")
    print(f"policy: {mp.policy}  (matmul_precision={mp.policy.matmul_precision!r})")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))

    seen = {"before": current_matmul_precision()}

    def loss_fn(m, batch):
        seen["in the step"] = current_matmul_precision()  # what the step's matmuls run under
        return m(batch).float().pow(2).mean()

    mp.train_step(model, opt, loss_fn)(torch.randn(16, 8))
    seen["after"] = current_matmul_precision()
    for when, setting in seen.items():
        print(f"{when:>12}: {setting}")
    return seen


if __name__ == "__main__":
    main()
