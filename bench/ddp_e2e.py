"""End-to-end rows of the benchmark: the CNN of examples/pytorch/cnn.py
(``--width 13``: about 16M parameters) trained under DDP over gloo with one
communication hook, the same data, initialization and steps for every hook.
Rank 0 prints one CSV row (``HEADER``).

Hooks: ``ddp`` (plain DDP, gloo allreduce), ``fp16`` (torch's
``fp16_compress_hook``), ``powersgd`` (torch's ``powerSGD_hook``, rank 1,
compression from the 2nd step, one bucket: see below) and ``oktopk`` (our ``oktopk_hook``). The
first ``--warmup-steps`` steps are untimed (every hook is past its dense
warm-up by then); iterations per second count the timed steps on rank 0
between two barriers. Accuracy is on the held-out 20% after all steps.

    bench/ddp_e2e.sh PYTHON OUTDIR     # every hook on the emulated cluster
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "pytorch"))
from cnn import VGGStyle, accuracy, digits  # noqa: E402

HEADER = "hook,P,params,density,steps,batch_per_rank,it_per_s,ms_per_step,accuracy,loss"
HOOKS = ("ddp", "fp16", "powersgd", "oktopk")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hook", choices=HOOKS, required=True)
    ap.add_argument("--steps", type=int, default=12, help="timed steps")
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--width", type=int, default=13)
    ap.add_argument("--batch-size", type=int, default=8, help="per rank")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--header", action="store_true")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    (xtr, ytr), (xte, yte) = digits(args.seed)
    # powerSGD_hook chains allreduces from future callbacks; over gloo, with
    # several buckets in flight the ranks issue them in different orders (gloo
    # fails with a size mismatch), so it gets one bucket.
    bucket_cap_mb = 1024 if args.hook == "powersgd" else 25
    model = DDP(VGGStyle(args.width), bucket_cap_mb=bucket_cap_mb)
    state = None
    if args.hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif args.hook == "oktopk":
        from oktopk import OkTopkState, oktopk_hook

        state = OkTopkState(density=args.density)
        model.register_comm_hook(state, oktopk_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    params = sum(p.numel() for p in model.parameters())

    shard = torch.arange(rank, len(ytr), world)[: len(ytr) // world]
    gen = torch.Generator().manual_seed(args.seed)
    total = args.warmup_steps + args.steps
    for step in range(total):
        if step == args.warmup_steps:
            dist.barrier()
            start = time.perf_counter()
        idx = shard[torch.randint(len(shard), (args.batch_size,), generator=gen)]
        loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.barrier()
    elapsed = time.perf_counter() - start
    acc = accuracy(model, xte, yte)
    if rank == 0:
        if args.header:
            print(HEADER)
        density = args.density if args.hook == "oktopk" else 1
        print(
            f"{args.hook},{world},{params},{density:g},{total},{args.batch_size},{args.steps / elapsed:.3f},"
            f"{1000 * elapsed / args.steps:.1f},{acc:.2f},{loss.item():.4f}",
            flush=True,
        )
    if args.hook == "oktopk":
        state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
