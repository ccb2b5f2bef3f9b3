"""What smaller indices would buy: the bytes of the indices a rank sends at
density k/n under encodings the wire could use instead of today's 32-bit
region-relative integers, measured on real gradients.

The gradients are those of the time-to-accuracy model (bench/ddp_e2e.py's
wide MLP on the digits data) after ``--steps`` steps of plain SGD in one
process, with error feedback as a rank keeps it: acc = grad + residual, the
top-k of acc selected, the rest kept. DDP hands the library one bucket per
25 MB, so each tensor is taken as its own bucket here (the 4096×4096 matrix
is one). Ok-Topk cuts a bucket into P regions; a rank sends each region's
selected indices relative to the region's start, in ascending order. For
every selection this counts, per index:

- ``u32``: 4 bytes (today);
- ``u16 region``: 2 bytes where the region holds at most 2^16 entries,
  else 4 (the encoding the issue names);
- ``u16 gap``: the gap to the previous selected index in 2 bytes, with an
  escape (2 + 4 bytes) for a gap of 2^16 or more;
- ``varint gap``: the gap in LEB128 (1 byte below 128, 2 below 16384, ...).

and what a pair (index + value) then costs with float32 and float16 values.

    python bench/index_sizes.py [--steps 30] [--density 0.01] [--P 8]
"""

import argparse
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_e2e import WideMLP, digits  # noqa: E402


def index_bytes(idx, n, p):
    """Bytes of the ascending indices idx (of a bucket of n) under each
    encoding, cut into p equal regions."""
    bounds = np.linspace(0, n, p + 1).astype(np.int64)
    out = {"u32": 0, "u16 region": 0, "u16 gap": 0, "varint gap": 0}
    for r in range(p):
        sel = idx[(idx >= bounds[r]) & (idx < bounds[r + 1])] - bounds[r]
        if len(sel) == 0:
            continue
        gaps = np.diff(np.concatenate(([0], sel)))
        out["u32"] += 4 * len(sel)
        out["u16 region"] += (2 if bounds[r + 1] - bounds[r] <= 1 << 16 else 4) * len(sel)
        out["u16 gap"] += int(np.where(gaps < 1 << 16, 2, 6).sum())
        out["varint gap"] += int(sum(np.searchsorted([1 << 7, 1 << 14, 1 << 21, 1 << 28], gaps, side="right") + 1))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--P", type=int, default=8)
    ap.add_argument("--width", type=int, default=4096)
    args = ap.parse_args()
    torch.manual_seed(0)
    (xtr, ytr), _ = digits(0)
    model = WideMLP(args.width)
    residual = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    totals, count = {}, 0
    for step in range(args.steps):
        idx = torch.randint(0, len(ytr), (64,), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        for name, p in model.named_parameters():
            acc = (p.grad + residual[name]).flatten()
            n = acc.numel()
            k = max(1, int(np.ceil(args.density * n)))
            top = torch.topk(acc.abs(), k).indices
            sparse = torch.zeros_like(acc)
            sparse[top] = acc[top]
            residual[name] = (acc - sparse).view_as(p)
            p.grad = sparse.view_as(p)
            for enc, b in index_bytes(np.sort(top.numpy()), n, args.P).items():
                totals[enc] = totals.get(enc, 0) + b
            count += k
        opt.step()
    print(f"{args.steps} steps of the {sum(p.numel() for p in model.parameters())}-parameter MLP, density {args.density}, "
          f"P = {args.P} regions per tensor; {count} selected indices")
    print("| index encoding | bytes per index | pair with float32 value | pair with float16 value | pair ÷ today's (float32) |")
    print("|---|---|---|---|---|")
    for enc, b in totals.items():
        per = b / count
        print(f"| {enc} | {per:.2f} | {per + 4:.2f} | {per + 2:.2f} | {(per + 4) / 8:.2f} |")


if __name__ == "__main__":
    main()
