"""One rank of the wheel test, run by torchrun from a fresh virtualenv with
the system libzmq hidden: three DDP steps (a dense warm-up, then two) through oktopk's hook, then prints
where oktopk, its library, libzmq and torch came from, and whether every
rank holds the same parameters."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import oktopk
from oktopk import OkTopkState, oktopk_hook

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
state = OkTopkState(density=0.1, timeout=60.0)  # step 0 is the dense warm-up
model.register_comm_hook(state, oktopk_hook)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    g = torch.Generator().manual_seed(step * 10 + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(gathered, flat)
same = all(torch.equal(gathered[0], t) for t in gathered)
with open("/proc/self/maps") as f:
    zmq = sorted({line.split()[-1] for line in f if "libzmq" in line})
# One write of the whole line (well under PIPE_BUF), so that the two ranks'
# lines, sharing torchrun's stdout, never interleave (print writes the text
# and the newline separately).
line = (f"RANK {rank} oktopk={oktopk.__file__} library={oktopk.library_path()} torch={torch.__file__} "
        f"libzmq={','.join(zmq)} communicator={state._reducer.comm is not None} identical={same}\n")
os.write(sys.stdout.fileno(), line.encode())
state.close()
dist.destroy_process_group()
sys.exit(0 if same else 1)
