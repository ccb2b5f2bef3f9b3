"""Record per-rank gradients from the project's own training models for the
scaling study (bench/cmd/scale): what each rank of a data-parallel job would
hand the allreduce at a given step, from a different minibatch per rank.

Each model (bench/ddp_e2e.py's ``mlp`` and ``cnn``, examples/pytorch/charlm.py's
transformer, at their benchmark widths) is trained in one process as
ddp_e2e.py trains it with four ranks (the same optimizer, learning rate,
schedule and clipping, a batch of four ranks' minibatches per step). At each
step in ``--steps`` the weights are frozen and ``--batches`` gradients are
taken, each from its own minibatch of ``--batch-size`` (ddp_e2e.py's per-rank
batch): the gradients ``--batches`` ranks would compute at that step, before
any clipping (DDP allreduces the raw gradient; clipping comes after).

Only the head of each gradient is kept: its first ``--n`` values in DDP's
bucket order (parameters in reverse registration order, each flattened), so
that a thousand ranks' gradients and residuals fit in one machine's memory.
That is what DDP's first bucket starts with: for the MLP the output layer,
its biases and the first rows of the 4096×4096 matrix; for the CNN the
classifier; for the transformer its head, final norm and last block. Layers
of different scale side by side are where index skew comes from.

Each (model, step) is written as ``NAME.f32`` (``--batches`` × ``--n``
little-endian float32, batch after batch) and ``NAME.json`` (what it is).

    python bench/scale_record.py --out build/scale/grads
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples", "pytorch"))
from charlm import CharTransformer, batch, fortunes_corpus, lm_loss, lr_at  # noqa: E402
from cnn import VGGStyle, digits  # noqa: E402
from ddp_e2e import WideMLP  # noqa: E402

# ddp_e2e.py's benchmark widths and learning rates; RANKS is the job size
# whose training this reproduces (its global batch), as results/tta* ran.
WIDTH = {"mlp": 4096, "cnn": 13, "charlm": 192}
BATCH = {"mlp": 8, "cnn": 8, "charlm": 16}  # per rank: ddp_e2e.py's default, make bench-text's
RANKS = 4


def head_of_gradient(model, n):
    """The first n gradient values in DDP's bucket order (parameters in
    reverse, each flattened), as float32."""
    parts, have = [], 0
    for p in reversed(list(model.parameters())):
        if have >= n:
            break
        g = p.grad.reshape(-1)[: n - have]
        parts.append(g.detach().clone())
        have += g.numel()
    out = torch.cat(parts)
    if out.numel() < n:
        raise SystemExit(f"scale_record.py: the model has {out.numel()} parameters, fewer than --n {n}")
    return out.numpy().astype(np.float32)


def record(name, steps, batches, n, batch_size, out, seed):
    torch.manual_seed(seed)
    if name == "charlm":
        text, _ = fortunes_corpus()
        model = CharTransformer(WIDTH[name], seq=64)
        opt = torch.optim.AdamW(model.parameters(), lr=0.002, weight_decay=0.01)
        train_windows = torch.Generator().manual_seed(seed)
        grad_windows = torch.Generator().manual_seed(seed + 1)

        def loss_of(size, gen):
            return lm_loss(model, *batch(text, size, 64, gen))
    else:
        (xtr, ytr), _ = digits(seed)
        model = WideMLP(WIDTH[name]) if name == "mlp" else VGGStyle(WIDTH[name])
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        train_gen = torch.Generator().manual_seed(seed)
        grad_gen = torch.Generator().manual_seed(seed + 1)

        def loss_of(size, gen):
            idx = torch.randint(0, len(ytr), (size,), generator=gen)
            return F.cross_entropy(model(xtr[idx]), ytr[idx])

    last = max(steps)
    params = sum(p.numel() for p in model.parameters())
    for step in range(1, last + 1):
        if step in steps:
            t0 = time.perf_counter()
            path = os.path.join(out, f"{name}_step{step}")
            with open(path + ".f32", "wb") as f:
                for _ in range(batches):
                    opt.zero_grad()
                    loss_of(batch_size, grad_gen if name != "charlm" else grad_windows).backward()
                    f.write(head_of_gradient(model, n).tobytes())
            meta = {"model": name, "step": step, "batches": batches, "n": n, "batch_size": batch_size,
                    "parameters": params, "slice": "first n values in DDP bucket order (parameters reversed)"}
            with open(path + ".json", "w") as f:
                json.dump(meta, f)
            print(f"{name} step {step}: {batches} gradients of {n} values in {time.perf_counter() - t0:.1f} s", flush=True)
        if step == last:
            break
        # One training step as ddp_e2e.py takes it with RANKS ranks.
        if name == "charlm":
            for group in opt.param_groups:
                group["lr"] = lr_at(step - 1, 400, 0.002, 30)
        opt.zero_grad()
        loss_of(batch_size * RANKS, train_gen if name != "charlm" else train_windows).backward()
        if name == "charlm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="mlp,cnn,charlm")
    ap.add_argument("--steps", default="1,50,200", help="steps at which gradients are recorded (1: the initial weights)")
    ap.add_argument("--batches", type=int, default=256, help="minibatches (ranks) per step")
    ap.add_argument("--n", type=int, default=1 << 18, help="values kept of each gradient")
    ap.add_argument("--batch-size", type=int, default=None, help="per rank (default: the benchmarks' 8 images, charlm 16 windows)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    steps = sorted({int(s) for s in args.steps.split(",")})
    if steps[0] < 1 or args.batches < 1 or args.n < 1:
        ap.error("--steps must be at least 1, --batches and --n positive")
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    for name in args.models.split(","):
        if name not in WIDTH:
            ap.error(f"unknown model {name!r} (one of {', '.join(WIDTH)})")
        size = args.batch_size or BATCH[name]
        record(name, set(steps), args.batches, args.n, size, args.out, args.seed)


if __name__ == "__main__":
    main()
