"""A small BERT-style transformer encoder trained with masked-token
prediction, with PyTorch DDP over gloo. No text corpus can be installed
here, so the tokens are synthetic: sequences from a fixed random Markov
chain over the vocabulary, whose transitions the model can learn (its loss
falls well below the uniform log V). Switching to sparse allreduce is one
line (``register_comm_hook``), behind ``--oktopk``.

    python -m torch.distributed.run --nproc-per-node 4 examples/pytorch/bert.py --oktopk

The model is trained with Adam, so ``--oktopk`` at its defaults keeps the
dense allreduce (the hook sees the Adam-family optimizer and says so):
measured on a 2-core machine, 4 ranks, batch 16 per rank, the masked-token
loss (averaged over every rank's last 25 batches; uniform guessing is 4.16)
is 1.034 after 300 steps, with and without ``--oktopk``. Naming an
algorithm sends sparse anyway: earlier measurements with ``--algorithm
oktopk`` at density 1% had barely started after 300 steps (3.76, against
dense's 0.91 in that run; 2.59 after 450); with ``--adaptive 0.01,0.25
--xi-every 10`` the density rose to 16% in the first 40 steps and the run
ended at 0.82 after 450, sending 0.76 MB per step against dense's 2.5 MB.
``--warmup``, ``--density-schedule`` and ``--adaptive`` set the OkTopkState
options of the same names.

``--force-path bf16`` or ``quantized`` runs the hook with the whole run its
warm-up on that compressed dense path (``warmup_iters`` = ``--steps``,
``warmup_compression``), as bench/ddp_e2e.py's ``oktopk_forced_*`` methods
do: the path's quality where the measured choice would keep native.
``--seed`` changes the model's initialisation, the training sequences and
their masks (0, the default, is the run above); ``--held-out N`` adds the
loss on N fixed held-out sequences, the same for every seed and method, to
the RESULT line.
"""

import argparse
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def sinusoids(seq, dim):
    pos = torch.arange(seq, dtype=torch.float32)[:, None]
    freq = 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    table = torch.zeros(seq, dim)
    table[:, 0::2] = torch.sin(pos / freq)
    table[:, 1::2] = torch.cos(pos / freq)
    return table


class TinyBert(nn.Module):
    def __init__(self, vocab, dim=128, layers=2, heads=4, seq=32):
        super().__init__()
        self.tokens = nn.Embedding(vocab + 1, dim)  # the last id is [MASK]
        # Learned positions, started from the Transformer's sinusoids: from a
        # random start the model takes thousands of steps to find "look at
        # the neighbours", which is all this corpus needs.
        self.positions = nn.Parameter(sinusoids(seq, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.head(self.encoder(self.tokens(ids) + self.positions))


def markov_corpus(vocab, seq, count, seed):
    """count sequences from one fixed random sparse Markov chain (4 successors
    per token); the chain is the same on every rank (seed 0), the sequences
    drawn from it differ by seed."""
    succ = torch.randint(0, vocab, (vocab, 4), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(count, seq, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (count,), generator=g)
    for t in range(1, seq):
        choice = torch.randint(0, 4, (count,), generator=g)
        ids[:, t] = succ[ids[:, t - 1], choice]
    return ids


def held_out_loss(model, args):
    """The masked-token loss on ``args.held_out`` sequences drawn, and
    masked, by fixed seeds of their own: the same for every run."""
    ids = markov_corpus(args.vocab, args.seq, args.held_out, seed=99)
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(12345)) < 0.15
    model.eval()
    with torch.no_grad():
        loss = F.cross_entropy(model(ids.masked_fill(mask, args.vocab))[mask], ids[mask]).item()
    model.train()
    return loss


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--oktopk", action="store_true")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--algorithm", default=None, help="an oktopk.ALGORITHMS name, e.g. oktopk or auto (default: the measured choice between the framework's allreduce and sparse)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=2, help="oktopk: dense warm-up iterations (warmup_iters)")
    ap.add_argument("--density-schedule", default=None, metavar="START,DECAY_STEPS", help="oktopk: density_schedule, e.g. 0.25,150")
    ap.add_argument("--adaptive", default=None, metavar="MIN,MAX[,MAX_XI]", help="oktopk: adaptive density bounds, e.g. 0.01,0.25")
    ap.add_argument("--xi-every", type=int, default=None, help="oktopk: measure_xi_every")
    ap.add_argument("--demo", action="store_true", help="train with oktopk.optim.DeMo instead of Adam (the one line that compresses under Adam)")
    ap.add_argument("--demo-lr", type=float, default=1e-3, help="DeMo's learning rate (its sign step's size)")
    ap.add_argument("--force-path", choices=("bf16", "quantized"), default=None, help="oktopk: every step after DDP's first two on this dense path (implies --oktopk)")
    ap.add_argument("--seed", type=int, default=0, help="model initialisation, training sequences and masks")
    ap.add_argument("--held-out", type=int, default=0, metavar="N", help="report the masked-token loss on N fixed held-out sequences at the end")
    args = ap.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = DDP(TinyBert(args.vocab, seq=args.seq))
    state = None
    if args.oktopk or args.force_path:
        from oktopk import OkTopkState, oktopk_hook

        schedule = None if args.density_schedule is None else (float(args.density_schedule.split(",")[0]), int(args.density_schedule.split(",")[1]))
        adaptive = None if args.adaptive is None else tuple(float(x) for x in args.adaptive.split(","))
        warmup = {"warmup_iters": args.warmup} if args.force_path is None else {"warmup_iters": max(args.steps, 2), "warmup_compression": args.force_path}
        state = OkTopkState(density=args.density, algorithm=args.algorithm, tau_prime=128, **warmup,
                            density_schedule=schedule, adaptive=adaptive, measure_xi_every=args.xi_every)
        model.register_comm_hook(state, oktopk_hook)  # the one line that switches to sparse
    if args.demo:
        import oktopk.optim

        opt = oktopk.optim.DeMo(model, lr=args.demo_lr)  # was torch.optim.Adam(model.parameters(), lr=args.lr)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = markov_corpus(args.vocab, args.seq, args.steps * args.batch_size, seed=100 + rank + 1000 * args.seed)
    mask_id = args.vocab
    start = time.perf_counter()
    # One batch's masked tokens are few (about 77 per rank), so its loss is
    # noisy: report the mean over the last 25 steps' batches of every rank.
    recent = []
    for step in range(args.steps):
        ids = data[step * args.batch_size : (step + 1) * args.batch_size]
        mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(step * 97 + rank + 10**7 * args.seed)) < 0.15
        inputs = ids.masked_fill(mask, mask_id)
        logits = model(inputs)
        loss = F.cross_entropy(logits[mask], ids[mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
        recent = (recent + [loss.item()])[-25:]
        if step % 50 == 0 or step == args.steps - 1:
            mean = torch.tensor([sum(recent) / len(recent)])
            dist.all_reduce(mean)
            mean = mean.item() / world
        if rank == 0 and step % 50 == 0:
            extra = "" if state is None or state.last_density is None else f", density {state.last_density:.4g}"
            if state is not None and state.last_xi is not None:
                extra += f", xi {state.last_xi:.3f}"
            print(f"step {step}: masked-token loss {mean:.3f} (mean of the last {len(recent)} steps; uniform: {math.log(args.vocab):.3f}){extra}", flush=True)
    elapsed = time.perf_counter() - start
    if args.force_path:  # per step on the path (after DDP's first two), over the ranks: the ring formula, or the library's count of its frames
        from oktopk.settings import NATIVE_WARMUP_ITERS

        params = sum(p.numel() for p in model.parameters())
        quantized = torch.tensor([float(state.quantized_bytes_sent)], dtype=torch.float64)
        dist.all_reduce(quantized)
        on_path = max(args.steps - NATIVE_WARMUP_ITERS, 1)
        path_bytes = 2 * params * 2 * (world - 1) / world if args.force_path == "bf16" else quantized.item() / world / on_path
    run_share = None
    if state is not None and not args.force_path:
        # The whole run's bytes against plain DDP's: the library's own count
        # of its frames, and the steps the hook sent natively (DDP's warm-up,
        # the choice's native steps) or in bfloat16 by the ring formula.
        ring = 2 * sum(p.numel() for p in model.parameters()) * (world - 1) / world  # values one rank sends per allreduce
        by_path = state.choice["steps"] if state.choice else {}
        native = min(args.steps, state.warmup_iters) + by_path.get("native", 0)
        own = torch.tensor([float(state.bytes_sent + state.quantized_bytes_sent)], dtype=torch.float64)
        dist.all_reduce(own)
        run_share = (own.item() / world + native * ring * 4 + by_path.get("bf16", 0) * ring * 2) / (args.steps * ring * 4)
    # Every rank evaluates (the replicas are equal), so that none is done long
    # before rank 0 prints.
    held = held_out_loss(model.module, args) if args.held_out else None
    if rank == 0:
        mode = "demo" if args.demo else f"oktopk_forced_{args.force_path}" if args.force_path else "oktopk" if args.oktopk else "dense"
        sent = f" bytes_sent_per_rank_per_iter={state.bytes_sent / max(args.steps - state.warmup_iters, 1):.0f}" if state else ""
        if args.demo:
            sent = f" bytes_sent_per_rank_per_iter={opt.bytes_sent / max(opt.steps, 1):.0f}"
        if args.force_path:
            sent = f" bytes_sent_per_rank_per_iter={path_bytes:.0f}"
        if run_share is not None:
            sent += f" run_bytes_vs_plain_ddp={run_share:.4f}"
        if args.held_out:
            sent += f" held_out_loss={held:.4f}"
        print(f"RESULT mode={mode} ranks={world} final_loss={mean:.3f} ms_per_iter={1000 * elapsed / args.steps:.1f}{sent}", flush=True)
    if state is not None:
        state.close()
    if args.demo:
        opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
