"""Training that goes on without a lost rank, with no restart.

    torchrun --nproc-per-node 4 examples/pytorch/continue.py   # see below: a launcher that keeps the survivors

An ordinary DDP script with the one line, set to go on when a rank is
lost: ``OkTopkState(algorithm="oktopk", on_rank_loss="continue")``. When a
rank dies or stops, the step it was lost in is void on every survivor,
and from the next step the survivors train on without it, each step
averaged over the ranks left (docs/failures.md). The script itself
changes nothing: its optimizer step after a void step steps nothing, and
``state.rank_losses`` says what happened.

The launcher must leave the survivors running when a rank dies. torchrun's
agent stops every worker when one fails (that is its restart); launch each
rank as a process of its own instead (the test does, with ``env://``), or
use Slurm's ``srun --kill-on-bad-exit=0``. The job's store must outlive
the lost rank: under ``env://`` rank 0 hosts it, so rank 0 is the one rank
that cannot be lost.

A rank that comes back joins the running job: start the script again
with the lost rank's ``RANK`` and ``--join``. It makes a process group of
its own (a group of one, which DDP wants), asks the group to admit it, and
is handed the model, the optimizer and the step by the group's rank 0 (the
``rejoin_state`` line, on every rank), within two of the group's steps.

``--kill-at STEP --kill-rank R[,R...]``: those ranks SIGKILL themselves in
step STEP, after their forward (``--stop``: SIGSTOP, a hung machine).
``--kill STEP:R[,R...]``, repeatable: more losses (a rank lost later, or
a second one).
``--step-sleep S``: sleep S seconds after each step (a slower model).
``--after-join N``: end N steps after a rank joins, on every rank, the
joiner's included; until one joins the run goes on, to ``--steps`` at
most (so a joiner that starts slowly still finds the job's store).
"""

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from oktopk import OkTopkState, oktopk_hook

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from elastic import batch, digits  # noqa: E402 - the same data and batches as the elastic example


def params_digest(model):
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.module.parameters())).hexdigest()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="the library's timeout (seconds)")
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--kill-rank", default="3", help="a rank, or several: 2,3")
    ap.add_argument("--kill", action="append", default=[], metavar="STEP:RANKS")
    ap.add_argument("--stop", action="store_true", help="SIGSTOP the rank instead of SIGKILL")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--on-rank-loss", default="continue", choices=["continue", "stop"],
                    help="stop: fail-stop, to time the same run without the continue mode's per-step look at the store")
    ap.add_argument("--join", action="store_true", help="come back into the running job as rank RANK")
    ap.add_argument("--after-join", type=int, default=None, metavar="N",
                    help="end N steps after a rank joins (until one does, go on to --steps at most)")
    ap.add_argument("--out", default=None, help="write each survivor's summary (JSON) here")
    args = ap.parse_args(argv)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # in the job as it was started
    losses_due = {(args.kill_at, int(r)) for r in args.kill_rank.split(",")} if args.kill_at is not None else set()
    for spec in args.kill:
        at, ranks = spec.split(":")
        losses_due |= {(int(at), int(r)) for r in ranks.split(",")}
    if args.join:
        # A group of one for DDP: the job's own group still counts this
        # rank as lost. The library's calls go to the group it joins.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    (x, y), (tx, ty) = digits()
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))  # no buffers: its forward issues no collective
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    state = OkTopkState(density=args.density, algorithm="oktopk", timeout=args.timeout, on_rank_loss=args.on_rank_loss)
    model.register_comm_hook(state, oktopk_hook)
    progress = {"step": 0}
    state.rejoin_state(lambda: {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": progress["step"]},
                       lambda d: (model.module.load_state_dict(d["model"]), opt.load_state_dict(d["optimizer"]),
                                  progress.update(step=d["step"])))
    end, counting_from_join = args.steps, False
    if args.join:
        state.join()
        print(f"rank {rank} joined the running job at step {progress['step']}", flush=True)
        if args.after_join is not None:
            end = min(end, progress["step"] + args.after_join)

    step_seconds, digests = [], []
    step = progress["step"]
    while step < end:
        progress["step"] = step
        begun = time.perf_counter()
        bx, by = batch(x, y, step + args.seed * 100_000, rank, world, args.batch_size)
        opt.zero_grad()
        loss = F.cross_entropy(model(bx), by)
        if (step, rank) in losses_due and not args.join:
            os.kill(os.getpid(), signal.SIGSTOP if args.stop else signal.SIGKILL)  # lost mid-step
        loss.backward()
        opt.step()
        step_seconds.append(time.perf_counter() - begun)
        time.sleep(args.step_sleep)
        if args.out:
            digests.append(params_digest(model))
        if args.after_join is not None and not args.join and state.rank_joins and not counting_from_join:
            # A rank was admitted in this step, alike on every member: the
            # joiner, handed this step, counts from it too.
            end, counting_from_join = min(end, step + args.after_join), True
        step += 1

    model.eval()
    with torch.no_grad():
        acc = 100.0 * (model(tx).argmax(1) == ty).float().mean().item()
    losses = state.rank_losses
    if not losses or losses[-1]["rank"] == 0:
        print(f"{step} steps over {state.collectives.size()} ranks at the end, test accuracy {acc:.2f}%, "
              f"rank losses {[(l['step'], l['lost']) for l in losses]}", flush=True)
    if args.out:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump({"params": params_digest(model), "digests": digests, "accuracy": acc, "iter": state.iter, "rank_losses": losses,
                       "rank_joins": state.rank_joins, "size": state.collectives.size(),
                       "step_seconds": step_seconds, "bytes_sent": state.bytes_sent}, f)
    state.close()
    os._exit(0)  # not destroy_process_group: the process group still counts the lost rank, and its teardown would wait for it


if __name__ == "__main__":
    main()
