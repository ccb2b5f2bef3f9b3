"""The training part of the rank scripts that run DDP with oktopk's hook
under a real launcher (tests/launch/slurm_ddp.py under srun,
tests/python/multihost_train.py under torchrun on two hosts,
tests/wheel/ddp_step.py under torchrun from a fresh virtualenv): a few
steps of a small seeded model, then whether every rank holds the same
parameters. It imports torch only, so each script still decides where
oktopk comes from: the wheel test copies this file beside its script and
takes oktopk from the installed wheel alone."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def train_and_compare(rank, state, hook, steps, width):
    """Runs `steps` SGD steps of a DDP model (width inputs, 2·width hidden,
    4 classes; the same initial weights on every rank) on this rank's own
    seeded minibatches, its gradients through hook with state, and returns
    whether every rank's parameters are now bitwise the same."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, 4)))
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(8, width, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], t) for t in gathered)
