"""One task of `srun -n 4`: DDP over gloo with oktopk's hook, set up the way
a Slurm user's script does (rank and size from SLURM_PROCID and
SLURM_NTASKS, the store on MASTER_ADDR, which the batch line takes from
`scontrol show hostnames`). A few steps at density 5%, then every task
checks that all hold the same parameters and prints one line saying so."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "plugins", "pytorch"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from oktopk import OkTopkState, oktopk_hook  # noqa: E402

rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                        rank=rank, world_size=world)
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
state = OkTopkState(density=0.05, timeout=60.0)
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
sent = state._reducer.comm is not None
print(f"slurm task {rank} of {world}: oktopk communicator {sent}, parameters identical on all tasks: {same}", flush=True)
state.close()
dist.destroy_process_group()
sys.exit(0 if same and sent else 1)
