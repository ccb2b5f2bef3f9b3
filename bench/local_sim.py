"""Local steps instead of (or beside) sparse gradients, for the AdamW text
benchmark, in one process: P simulated workers, each with its own model
copy, AdamW state and batches (examples/pytorch/charlm.py's model, data and
schedule, as bench/adam_sim.py), taking local steps; every H steps they
synchronize the models:

- density 1: the models are averaged (local SGD / post-local SGD with
  AdamW; H = 1 is each worker's own AdamW step, averaged every step);
- density < 1: each worker's change since the last synchronization plus
  its residual is reduced by Ok-Topk's rule (exact local top-k, summed,
  exact global top-k of the sum, the residual keeps what was not sent) and
  the average applied to the shared model (DiLoCo's outer step with sparse,
  error-fed pseudo-gradients, as SparseLoCo; ``--outer-mom`` adds DiLoCo's
  Nesterov momentum).

Prints ``sim,name,step,held_out_loss,bytes_share=`` lines: the share of
dense's gradient bytes sent so far, counting a sparse synchronization as
4 words per kept entry (Ok-Topk sends under 6k words; index and value).

    python bench/local_sim.py --name avg_H10 --H 10
    python bench/local_sim.py --name sloco_H10_d25 --H 10 --density 0.25
"""

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "pytorch"))
from charlm import CharTransformer, batch, fortunes_corpus, held_out_loss, lm_loss, lr_at  # noqa: E402


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load(model, values):
    at = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(values[at : at + p.numel()].view_as(p))
            at += p.numel()


def topk_mask(x, k):
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[torch.topk(x.abs(), k, sorted=False).indices] = True
    return mask


def run(a, data):
    train, held = data
    torch.manual_seed(0)
    base = CharTransformer(a.dim, a.layers, seq=a.seq)
    n = sum(p.numel() for p in base.parameters())
    workers = [copy.deepcopy(base) for _ in range(a.P)]
    opts = [torch.optim.AdamW(w.parameters(), lr=a.lr, weight_decay=0.01) for w in workers]
    gens = [torch.Generator().manual_seed(1000 + w) for w in range(a.P)]
    shared = flat(base)
    residual = torch.zeros(a.P, n)
    momentum = torch.zeros(n)
    k = max(1, int(a.density * n))
    sent = 0.0
    print(f"sim,{a.name},0,{held_out_loss(base, held, a.seq):.4f},bytes_share=0", flush=True)
    for step in range(a.steps):
        lr = lr_at(step, a.steps, a.lr, a.lr_warmup)
        for w, (model, opt) in enumerate(zip(workers, opts)):
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad()
            lm_loss(model, *batch(train, a.batch_size, a.seq, gens[w])).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        if (step + 1) % a.H == 0:
            deltas = torch.stack([shared - flat(m) for m in workers])  # pseudo-gradients
            if a.density >= 1:
                g = deltas.mean(0)
                sent += n
            else:
                acc = deltas + residual
                sel = torch.stack([topk_mask(acc[w], k) for w in range(a.P)])
                summed = (acc * sel).sum(0)
                keep = topk_mask(summed, k)
                g = torch.where(keep, summed, 0.0) / a.P
                residual = torch.where(sel & keep, 0.0, acc)
                sent += 4 * k
            if a.outer_mom > 0:
                momentum.mul_(a.outer_mom).add_(g)
                g = g + a.outer_mom * momentum  # Nesterov
            shared = shared - a.outer_lr * g
            for m in workers:
                load(m, shared)
        if (step + 1) % a.eval_every == 0:
            load(base, shared if (step + 1) % a.H == 0 else torch.stack([flat(m) for m in workers]).mean(0))
            print(f"sim,{a.name},{step + 1},{held_out_loss(base, held, a.seq):.4f},bytes_share={sent / ((step + 1) * n):.4f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="local")
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--H", type=int, default=10, help="local steps between synchronizations")
    ap.add_argument("--density", type=float, default=1.0, help="1: average the models; below: sparse pseudo-gradients")
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--outer-mom", type=float, default=0.0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lr-warmup", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=50)
    a = ap.parse_args()
    torch.set_num_threads(1)
    run(a, fortunes_corpus())


if __name__ == "__main__":
    main()
