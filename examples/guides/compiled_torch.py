"""A compiled step in PyTorch: `train_step(..., compile=True)` runs the whole step compiled.

The forward and backward under autocast, the unscale, the finite check, the guarded update and
the loss-scale update are one `torch.compile`d function (inductor; on a CPU it needs a C++
compiler), with no graph break of unimp's and no recompilation through applied and skipped
steps. Step 3's loss is multiplied by 1e9: its float16 gradients overflow, the step is skipped
inside the graph and the scale halves.

    python examples/guides/compiled_torch.py
"""

from __future__ import annotations

import argparse

if __name__ == "__main__":  # --help answers before torch is imported
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

import time  # noqa: E402

import torch  # noqa: E402

import unimp  # noqa: E402


def main() -> list:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    mp = unimp.mixed_precision("mixed_float16", backend="torch", device="cpu")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def loss_fn(m, batch):
        x, y, factor = batch
        return torch.nn.functional.cross_entropy(m(x), y) * factor

    step = mp.train_step(model, opt, loss_fn, compile=True)
    results = []
    for i in range(6):
        start = time.perf_counter()
        factor = torch.tensor(1e9 if i == 3 else 1.0)        # a tensor: no recompilation
        r = step((torch.randn(16, 8), torch.randint(0, 4, (16,)), factor))
        print(f"step {i}: applied {r.applied}, scale {r.scale:g}, "
              f"{time.perf_counter() - start:.2f} s")
        results.append(r)
    return results


if __name__ == "__main__":
    main()
