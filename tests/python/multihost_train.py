"""One rank of the two-host test: a few DDP steps with oktopk's hook, then
checks that every rank holds the same parameters and that this rank's
endpoint is on its host's address (EXPECT_HOST)."""

import os
import sys

import torch.distributed as dist
from ddp_steps import train_and_compare

from oktopk import OkTopkState, oktopk_hook

dist.init_process_group("gloo")
rank = dist.get_rank()
state = OkTopkState(density=0.05, algorithm="oktopk")  # sparse from the third step: its endpoint is checked
same = train_and_compare(rank, state, oktopk_hook, steps=5, width=32)
endpoint = state._reducer.comm.endpoint
want = os.environ["EXPECT_HOST"]
print(f"rank {rank}: endpoint {endpoint}, parameters identical on all ranks: {same}", flush=True)
state.close()
dist.destroy_process_group()
sys.exit(0 if same and f"//{want}:" in endpoint else 1)
