"""The training step a user waits for: plain DDP against the oktopk hook
with its defaults (and fixed sparse algorithms), on one model and link.

Every rank times every step (forward, backward with the reduction
overlapped, optimizer) on its own clock; a synchronous step waits for the
slowest rank, so the step's time is the maximum over the ranks. Per
method it prints one ``step,`` row: the median of those slowest-rank times
over the steps after ``--skip`` (the warm-up and the default hook's first
probes; the hook decides at step 6 on a clear win over its timed warm-up step, else at 10, and confirms a switch to sparse 12 steps later), their mean over every step (probes and
warm-up included: what the whole run cost), the spread (10th and 90th
percentiles after ``--skip``), the bytes one rank sent per step over the
run, and, for the default hook, the path it chose and its steps per path.

Methods run one after the other in the same processes, in the order
``--order`` gives (the driver shuffles it per repeat), each from the same
seed:

- ``ddp``: plain DDP (gloo's allreduce of every bucket);
- ``oktopk``: ``OkTopkState()`` with every default: the measured choice
  between the process group's allreduce and the library's sparse one;
- ``oktopk_<algorithm>``: the hook with that algorithm fixed (sparse after
  the two dense warm-up steps);
- ``allreduce_hook``: torch's own hook, what any Python comm hook costs;
- any of them with ``:view`` (``ddp:view``): DDP built with
  ``gradient_as_bucket_view=True``.

Models: ``cnn`` is the demo's VGG-style CNN (examples/pytorch/cnn.py,
``--width 1``: 0.1M parameters); ``mlp`` the wide MLP of bench/ddp_e2e.py
(``--width 2176``: 5.0M parameters; 4096: 17.1M), both on scikit-learn's
8×8 digits with SGD (momentum 0.9).

    bench/ddp_matrix.sh PYTHON OUTDIR     # the matrix, on emulated links
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "pytorch"))
from cnn import VGGStyle, digits  # noqa: E402
from ddp_e2e import WideMLP, exit_now, ring_bytes  # noqa: E402

HEADER = ("model,params,P,link,rep,method,median_ms,mean_ms,p10_ms,p90_ms,bytes_per_step,path,native_steps,sparse_steps,"
          "explored_steps,final_loss,skip")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("cnn", "mlp"), required=True)
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("--order", required=True, help="methods joined by commas, run in this order")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=32,
                    help="steps left out of the median: the warm-up (2), the first probes (8), the confirmation of a switch (12), 10 more")
    ap.add_argument("--batch-size", type=int, default=16, help="per rank")
    ap.add_argument("--link", default="?", help="the link's name, for the row")
    ap.add_argument("--rep", type=int, default=0, help="the repeat's number, for the row")
    args = ap.parse_args()
    if args.steps <= args.skip:
        ap.error("--steps must exceed --skip")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    data = digits(0)[0]
    for method in args.order.split(","):
        run(method, args, data)
    dist.destroy_process_group()
    exit_now()  # the output is written: no interpreter finalization (ddp_e2e.exit_now)


def run(method, args, data):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = VGGStyle(args.width) if args.model == "cnn" else WideMLP(args.width)
    # "<method>:view": DDP with gradient_as_bucket_view=True (the gradients
    # are views of the buckets: no copy into them, and none back).
    base, _, variant = method.partition(":")
    if variant not in ("", "view"):
        raise SystemExit(f"ddp_step.py: unknown variant {variant!r} of {base!r} (only ':view')")
    model = DDP(net, gradient_as_bucket_view=variant == "view")
    state = None
    if base.startswith("oktopk"):
        from oktopk import OkTopkState, oktopk_hook

        algorithm = base[len("oktopk_"):] if base != "oktopk" else None
        state = OkTopkState(algorithm=algorithm)
        model.register_comm_hook(state, oktopk_hook)
    elif base == "allreduce_hook":  # torch's own hook: what any Python hook costs
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif base != "ddp":
        raise SystemExit(f"ddp_step.py: unknown method {method!r}")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = data
    g = torch.Generator().manual_seed(rank)
    seconds = []
    dist.barrier()
    for _ in range(args.steps):
        idx = torch.randint(0, len(y), (args.batch_size,), generator=g)
        start = time.perf_counter()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        seconds.append(time.perf_counter() - start)
    # The slowest rank's time of every step.
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    slowest = [1e3 * v for v in t.tolist()]
    after = sorted(slowest[args.skip:])
    params = sum(p.numel() for p in model.parameters())
    dense = ring_bytes(params, world)
    path, native, sparse, explored = "dense", args.steps, 0, 0
    sent = 0.0
    if state is not None:
        choice = state.choice
        if choice is not None:
            path, native, sparse, explored = choice["path"], choice["steps"]["native"], choice["steps"]["sparse"], choice["explored_steps"]
        else:
            path, native, sparse = "sparse", 0, args.steps - state.warmup_iters
        native += state.warmup_iters
        sent = float(state.bytes_sent + state.quantized_bytes_sent)
        if choice is not None:
            sent += choice["steps"]["bf16"] * ring_bytes(params, world, 2)
    total = torch.tensor([sent + native * dense], dtype=torch.float64)
    dist.all_reduce(total)
    if rank == 0:
        row = [args.model, params, world, args.link, args.rep, method, f"{statistics.median(after):.1f}", f"{statistics.mean(slowest):.1f}",
               f"{after[len(after) // 10]:.1f}", f"{after[(9 * len(after)) // 10]:.1f}", f"{total.item() / world / args.steps:.0f}", path,
               native, sparse, explored, f"{loss.item():.4f}", args.skip]
        print("step," + ",".join(str(v) for v in row), flush=True)
    if state is not None:
        state.close()


if __name__ == "__main__":
    main()
