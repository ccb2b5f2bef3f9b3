"""The peer a PyTorch user has today: torch.distributed's gloo allreduce of
the same n float32, timed the same way as benchrank (a barrier, then the
call, which lasts from the first rank's start to the last rank's end on the
wall clock every process on the machine shares), launched in the same
namespaces. Rank 0 prints one CSV row with benchrank's columns
(bench/cmd/benchrank's Header). Gloo's phases (a ring's reduce-scatter and
allgather) are not visible from outside: their times are nan, their wire
times the ring's n(P−1)/P words each ÷ the rate.

Every call reduces the same input, rank r's ``randn(n)`` from a generator
seeded with r, so rank 0 replays all P inputs to get the exact sum (float64)
and reports the relative error of gloo's float32 result to it.
"""

import argparse
import time

import torch
import torch.distributed as dist


def rss_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def median(v):
    """The upper median, as benchrank's."""
    return sorted(v)[len(v) // 2]


def rank_input(n, r):
    return torch.randn(n, generator=torch.Generator().manual_seed(r))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 22)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--density", type=float, default=0.01, help="the configuration's density (gloo itself is dense: k = n)")
    ap.add_argument("--rate-bps", type=float, default=0.0, help="link rate for the lower-bound time (0: unknown)")
    ap.add_argument("--rep", type=int, default=1, help="repetition number, printed in the row")
    ap.add_argument("--position", type=int, default=0, help="place of this job in its repetition's order, printed in the row")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    p, rank, n = dist.get_world_size(), dist.get_rank(), args.n
    base_rss = rss_mib("VmRSS")
    x0 = rank_input(n, rank)
    x = torch.empty_like(x0)
    stamps = []  # (start, end) of every timed call, ns on the shared wall clock
    for it in range(args.warmup + args.iters):
        x.copy_(x0)
        dist.barrier()
        start = time.time_ns()
        dist.all_reduce(x)
        end = time.time_ns()
        if it >= args.warmup:
            stamps.append((start, end))
    peak = torch.tensor([rss_mib("VmHWM"), base_rss], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    everyone = [torch.zeros(len(stamps), 2, dtype=torch.int64) for _ in range(p)]
    dist.all_gather(everyone, torch.tensor(stamps, dtype=torch.int64))
    if rank == 0:
        del x0
        ref = torch.zeros(n, dtype=torch.float64)
        for r in range(p):
            ref += rank_input(n, r).double()
        rel_error = ((x.double() - ref).norm() / ref.norm()).item()
        starts, ends = torch.stack(everyone)[:, :, 0], torch.stack(everyone)[:, :, 1]
        times = ((ends.max(0).values - starts.min(0).values) / 1e6).tolist()
        rank0 = ((ends[0] - starts[0]) / 1e6).tolist()
        skew = ((starts.max(0).values - starts.min(0).values) / 1e6).tolist()
        words = 2 * n * (p - 1) / p
        lower_ms = 1000 * words * 32 / args.rate_bps if args.rate_bps > 0 else float("nan")
        # Phases (benchrank's order): select, agree, reduce, global_select,
        # balance, allgather, output. Gloo has only the ring's
        # reduce-scatter (reduce) and allgather, whose times are not visible
        # from outside (nan); each moves half the words.
        phase_ms = ["0.00", "0.00", "nan", "0.00", "0.00", "nan", "0.00"]
        half, zero = f"{lower_ms / 2:.2f}", ("0.00" if args.rate_bps > 0 else "nan")
        wire_ms = [zero, zero, half, zero, zero, half, zero]
        print(
            f"torch_gloo_allreduce,{p},{n},{args.density:g},{n},{args.rep},{args.position},{args.iters},"
            f"{median(times):.2f},{min(times):.2f},{max(times):.2f},{median(rank0):.2f},{median(skew):.2f},"
            f"{','.join(phase_ms)},{','.join(wire_ms)},"
            f"{words:.0f},{words:.0f},{words:.0f},{words:.0f},{words:.0f},1.000,{lower_ms:.2f},{n},"
            f"{rel_error:.3g},{peak[0].item():.0f},{peak[1].item():.0f}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
