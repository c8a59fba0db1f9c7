"""FP8 in PyTorch: the `fp8-delayed` recipe puts an emulated float8 matmul into the middle layer.

An FP8 recipe selects Linear layers (the first and the last stay out by default) and
`mp.prepare` swaps each selected `nn.Linear` for an `FP8Dense` sharing its Parameters. Every
step quantizes the input, the weight and the output gradient to float8 with delayed scaling
(the scale of step t from the maxima of the steps before), the same rule in every framework.
Float8 is emulated unless `UNIMP_FP8_NATIVE=1` on a GPU with float8 units (a warning says so).

    python examples/guides/fp8_torch.py
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
        l1=torch.nn.Linear(8, 32), a1=torch.nn.ReLU(), l2=torch.nn.Linear(32, 32),
        a2=torch.nn.ReLU(), l3=torch.nn.Linear(32, 4)))
    mp = unimp.mixed_precision("fp8-delayed", backend="torch", device="cpu")
    print(f"recipe: {mp.recipe.describe()}")
    print(f"float8 layers: {mp.fp8_layers(model)}")        # ('l2',): l1 and l3 stay bfloat16
    model, opt = mp.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    print(f"l2 is now {type(model.l2).__name__}")

    step = mp.train_step(model, opt, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    for i in range(3):
        r = step((torch.randn(16, 8), torch.randint(0, 4, (16,))))
        scales = {t: float(model.l2.fp8_state(t).scale) for t in ("input", "kernel", "grad")}
        print(f"step {i}: loss {r.loss:.4f}, l2's float8 scales {scales}")
    return {"layers": mp.fp8_layers(model), "model": model, "scales": scales}


if __name__ == "__main__":
    main()
