"""A VGG-style CNN on scikit-learn's handwritten digits, trained with
PyTorch DDP over gloo. Switching to sparse allreduce is one line
(``register_comm_hook``), behind ``--oktopk``.

    python -m torch.distributed.run --nproc-per-node 4 examples/pytorch/cnn.py
    python -m torch.distributed.run --nproc-per-node 4 examples/pytorch/cnn.py --oktopk
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP


class VGGStyle(nn.Module):
    """Two VGG blocks (3×3 convolutions, max pooling) and a classifier;
    ``width`` scales the channel counts (width 13: 16.5M parameters)."""

    def __init__(self, width=1):
        super().__init__()
        c1, c2, h = 32 * width, 64 * width, 128 * width
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.Conv2d(c1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.Conv2d(c2, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(c2 * 4, h), nn.ReLU(), nn.Linear(h, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def digits(seed=0):
    """The 1,797 8×8 digit images scikit-learn ships, split 80/20."""
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    cut = int(0.8 * len(y))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return 100.0 * acc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--oktopk", action="store_true", help="sparse allreduce through oktopk's DDP hook")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--algorithm", default=None, help="an oktopk.ALGORITHMS name, e.g. oktopk or auto (default: the measured choice between the framework's allreduce and sparse)")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=16, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-momentum-correction", action="store_true", help="oktopk: leave SGD's momentum after the sparse average (momentum_correction=False)")
    args = ap.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    (xtr, ytr), (xte, yte) = digits(args.seed)
    model = DDP(VGGStyle(args.width))
    state = None
    if args.oktopk:
        from oktopk import OkTopkState, oktopk_hook

        state = OkTopkState(density=args.density, algorithm=args.algorithm, momentum_correction=not args.no_momentum_correction)
        model.register_comm_hook(state, oktopk_hook)  # the one line that switches to sparse
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    params = sum(p.numel() for p in model.parameters())

    shard = torch.arange(rank, len(ytr), world)[: len(ytr) // world]  # same step count on every rank
    steps_per_epoch = len(shard) // args.batch_size
    # Cosine decay to zero: the final accuracy reflects the run, not the
    # noise of the last few steps.
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * steps_per_epoch)
    steps, start = 0, time.perf_counter()
    for epoch in range(args.epochs):
        perm = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))]
        for i in range(0, len(perm) - args.batch_size + 1, args.batch_size):
            idx = perm[i : i + args.batch_size]
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            steps += 1
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f} test accuracy {accuracy(model, xte, yte):.2f}%", flush=True)
    elapsed = time.perf_counter() - start
    acc = accuracy(model, xte, yte)
    if state is not None:
        sent = state.bytes_sent / max(steps - state.warmup_iters, 1)
        how = f"{state.algorithm} at density {state.density}, measured"
    else:
        sent = 2 * params * 4 * (world - 1) / world
        how = "dense ring allreduce, 2n(P-1)/P words"
    if rank == 0:
        mode = "oktopk" if args.oktopk else "dense"
        print(
            f"RESULT mode={mode} ranks={world} params={params} accuracy={acc:.2f}% "
            f"ms_per_iter={1000 * elapsed / steps:.2f} bytes_sent_per_rank_per_iter={sent:.0f} ({how})",
            flush=True,
        )
    # Every rank must hold the same parameters, bit for bit.
    param_bytes = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    if state is not None:
        state.close()
    dist.destroy_process_group()
    return {"accuracy": acc, "params": param_bytes, "steps": steps}


if __name__ == "__main__":
    main()
