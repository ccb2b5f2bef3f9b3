"""Makes saved_states.pt: checkpoints of OkTopkState as a given version of
the plugin saves them, for test_settings.py's check that today's code loads
them (or refuses them naming both layouts). Run with that version's plugin
on the path:

    PYTHONPATH=plugins/pytorch python tests/python/data/make_saved_states.py OUT.pt

One process (a world of 1 over gloo), a small MLP under DDP, 6 steps: the
warm-up, then sparse steps (algorithm "oktopk"), and the measured choice's
state under SGD with momentum; each state's state_dict() and pickle after
the last step, with the settings it was made with."""

import os
import pickle
import sys

import torch
import torch.distributed as dist

from oktopk import OkTopkState, oktopk_hook

CASES = {
    "oktopk": dict(density=0.05, algorithm="oktopk", tau=2, tau_prime=3, momentum_correction=False),
    "choice-momentum": dict(density=0.05, warmup_iters=3, momentum_masking="waited", recheck_every=8),
}


def run(settings):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = OkTopkState(**settings)
    ddp.register_comm_hook(state, oktopk_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(6):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    saved = {"settings": settings, "state_dict": state.state_dict(), "pickle": pickle.dumps(state)}
    state.close()
    return saved


def main(out):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.save({name: run(settings) for name, settings in CASES.items()}, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
