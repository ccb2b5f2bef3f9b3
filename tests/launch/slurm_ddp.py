"""One task of `srun -n 4`: DDP over gloo with oktopk's hook, set up the way
a Slurm user's script does (rank and size from SLURM_PROCID and
SLURM_NTASKS, the store on MASTER_ADDR, which the batch line takes from
`scontrol show hostnames`). A few steps at density 5%, then every task
checks that all hold the same parameters and prints one line saying so."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "plugins", "pytorch"))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ddp_steps import train_and_compare  # noqa: E402

from oktopk import OkTopkState, oktopk_hook  # noqa: E402

rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                        rank=rank, world_size=world)
state = OkTopkState(density=0.05, algorithm="oktopk", timeout=60.0)  # sparse after the warm-up: the communicator is checked
same = train_and_compare(rank, state, oktopk_hook, steps=5, width=32)
sent = state._reducer.comm is not None
print(f"slurm task {rank} of {world}: oktopk communicator {sent}, parameters identical on all tasks: {same}", flush=True)
state.close()
dist.destroy_process_group()
sys.exit(0 if same and sent else 1)
