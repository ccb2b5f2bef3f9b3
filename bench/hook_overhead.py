"""Where a comm hook's step time goes on a small model: forward, backward
(with the bucket's reduction, which the hook runs) and the optimizer step,
each timed on every rank, for plain DDP, torch's own ``allreduce_hook`` and
the oktopk hook with its defaults and with ``grads_as_bucket_views=False``.

The matrix (bench/ddp_matrix.sh) times whole steps; on the demo's CNN
(0.1M parameters, one bucket, ~20 ms steps over loopback) the spread between
its repeats is as large as the hook's own cost. Here every method runs
REPS times in one set of processes, in a shuffled order each repeat, each
run STEPS steps from the same seed; per method it prints the median over
the repeats of each part's median (this rank's) and of the slowest rank's
step, the repeats' slowest-rank steps beside it.

    BENCH_MODE=loopback bench/cluster.sh 4 OUT \\
        "PYTHONPATH=plugins/pytorch PYTHON bench/hook_overhead.py --reps 6"
"""

import argparse
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "pytorch"))
from cnn import VGGStyle, digits  # noqa: E402
from ddp_e2e import exit_now  # noqa: E402

METHODS = ("ddp", "allreduce_hook", "oktopk", "oktopk_no_bucket_views")


def run(method, x, y, steps, skip):
    """One method's run: per step (forward, backward, optimizer) seconds on
    this rank, and the slowest rank's whole step."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(VGGStyle(1))
    state = None
    if method.startswith("oktopk"):
        from oktopk import OkTopkState, oktopk_hook

        state = OkTopkState(grads_as_bucket_views=method == "oktopk")
        model.register_comm_hook(state, oktopk_hook)
    elif method == "allreduce_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    parts = []
    dist.barrier()
    for _ in range(steps):
        idx = torch.randint(0, len(y), (16,), generator=g)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        t1 = time.perf_counter()
        opt.zero_grad()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        parts.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
    slowest = torch.tensor([p[3] for p in parts], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if state is not None:
        state.close()
    after = parts[skip:]
    return [statistics.median(p[k] for p in after) * 1e3 for k in range(3)] + [statistics.median(slowest.tolist()[skip:]) * 1e3]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--skip", type=int, default=32, help="steps left out: the warm-up, the first probes and a confirmation")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    x, y = digits(0)[0]
    results = {m: [] for m in METHODS}
    for rep in range(args.reps):
        order = list(METHODS)
        random.Random(rep).shuffle(order)  # the same order on every rank
        for method in order:
            results[method].append(run(method, x, y, args.steps, args.skip))
    if dist.get_rank() == 0:
        print(f"hook_overhead: {dist.get_world_size()} ranks, the CNN (width 1), {args.reps} repeats of {args.steps} steps "
              f"(medians over steps {args.skip}-{args.steps}), ms")
        print(f"{'method':24s} {'forward':>8s} {'backward':>9s} {'optimizer':>10s} {'step':>7s}  slowest-rank step per repeat")
        for method, runs in results.items():
            med = [statistics.median(r[k] for r in runs) for k in range(4)]
            print(f"{method:24s} {med[0]:8.2f} {med[1]:9.2f} {med[2]:10.2f} {med[3]:7.2f}  {[round(r[3], 1) for r in runs]}", flush=True)
    dist.destroy_process_group()
    exit_now()


if __name__ == "__main__":
    main()
