"""The peer a PyTorch user has today: torch.distributed's gloo allreduce of
the same n float32, timed the same way (barrier, then the call), launched
in the same namespaces as benchrank. Rank 0 prints one CSV row."""

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=1 << 22)
ap.add_argument("--iters", type=int, default=20)
ap.add_argument("--warmup", type=int, default=3)
args = ap.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
p = dist.get_world_size()
x = torch.randn(args.n)
times = []
for it in range(args.warmup + args.iters):
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(x)
    if it >= args.warmup:
        times.append(1000 * (time.perf_counter() - start))
    x.div_(p)
if dist.get_rank() == 0:
    words = 2 * args.n * (p - 1) / p
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"torch_gloo_allreduce,{p},{args.n},1,{args.n},{statistics.median(times):.2f},{min(times):.2f},{max(times):.2f},0,{words:.0f},{words:.0f},nan,nan,0,{rss}", flush=True)
dist.destroy_process_group()
