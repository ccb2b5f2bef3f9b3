"""A small byte-level causal transformer trained on real English text, the
``fortunes`` collection that Debian's ``fortunes`` package installs
(quotations, jokes, poems, definitions; about 2.6 MB), with AdamW, a linear
learning-rate warm-up, cosine decay and gradient clipping, under PyTorch DDP
over gloo: the shape of most transformer training scripts. Switching to
sparse allreduce is the line behind ``--oktopk`` (``--density`` and
``--warmup`` set the OkTopkState options of the same names); ``--demo LR``
replaces AdamW by ``oktopk.optim.DeMo`` at peak learning rate LR, the one
line behind it (DeMo exchanges its momentum over Ok-Topk, and turns DDP's
gradient allreduce off).

    apt-get install fortunes     # once; make bench-text installs it
    python -m torch.distributed.run --nproc-per-node 4 examples/pytorch/charlm.py --oktopk

Every tenth fortune is held out; the held-out loss (mean cross entropy per
byte, in nats; uniform guessing is log 256 = 5.55) is what the run reports.
bench/ddp_e2e.py trains this model (``--model charlm``) under every method
for the time-to-loss benchmark.
"""

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

FORTUNES = "/usr/share/games/fortunes"
# Pictures drawn in characters, not text.
NOT_TEXT = ("art", "ascii-art")


def fortunes_corpus(folder=FORTUNES, holdout_every=10):
    """(train bytes, held-out bytes) as uint8 tensors: the fortunes of every
    text file of the collection, in file-name order, every
    ``holdout_every``-th one held out. FileNotFoundError saying which package
    to install when the collection is missing."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder} is missing: install Debian's fortunes package (apt-get install fortunes)")
    names = sorted(n for n in os.listdir(folder) if "." not in n and n not in NOT_TEXT)
    entries = []
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            entries += [e.strip() + b"\n\n" for e in f.read().split(b"\n%\n") if e.strip()]
    train = [e for i, e in enumerate(entries) if i % holdout_every != holdout_every - 1]
    held = entries[holdout_every - 1 :: holdout_every]
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).clone()  # noqa: E731
    return as_tensor(train), as_tensor(held)


def batch(text, size, seq, generator):
    """(inputs, targets): ``size`` windows of ``seq + 1`` bytes at random
    offsets, as int64 ids."""
    starts = torch.randint(0, len(text) - seq - 1, (size,), generator=generator)
    windows = torch.stack([text[s : s + seq + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


class CharTransformer(nn.Module):
    """Byte embeddings and learned positions, ``layers`` pre-norm causal
    transformer blocks, a final LayerNorm and a linear head over the 256
    byte values (dim 192, 4 layers, windows of 64 bytes: 1.89M
    parameters)."""

    def __init__(self, dim=192, layers=4, heads=6, seq=64):
        super().__init__()
        self.seq = seq
        self.tokens = nn.Embedding(256, dim)
        self.positions = nn.Parameter(0.02 * torch.randn(seq, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256)

    def forward(self, ids):
        t = ids.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(t)
        x = self.blocks(self.tokens(ids) + self.positions[:t], mask=causal, is_causal=True)
        return self.head(self.norm(x))


def lm_loss(model, inputs, targets):
    return F.cross_entropy(model(inputs).reshape(-1, 256), targets.reshape(-1))


def held_out_batch(held, seq, windows=64):
    """The held-out windows every evaluation uses: the same ``windows``
    windows of ``seq + 1`` bytes, always."""
    return batch(held, windows, seq, torch.Generator().manual_seed(12345))


def held_out_loss(model, held, seq):
    """Mean cross entropy per byte over the held-out windows."""
    model.eval()
    with torch.no_grad():
        loss = lm_loss(model, *held_out_batch(held, seq)).item()
    model.train()
    return loss


def lr_at(step, steps, peak, warmup):
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to
    a tenth of it at ``steps``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--oktopk", action="store_true")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=2, help="oktopk: dense warm-up iterations (warmup_iters)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16, help="windows per rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lr-warmup", type=int, default=30)
    ap.add_argument("--demo", type=float, default=None, metavar="LR", help="oktopk.optim.DeMo instead of AdamW, at this peak learning rate")
    args = ap.parse_args(argv)
    if args.demo is not None and args.oktopk:
        ap.error("--demo exchanges DeMo's momentum itself: it takes no comm hook (--oktopk)")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    train_text, held = fortunes_corpus()
    model = DDP(CharTransformer(args.dim, args.layers, seq=args.seq))
    if args.demo is not None:
        import oktopk.optim

        args.lr = args.demo
        opt = oktopk.optim.DeMo(model, lr=args.lr, weight_decay=0.01)  # the one line: was torch.optim.AdamW
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    state = None
    if args.oktopk:
        import oktopk

        state = oktopk.OkTopkState(density=args.density, warmup_iters=args.warmup)
        model.register_comm_hook(state, oktopk.oktopk_hook)  # the one line that switches to sparse
    gen = torch.Generator().manual_seed(1000 + rank)
    start = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.lr_warmup)
        inputs, targets = batch(train_text, args.batch_size, args.seq, gen)
        opt.zero_grad()
        lm_loss(model, inputs, targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step}: held-out loss {held_out_loss(model.module, held, args.seq):.3f} nats/byte", flush=True)
    elapsed = time.perf_counter() - start
    if rank == 0:
        mode = "demo" if args.demo is not None else "oktopk" if args.oktopk else "dense"
        print(f"RESULT mode={mode} ranks={world} held_out_loss={held_out_loss(model.module, held, args.seq):.3f} "
              f"ms_per_iter={1000 * elapsed / args.steps:.1f}", flush=True)
    if state is not None:
        state.close()
    if args.demo is not None:
        opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
