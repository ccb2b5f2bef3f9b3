"""One rank of the two-host test: a few DDP steps with oktopk's hook, then
checks that every rank holds the same parameters and that this rank's
endpoint is on its host's address (EXPECT_HOST)."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from oktopk import OkTopkState, oktopk_hook

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
state = OkTopkState(density=0.05)
model.register_comm_hook(state, oktopk_hook)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    g = torch.Generator().manual_seed(step * 10 + rank)
    x, y = torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(gathered, flat)
same = all(torch.equal(gathered[0], t) for t in gathered)
endpoint = state._reducer.comm.endpoint
want = os.environ["EXPECT_HOST"]
print(f"rank {rank}: endpoint {endpoint}, parameters identical on all ranks: {same}", flush=True)
state.close()
dist.destroy_process_group()
sys.exit(0 if same and f"//{want}:" in endpoint else 1)
