"""The MLP loop from the seed article (784 -> 512 ReLU -> Dropout 0.2 -> 10), done right with unimp.

The article called ``loss.backward()`` and ``optimizer.step()`` and then
``scaler.scale(loss).backward()`` and ``scaler.step()`` again: every batch was backpropagated
twice (the second time through a freed graph) and stepped twice, once with unscaled float16
gradients. With loss scaling there is ONE backward, of the scaled loss, and ONE step, which the
scaler skips when the gradients overflowed. Here the whole step is ``mp.train_step``; the plain
torch.amp-style loop with ``unimp``'s GradScaler is shown too (``--loop scaler``).

Random data, a few steps, CPU by default (``--device cuda`` on a GPU). Runs in a few seconds.

    python examples/torch_mlp.py [--recipe mixed_bfloat16] [--device cpu] [--loop train_step|scaler]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn

import unimp
from unimp.backends.torch import GradScaler


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Dropout(0.2), nn.Linear(512, 10))


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="mixed_float16")
    parser.add_argument("--device", default=None, help="default: the accelerator, else cpu")
    parser.add_argument("--loop", choices=["train_step", "scaler"], default="train_step")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    mp = unimp.mixed_precision(args.recipe, backend="torch", device=args.device)
    model = make_model().to(mp.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()
    model, optimizer = mp.prepare(model, optimizer)
    # random "MNIST": 4 batches of 64 flattened images, reused
    data = [(torch.randn(64, 784, device=mp.device), torch.randint(0, 10, (64,), device=mp.device))
            for _ in range(4)]

    if args.loop == "train_step":
        step = mp.train_step(model, optimizer, lambda m, b: criterion(m(b[0]), b[1]), max_grad_norm=1.0)
        for i in range(args.steps):
            result = step(data[i % len(data)])
        print(f"{mp.recipe.describe()}\nlast step: {result}")
        return result.loss

    scaler = GradScaler(mp.loss_scale, device=mp.device)
    for i in range(args.steps):
        images, labels = data[i % len(data)]
        optimizer.zero_grad()
        with mp.autocast():
            loss = criterion(model(images), labels)
        scaler.scale(loss).backward()  # the only backward
        scaler.step(optimizer)  # the only step; skipped on the device if gradients overflowed
        scaler.update()
    print(f"{mp.recipe.describe()}\nlast loss {loss.item():.4f}, scale {scaler.get_scale():g}")
    return loss.item()


if __name__ == "__main__":
    main()
