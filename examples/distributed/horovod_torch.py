"""unimp's loss scaling with Horovod (torch), float16 gradient compression made safe.

Build Horovod first (0.28.1 needs a C++17 patch for current torch): scripts/build_horovod.sh.
Then start it with Horovod's launcher:

    horovodrun -np 2 -H localhost:2 --gloo python examples/distributed/horovod_torch.py
    horovodrun -np 2 -H localhost:2 --gloo python examples/distributed/horovod_torch.py --compression hvd-fp16

Two ranks train Linear(2, 1) on inputs of ones (rank 0) and twos (rank 1) with the default
scale 65536. With Horovod's own ``hvd.Compression.fp16`` the loss-scaled gradients (65536 and
131072) are inf in float16 on the wire: every step is skipped and the scale keeps halving.
With ``--compression fp16`` unimp's LossScaleCompression unscales and divides by the world size
in float32 before the cast, so the first step applies and the scale stays 65536. The loop is
Horovod's documented AMP pattern (synchronize, unscale_, step inside skip_synchronize, update),
in unimp.distributed.horovod.torch.amp_step; unimp's scaler reduces the overflow flag over the ranks.
"""

import argparse
import json
import os

import torch

from unimp.loss_scale import DynamicLossScale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--compression", choices=["none", "fp16", "hvd-fp16"], default="fp16")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--poison-first-step", action="store_true",
                    help="make rank 1's first local gradient inf after the all-reduce")
    ap.add_argument("--out", help="directory for a JSON result per rank (used by the tests)")
    args = ap.parse_args()
    # imported after parsing, so --help works where Horovod is not built
    import horovod.torch as hvd

    import unimp.distributed.horovod.torch as uhvd

    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    scaler = uhvd.GradScaler(DynamicLossScale.preset("torch"), device="cpu")  # init 65536
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if args.compression == "hvd-fp16":  # Horovod's own: the failure unimp prevents
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvd.Compression.fp16)
    else:
        opt = uhvd.DistributedOptimizer(opt, scaler, named_parameters=model.named_parameters(),
                                        compression=args.compression)
    x = torch.full((1, 2), float(rank + 1))  # ones on rank 0, twos on rank 1
    steps = []
    for i in range(args.steps):
        opt.zero_grad()
        loss = model(x).sum()
        scaler.scale(loss).backward()
        if args.poison_first_step and i == 0:
            opt.synchronize()
            if rank == 1:
                with torch.no_grad():
                    model.weight.grad.view(-1)[0] = float("inf")
        applied = uhvd.amp_step(opt, scaler)
        steps.append({"applied": bool(applied), "scale_after": scaler.get_scale(),
                      "params": [p.detach().reshape(-1).tolist() for p in model.parameters()]})
        print(f"rank {rank} step {i}: applied {bool(applied)} scale now {scaler.get_scale():g}", flush=True)
    if args.out:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(steps, f)


if __name__ == "__main__":
    main()
