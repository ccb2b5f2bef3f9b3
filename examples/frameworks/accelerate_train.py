"""Hugging Face Accelerate training a small byte-level transformer language
model on English text (Debian's fortunes collection, ``make deps-text``)
with SGD and momentum, with oktopk's hook put on the DDP module that
``accelerator.prepare`` returns, as Accelerate documents for comm hooks:

    model, opt, loader = accelerator.prepare(model, opt, loader)
    model.register_comm_hook(state, oktopk_hook)                 # the one line

``accelerator.register_for_checkpointing(EveryRank(state))`` puts every
rank's hook state into ``save_state``'s folder, and ``load_state`` gives
each rank its own back (Accelerate writes a registered object from rank 0
alone, and a rank's residuals are its own). Accelerate's defaults stay
on (no mixed precision, no clipping; ``--mixed-precision bf16`` and
``--clip`` change them).

    accelerate launch --num-processes 2 accelerate_train.py --out run --oktopk
    torchrun --nproc-per-node 2 accelerate_train.py --out run --oktopk            # the same
    torchrun --nproc-per-node 2 accelerate_train.py --out run2 --oktopk --resume run/step_4
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from data import fortunes

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--steps", type=int, default=8)
ap.add_argument("--save-every", type=int, default=4)
ap.add_argument("--batch-size", type=int, default=16, help="per rank")
ap.add_argument("--seq", type=int, default=64)
ap.add_argument("--mixed-precision", default=None, help="Accelerator's mixed_precision (its default: none)")
ap.add_argument("--clip", type=float, default=None, help="clip_grad_norm_ to this (Accelerate's default: none)")
ap.add_argument("--resume", default=None, help="a save_state folder to continue from")
ap.add_argument("--oktopk", action="store_true")
args = ap.parse_args()


class ByteLM(nn.Module):
    """Byte embeddings and learned positions, two causal transformer
    layers, a head over the 256 byte values."""

    def __init__(self, dim=64, seq=64):
        super().__init__()
        self.tokens = nn.Embedding(256, dim)
        self.positions = nn.Parameter(0.02 * torch.randn(seq, dim))
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 256)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x):
        h = self.tokens(x) + self.positions[: x.shape[1]]
        return self.head(self.blocks(h, mask=self.causal[: x.shape[1], : x.shape[1]], is_causal=True))


text = torch.frombuffer(bytearray("\n\n".join(fortunes()).encode()), dtype=torch.uint8).long()
windows = text[: (len(text) // (args.seq + 1)) * (args.seq + 1)].view(-1, args.seq + 1)

# cpu=True where there is no GPU: without it Accelerate runs the ranks of a
# CPU job apart, without DDP. A seedable sampler: the shuffled order is a
# function of the seed and the epoch, so a resumed run draws the batches
# the whole run drew.
accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=args.mixed_precision,
                          dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
set_seed(0)
model = ByteLM(seq=args.seq)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loader = torch.utils.data.DataLoader(windows, batch_size=args.batch_size, shuffle=True, drop_last=True)
model, opt, loader = accelerator.prepare(model, opt, loader)
if args.oktopk:
    from oktopk import OkTopkState, oktopk_hook
    from oktopk.integrations import EveryRank

    state = OkTopkState()
    model.register_comm_hook(state, oktopk_hook)  # the one line
    accelerator.register_for_checkpointing(EveryRank(state))  # every rank's hook state in save_state

step = 0
batches = loader
if args.resume:
    accelerator.load_state(args.resume)
    step = int(os.path.basename(os.path.normpath(args.resume)).split("_")[-1])
    batches = accelerator.skip_first_batches(loader, step)
model.train()
while step < args.steps:
    for w in batches:
        logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), w[:, 1:].reshape(-1))
        accelerator.backward(loss)
        if args.clip is not None:
            accelerator.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        step += 1
        accelerator.print(f"step {step} loss {loss.item():.4f}")
        if step % args.save_every == 0:
            accelerator.save_state(os.path.join(args.out, f"step_{step}"))
        if step == args.steps:
            break
    batches = loader
accelerator.wait_for_everyone()
accelerator.save_model(model, os.path.join(args.out, "final"))
