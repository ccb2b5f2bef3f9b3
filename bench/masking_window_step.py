"""A sparse step's time inside and after the default masking's window
(its first 100 steps with a sparse call): the hook with Ok-Topk named on
a 4.35M-parameter MLP, SGD with momentum 0.9, 170 steps, every rank timed
and the slowest rank's median taken over steps 40-100 (masked) and
120-170 (after). Run the same script against two checkouts of the plugin
(PYTHONPATH) to compare them; TAG names the run in its line.

    BENCH_MODE=loopback bench/cluster.sh 4 OUT "TAG=new PYTHONPATH=plugins/pytorch PYTHON bench/masking_window_step.py"
"""

import os, sys, time, statistics
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from oktopk import OkTopkState, oktopk_hook
dist.init_process_group("gloo"); torch.set_num_threads(1)
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)))
state = OkTopkState(algorithm="oktopk")
model.register_comm_hook(state, oktopk_hook)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
g = torch.Generator().manual_seed(rank)
times = []
for step in range(170):
    x = torch.randn(32, 64, generator=g); y = torch.randint(0, 10, (32,), generator=g)
    dist.barrier()
    t = time.perf_counter()
    loss = F.cross_entropy(model(x), y); opt.zero_grad(); loss.backward(); opt.step()
    times.append(time.perf_counter() - t)
slow = torch.tensor(times, dtype=torch.float64); dist.all_reduce(slow, op=dist.ReduceOp.MAX)
s = slow.tolist()
if rank == 0:
    print(os.environ.get("TAG"), "in window (steps 40-100) %.1f ms, after (120-170) %.1f ms, params %d, sparse steps counted %s" % (
        statistics.median(s[40:100]) * 1e3, statistics.median(s[120:170]) * 1e3, sum(p.numel() for p in model.parameters()),
        getattr(getattr(state._momentum, "mask", state._momentum), "sparse_steps", None)), flush=True)
state.close(); dist.destroy_process_group(); os._exit(0)
