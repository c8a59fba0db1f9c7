"""Data-parallel training with unimp's train step under torch DDP.

Start it with torch's own launcher (CPU with gloo here; GPUs use nccl automatically):

    torchrun --standalone --nproc-per-node 2 examples/distributed/torch_ddp.py
    torchrun --standalone --nproc-per-node 2 examples/distributed/torch_ddp.py --fp16-wire

What unimp adds to plain DDP:
* the train step's GradScaler all-reduces its overflow flag over the default process group
  before the skip and the scale update, so every replica skips together and keeps the same
  scale (printed below for every rank);
* the first step checks once that every rank holds the same loss-scale state (a checkpoint
  loaded on one rank only is re-synchronized from rank 0 with a ReplicaDesyncWarning);
* ``--fp16-wire``: gradients travel as float16 with unimp.distributed.torch.fp16_mean_hook,
  which divides by the world size first so the average never overflows when it fits float16.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import unimp
import unimp.distributed.torch as udt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--fp16-wire", action="store_true", help="float16 gradient all-reduce")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("start me with torchrun, e.g. torchrun --standalone --nproc-per-node 2 " + __file__)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    mp = unimp.mixed_precision("mixed_float16", backend="torch", device=device)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    model = DDP(mp.prepare(model), device_ids=[local] if cuda else None)
    if args.fp16_wire:
        model.register_comm_hook(None, udt.fp16_mean_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def loss_fn(m, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(m(x).float(), y)

    step = mp.train_step(model, opt, loss_fn, max_grad_norm=1.0)  # scaler reduces over the group
    g = torch.Generator().manual_seed(1234 + rank)  # each rank its own shard of the data
    for i in range(args.steps):
        x = torch.randn(16, 8, generator=g)
        y = x.sum(dim=1, keepdim=True)
        r = step((x.to(device), y.to(device)))
        if i % 5 == 0 or i == args.steps - 1:
            print(f"rank {rank}/{world} step {i}: loss {r.loss:.4f} scale {r.scale:g} applied {r.applied}", flush=True)
    # every replica holds the same loss-scale state and the same parameters
    fingerprint = udt.state_fingerprint(step.scaler)
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    both = torch.cat([fingerprint, flat.double()])
    gathered = [torch.empty_like(both) for _ in range(world)]
    dist.all_gather(gathered, both)
    if rank == 0:
        same = all(torch.equal(gathered[0], t) for t in gathered)
        print(f"replicas identical (loss-scale state and parameters): {same}", flush=True)
        if not same:
            raise SystemExit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
