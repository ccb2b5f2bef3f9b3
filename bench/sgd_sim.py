"""Sparse SGD with momentum, simulated in one process: P workers train the
demo's MLP (bench/ddp_e2e.py's ``mlp``: 64 → 4096 → 4096 → 10 on
scikit-learn's 8×8 digits, the same shards, batches and seeds as the real
run) and reduce their gradients by Ok-Topk's rule, exactly: each worker's
exact top-k of its accumulator, summed, the exact top-k of the sum kept, and
each worker's accumulator loses what it contributed to that result (what the
library's residual loses). What varies is where momentum sits:

- ``dense``: the mean gradient, then SGD with momentum (plain DDP).
- ``ef``: today's hook: the accumulator is the residual plus the gradient;
  the optimizer applies its momentum to the sparse mean. An entry that
  waited ~1/density steps arrives as a burst, and momentum keeps moving it.
- ``mc``: momentum correction (Lin et al., Deep Gradient Compression, ICLR
  2018): each worker keeps its own velocity u ← m·u + g and the accumulator
  gathers u; the sparse mean is the update, applied without a second
  momentum. At density 1 this is dense SGD with momentum.
- ``mc_mask``: and momentum factor masking: where a worker's entry left its
  accumulator, its velocity is zeroed too (DGC's rule).
- ``mc_gmask``: masking at every entry of the global result.
- ``--clip C``: each worker's gradient clipped to norm C/√P first (DGC's
  local clipping).
- ``--schedule D0,S``: the density starts at D0 and decays exponentially to
  ``--density`` over S sparse steps (the hook's ``density_schedule``).

Every variant's first ``--warmup`` steps are dense (the hook's default
warm-up is 2). Prints ``sim,name,seed,step,accuracy,loss`` every
``--eval-every`` steps and a ``final,`` line with the final accuracy, the
first step at or above 95% and the lowest accuracy after it.

    python bench/sgd_sim.py --variant mc --seed 0
"""

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "pytorch"))
from cnn import digits  # noqa: E402
from ddp_e2e import WideMLP, evaluate  # noqa: E402

VARIANTS = ("dense", "ef", "mc", "mc_mask", "mc_gmask")


def topk_indices(x, k):
    return torch.topk(x.abs(), k, sorted=False).indices


def oktopk_reduce(accs, k):
    """Ok-Topk's rule on the workers' accumulators (modified in place: each
    loses what it contributed to the result). Returns (sum over workers of
    the result, global indices, per-worker indices that left)."""
    n = accs[0].numel()
    total = torch.zeros(n)
    local = []
    for a in accs:
        idx = topk_indices(a, k)
        total.index_add_(0, idx, a[idx])
        local.append(idx)
    glob = topk_indices(total, k)
    keep = torch.zeros(n, dtype=torch.bool)
    keep[glob] = True
    result = torch.zeros(n)
    result[glob] = total[glob]
    left = []
    for a, idx in zip(accs, local):
        sent = idx[keep[idx]]
        a[sent] = 0.0
        left.append(sent)
    return result, glob, left


def density_at(step, args):
    if args.schedule is None:
        return args.density
    d0, steps = args.schedule
    s = step - args.warmup
    if s >= steps:
        return args.density
    return d0 * (args.density / d0) ** (s / steps)


def run(args):
    (xtr, ytr), (xte, yte) = digits(args.seed)
    torch.manual_seed(args.seed)
    model = WideMLP(args.width)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    P, m = args.P, args.momentum
    own_momentum = args.variant in ("dense", "ef")
    opt = torch.optim.SGD(params, lr=args.lr, momentum=m if own_momentum else 0.0)
    shards = [torch.arange(r, len(ytr), P)[: len(ytr) // P] for r in range(P)]
    per_epoch = len(shards[0]) // args.batch_size
    acc_buf = [torch.zeros(n) for _ in range(P)]  # residual (ef) or velocity accumulator (mc*)
    vel = [torch.zeros(n) for _ in range(P)]
    perms = None
    reached, low_after = None, None
    acc = loss = float("nan")
    for step in range(args.steps):
        epoch, i = divmod(step, per_epoch)
        if i == 0:
            perms = [s[torch.randperm(len(s), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))] for s in shards]
        grads = []
        for r in range(P):
            idx = perms[r][i * args.batch_size : (i + 1) * args.batch_size]
            model.zero_grad()
            F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            g = torch.cat([p.grad.reshape(-1) for p in params])
            if args.clip is not None:
                norm = g.norm().item()
                limit = args.clip / math.sqrt(P)
                if norm > limit:
                    g.mul_(limit / norm)
            grads.append(g)
        dense = step < args.warmup or args.variant == "dense"
        if args.variant in ("dense", "ef"):
            for r in range(P):
                acc_buf[r] += grads[r]
        else:
            for r in range(P):
                vel[r].mul_(m).add_(grads[r])
                acc_buf[r] += vel[r]
        if dense:
            update = torch.stack(acc_buf).sum(0) / P
            for a in acc_buf:
                a.zero_()
        else:
            k = max(1, int(density_at(step, args) * n))
            total, glob, left = oktopk_reduce(acc_buf, k)
            update = total / P
            if args.variant == "mc_mask":
                for v, sent in zip(vel, left):
                    v[sent] = 0.0
            elif args.variant == "mc_gmask":
                for v in vel:
                    v[glob] = 0.0
        at = 0
        for p in params:
            p.grad = update[at : at + p.numel()].view_as(p).clone()
            at += p.numel()
        opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            acc, loss = evaluate(model, xte, yte)
            if reached is None and acc >= 95.0:
                reached = step + 1
            elif reached is not None:
                low_after = acc if low_after is None else min(low_after, acc)
            print(f"sim,{args.name},{args.seed},{step + 1},{acc:.2f},{loss:.4f}", flush=True)
    print(f"final,{args.name},{args.seed},{acc:.2f},{reached},{low_after}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=VARIANTS, required=True)
    ap.add_argument("--name", default=None, help="the name printed (default: the variant)")
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=2, help="dense steps first")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--schedule", default=None, help="D0,S: density from D0 down to --density over S sparse steps")
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.schedule is not None:
        d0, s = args.schedule.split(",")
        args.schedule = (float(d0), int(s))
    args.name = args.name or args.variant
    torch.set_num_threads(1)
    run(args)


if __name__ == "__main__":
    main()
