"""Your own torch model in ``unimp compare``: a small CNN for the digits (8x8 grey images).

    unimp compare --model examples/compare/torch_model.py:build --recipes float32,mixed_float16,mixed_bfloat16

``build`` returns a new ``nn.Module``; ``unimp compare`` seeds torch before each call, so every
recipe starts from the same weights. The model takes a batch ``x`` as the data holds it (the
digits: float32 NHWC, shape (N, 8, 8, 1)) and returns one row of class logits per example.
"""

import torch


def build() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Flatten(2),  # (N, 8, 8, 1) -> (N, 8, 8): the rows as channels of a 1-d convolution
        torch.nn.Conv1d(8, 32, kernel_size=3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.LayerNorm(32 * 8),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(32 * 8, 10),
    )


def regression_data():
    """``--data examples/compare/torch_model.py:regression_data --loss mse`` with
    ``--model examples/compare/torch_model.py:regressor``: y = sin(3 x0) + x1^2 (float targets)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (1200, 2)).astype(np.float32)
    y = (np.sin(3 * x[:, 0]) + x[:, 1] ** 2).astype(np.float32)[:, None]
    return x[:1000], y[:1000], x[1000:], y[1000:]


def regressor() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


if __name__ == "__main__":  # a model file for unimp compare, not a script: --help says so
    import argparse

    argparse.ArgumentParser(
        usage=f"unimp compare --model {__file__}:build [--recipes ...]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args()
