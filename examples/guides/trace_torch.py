"""A dtype trace in PyTorch: which ops of one train step ran in which dtype, per layer.

`mp.trace(step, batch)` runs the step under a torch dispatch mode and puts the model, optimizer
and loss scale back afterwards, so tracing takes no step. Records use one op vocabulary in every
framework (`unimp.trace.OPS`); `unimp trace RECIPE` does the same from the command line.

    python examples/guides/trace_torch.py
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
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = mp.train_step(model, opt, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))

    trace = mp.trace(step, (torch.randn(16, 8), torch.randint(0, 4, (16,))))
    print(trace)
    matmuls = {}
    for r in trace.select(op="matmul"):
        matmuls.setdefault((r.layer, r.phase), set()).add(r.compute)
        print(f"  {r.phase:8} {r.layer or '-':4} {r.native:18} computes in {r.compute}")
    print(f"casts: {len(trace.casts())}; by layer: {trace.summary()['by_layer']}")
    return {"trace": trace, "matmuls": matmuls}


if __name__ == "__main__":
    main()
