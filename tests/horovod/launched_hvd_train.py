"""A Horovod training script that knows nothing of oktopk: SGD with
momentum through hvd.DistributedOptimizer, started by horovodrun (or, in
tests/horovod/test_horovod.py, by horovodrun running it under
``python -m oktopk.autohook``). ``--fp16`` passes Horovod's fp16
compression. It writes, per rank, where the optimizer counts them, the
bytes it sent, and its parameters' sums."""

import argparse
import json
import os

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--fp16", action="store_true")
args = ap.parse_args()

hvd.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                               compression=hvd.Compression.fp16 if args.fp16 else hvd.Compression.none)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for step in range(args.steps):
    g = torch.Generator().manual_seed(1000 * step + hvd.rank())
    x, y = torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
result = {"bytes_sent": getattr(opt, "bytes_sent", None),
          "params": [float(p.detach().sum()) for p in model.parameters()]}
with open(os.path.join(args.out, f"rank{hvd.rank()}.json"), "w") as f:
    json.dump(result, f)
if hasattr(opt, "close"):
    opt.close()
