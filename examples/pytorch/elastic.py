"""Training that survives a lost rank through torchrun's elastic restarts.

    torchrun --nproc-per-node 4 --max-restarts 3 examples/pytorch/elastic.py --ckpt DIR

An ordinary DDP script with the one line and a checkpoint every
``--save-every`` steps, saved by every rank: the model, the optimizer and
the hook's ``OkTopkState``, whose residuals are this rank's own (rank 0's
file alone would not resume the others). When a rank dies, torchrun's
agent stops the others and starts the whole group again (``--max-restarts``
times at most); every rank then loads the newest step that every rank
saved and trains on. The steps since that checkpoint are redone, and
nothing else is lost: with a named algorithm the resumed run's parameters
equal an uninterrupted run's bit for bit (tests/python/test_elastic.py).
Under the measured choice (``algorithm=None``) the resumed run continues
on the path the checkpoint recorded, and its later choices, made from
step times, may differ from another run's.

``--kill-at STEP --kill-rank R``: rank R SIGKILLs itself in step STEP,
after its forward, in the first attempt only (the test's lost rank).
``--kill STEP:R[,R...]:ATTEMPT``, repeatable: those ranks SIGKILL
themselves in that step of that attempt (the fault campaign's losses:
two ranks at once, a rank lost again after the restart).
"""

import argparse
import glob
import hashlib
import json
import os
import re
import signal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP

from oktopk import OkTopkState, oktopk_hook


def digits():
    """scikit-learn's 1,797 8×8 digit images, flattened, split 80/20."""
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(y))
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def batch(x, y, step, rank, world, size):
    """The batch of ``step`` on ``rank``: drawn from the step alone, so a
    resumed run draws what an uninterrupted one would."""
    g = torch.Generator().manual_seed(step * world + rank)
    pick = torch.randint(0, len(y), (size,), generator=g)
    return x[pick], y[pick]


def saved_steps(ckpt, rank):
    return {int(m.group(1)) for f in glob.glob(os.path.join(ckpt, f"rank{rank}-step*.pt"))
            if (m := re.search(r"-step(\d+)\.pt$", f))}


def newest_common_step(ckpt, rank, world):
    """The newest step every rank saved (None: start from scratch). A rank
    lost while the others saved leaves a step some ranks have and others
    not; every rank picks the same one from all ranks' lists."""
    every = [None] * world
    dist.all_gather_object(every, sorted(saved_steps(ckpt, rank)))
    common = set(every[0]).intersection(*every[1:])
    return max(common) if common else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", required=True, help="directory of every rank's checkpoints")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--algorithm", default=None, help="an oktopk.ALGORITHMS name (default: the measured choice)")
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--kill", action="append", default=[], metavar="STEP:RANKS:ATTEMPT")
    ap.add_argument("--out", default=None, help="write each rank's summary (JSON) here")
    args = ap.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kills = {(args.kill_at, args.kill_rank, 0)} if args.kill_at is not None else set()
    for spec in args.kill:
        step, ranks, when = spec.split(":")
        kills |= {(int(step), int(r), int(when)) for r in ranks.split(",")}
    torch.manual_seed(0)
    torch.set_num_threads(1)
    (x, y), (tx, ty) = digits()
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    state = OkTopkState(density=args.density, algorithm=args.algorithm)

    os.makedirs(args.ckpt, exist_ok=True)
    first = 0
    resumed = newest_common_step(args.ckpt, rank, world)
    if resumed is not None:
        saved = torch.load(os.path.join(args.ckpt, f"rank{rank}-step{resumed}.pt"), weights_only=False)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["oktopk"])
        first = resumed
    model.register_comm_hook(state, oktopk_hook)
    if rank == 0:
        print(f"attempt {attempt}: " + (f"resumed after step {resumed}" if resumed is not None else "from scratch"), flush=True)

    for step in range(first, args.steps):
        bx, by = batch(x, y, step, rank, world, args.batch_size)
        opt.zero_grad()
        loss = F.cross_entropy(model(bx), by)
        if (step, rank, attempt) in kills:
            os.kill(os.getpid(), signal.SIGKILL)  # lost mid-step, as a crashed or preempted machine is
        loss.backward()
        opt.step()
        if (step + 1) % args.save_every == 0:
            path = os.path.join(args.ckpt, f"rank{rank}-step{step + 1}.pt")
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "oktopk": state.state_dict()},
                       path + ".tmp")
            os.replace(path + ".tmp", path)  # never a half-written checkpoint

    model.eval()
    with torch.no_grad():
        acc = 100.0 * (model(tx).argmax(1) == ty).float().mean().item()
    if rank == 0:
        print(f"attempt {attempt}: {args.steps} steps, test accuracy {acc:.2f}%", flush=True)
    if args.out:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.module.parameters())).hexdigest()
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump({"attempt": attempt, "resumed": resumed, "params": digest, "accuracy": acc,
                       "bytes_sent": state.bytes_sent}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
