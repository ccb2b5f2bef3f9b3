"""The peer a PyTorch user has today: torch.distributed's gloo allreduce of
the same n float32, timed the same way (barrier, then the call), launched
in the same namespaces as benchrank. Rank 0 prints one CSV row with
benchrank's columns (bench/cmd/benchrank's Header).

Every call reduces the same input, rank r's ``randn(n)`` from a generator
seeded with r, so rank 0 replays all P inputs to get the exact sum (float64)
and reports the relative error of gloo's float32 result to it.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def rss_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rank_input(n, r):
    return torch.randn(n, generator=torch.Generator().manual_seed(r))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 22)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--density", type=float, default=0.01, help="the configuration's density (gloo itself is dense: k = n)")
    ap.add_argument("--rate-bps", type=float, default=0.0, help="link rate for the lower-bound time (0: unknown)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    p, rank, n = dist.get_world_size(), dist.get_rank(), args.n
    base_rss = rss_mib("VmRSS")
    x0 = rank_input(n, rank)
    x = torch.empty_like(x0)
    times = []
    for it in range(args.warmup + args.iters):
        x.copy_(x0)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        if it >= args.warmup:
            times.append(1000 * (time.perf_counter() - start))
    peak = torch.tensor([rss_mib("VmHWM"), base_rss], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        del x0
        ref = torch.zeros(n, dtype=torch.float64)
        for r in range(p):
            ref += rank_input(n, r).double()
        rel_error = ((x.double() - ref).norm() / ref.norm()).item()
        words = 2 * n * (p - 1) / p
        lower_ms = 1000 * words * 32 / args.rate_bps if args.rate_bps > 0 else float("nan")
        print(
            f"torch_gloo_allreduce,{p},{n},{args.density:g},{n},{args.iters},{statistics.median(times):.2f},{min(times):.2f},"
            f"{max(times):.2f},0,{statistics.median(times):.2f},{words:.0f},{words:.0f},{words:.0f},{words:.0f},"
            f"{words:.0f},1.000,{lower_ms:.2f},{n},{rel_error:.3g},{peak[0].item():.0f},{peak[1].item():.0f}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
