"""Per-layer overrides in PyTorch: the output layer `l2` kept in float32 under mixed_float16.

The recipe string's `;l2:float32` clause is the override; `mp.prepare` wraps `l2`'s forward so
it runs with autocast off and its inputs cast to float32, while `l1` computes in float16.

    python examples/guides/overrides_torch.py
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
    mp = unimp.mixed_precision("mixed_float16;l2:float32", backend="torch", device="cpu")
    print(mp.policy)                      # the override is part of the policy: str() parses back
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))

    seen = {}                             # each layer's output dtype, read by forward hooks
    for name in ("l1", "l2"):
        getattr(model, name).register_forward_hook(
            lambda mod, args, out, name=name: seen.__setitem__(name, str(out.dtype)))

    step = mp.train_step(model, opt, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    result = step((torch.randn(16, 8), torch.randint(0, 4, (16,))))
    print(f"l1 outputs {seen['l1']}, l2 outputs {seen['l2']}; loss {result.loss:.4f}")
    return seen


if __name__ == "__main__":
    main()
