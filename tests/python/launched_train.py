"""A training script that knows nothing of oktopk: plain DDP over gloo,
SGD with momentum, started by torchrun (or `python -m oktopk.run`).
``--own-hook`` registers torch's allreduce_hook itself; ``--no-ddp``
never builds DDP. It writes, per rank, the comm hooks its DDP module ended
with and, where oktopk's hook was put on it, the bytes its state sent
(tests/python/test_launcher.py reads them)."""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--own-hook", action="store_true")
ap.add_argument("--no-ddp", action="store_true")
args = ap.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
model = net if args.no_ddp else DDP(net)
if args.own_hook:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model.register_comm_hook(None, allreduce_hook)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(args.steps):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
hooks = [(getattr(h, "__module__", ""), getattr(h, "__qualname__", ""), s) for h, s in getattr(model, "_comm_hooks", [])]
result = {"argv": sys.argv[1:], "hooks": [f"{m}.{q}" for m, q, _ in hooks],
          "bytes_sent": [s.bytes_sent for m, _, s in hooks if m.startswith("oktopk")],
          "params": [float(p.detach().sum()) for p in net.parameters()]}
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
