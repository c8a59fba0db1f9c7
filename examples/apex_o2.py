"""An Apex-era O2 training script; the only change is its import line.

Before: ``from apex import amp`` (Apex amp was removed from NVIDIA Apex in 2025, and
``pip install apex`` installs an unrelated package). After: the line below. Everything else is
the script as Apex's docs wrote it: ``amp.initialize``, ``amp.scale_loss``,
``amp.master_params`` for clipping, ``amp.state_dict`` in the checkpoint. It used ``.cuda()``;
here the device is CUDA when present, else the CPU (torch.autocast runs float16 on both).

    python examples/apex_o2.py [--opt-level O1|O2]
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

from unimp.compat.apex import amp  # was: from apex import amp

parser = argparse.ArgumentParser()
parser.add_argument("--opt-level", default="O2")
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.bn = nn.BatchNorm1d(64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


model = Net().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, loss_scale="dynamic")

x = torch.randn(256, 32, device=device)
y = (x[:, :4].argmax(1)).to(device)
for step in range(args.steps):
    optimizer.zero_grad()
    output = model(x)
    loss = F.cross_entropy(output, y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 5.0)
    optimizer.step()
    if step % 10 == 0:
        print(f"step {step:3d} loss {loss.item():.4f}")

checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}
amp.load_state_dict(checkpoint["amp"])
print(f"final loss {loss.item():.4f}; amp state {checkpoint['amp']['loss_scaler0']['state']}")
