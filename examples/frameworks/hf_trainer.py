"""Hugging Face Transformers' Trainer pre-training BERT (masked language
modelling) on English text, with oktopk's hook on the DDP module Trainer
builds.

The model is ``BertForMaskedLM`` from a ``BertConfig``: BERT's architecture
at a reduced size, initialised afresh (no weights downloaded). The text is
Debian's ``fortunes`` collection (``make deps-text``); the WordPiece
vocabulary is built from it into the output folder (examples/frameworks/
data.py), so nothing is fetched at run time. Trainer's defaults stay on
(AdamW, clipping at max_grad_norm=1.0); ``--bf16`` trains under CPU bf16
autocast, ``--grad-accum`` accumulates micro-batches, ``--resume`` continues
from the output folder's last checkpoint.

Two ways to put the hook on, neither touching the training code:

    python -m oktopk.run --nproc-per-node 2 hf_trainer.py --out run   # no line: the launcher
    torchrun --nproc-per-node 2 hf_trainer.py --out run --oktopk       # the one line below

``--oktopk`` adds ``trainer.add_callback(OkTopkCallback(trainer))``
(oktopk.integrations): Trainer has no comm-hook argument, so the callback
registers the hook on ``trainer.model_wrapped`` when training begins, and
keeps each rank's hook state in Trainer's checkpoints so that a resumed run
continues as the uninterrupted one would.
"""

import argparse
import os

import torch
from data import SPECIAL, fortunes, write_vocab
from transformers import BertConfig, BertForMaskedLM, BertTokenizer, Trainer, TrainingArguments

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True, help="Trainer's output_dir: checkpoints, the final model")
ap.add_argument("--steps", type=int, default=8)
ap.add_argument("--save-steps", type=int, default=4)
ap.add_argument("--batch-size", type=int, default=8, help="per device")
ap.add_argument("--grad-accum", type=int, default=2)
ap.add_argument("--seq", type=int, default=32)
ap.add_argument("--bf16", action="store_true", help="CPU bf16 autocast (Trainer's bf16=True)")
ap.add_argument("--optim", default="adamw_torch", help="Trainer's optim (sgd: torch.optim.SGD, momentum from --optim-args)")
ap.add_argument("--optim-args", default=None, help='e.g. "momentum=0.9"')
ap.add_argument("--lr", type=float, default=5e-4)
ap.add_argument("--resume", action="store_true")
ap.add_argument("--oktopk", action="store_true", help="register the hook through OkTopkCallback (the one line)")
ap.add_argument("--hidden", type=int, default=64, help="BertConfig's hidden_size (heads of 32; the feed-forward 2x)")
ap.add_argument("--layers", type=int, default=2, help="BertConfig's num_hidden_layers")
ap.add_argument("--step-times", action="store_true", help="every rank prints each optimizer step's wall time (benchmarks)")
args = ap.parse_args()

texts = fortunes()
tokenizer = BertTokenizer(write_vocab(texts, os.path.join(args.out, "vocab")))


class Blocks(torch.utils.data.Dataset):
    """The text's token ids, cut into blocks of ``seq`` tokens between
    [CLS] and [SEP], masked as BERT's pre-training data was: 15% of the
    tokens chosen, 80% of those replaced by [MASK], 10% by a random token,
    10% kept; the loss on the chosen ones alone. Each block's masks are
    drawn once, from its index (static masking, as BERT's own data), not by
    DataCollatorForLanguageModeling at each batch: Trainer resumes by
    fetching the first batches before it restores the RNG, so masks drawn
    at collation differ after a resume, with or without oktopk
    (docs/frameworks.md)."""

    def __init__(self, texts, seq):
        ids = tokenizer(" ".join(texts[:3000]), add_special_tokens=False)["input_ids"]
        n = seq - 2
        self.blocks = [[tokenizer.cls_token_id] + ids[i : i + n] + [tokenizer.sep_token_id] for i in range(0, len(ids) - n, n)]

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        ids = torch.tensor(self.blocks[i])
        g = torch.Generator().manual_seed(i)
        chosen = torch.rand(len(ids), generator=g) < 0.15
        chosen[0] = chosen[-1] = False  # never [CLS] or [SEP]
        labels = torch.where(chosen, ids, -100)
        what = torch.rand(len(ids), generator=g)
        ids = torch.where(chosen & (what < 0.8), tokenizer.mask_token_id, ids)
        ids = torch.where(chosen & (what >= 0.8) & (what < 0.9), torch.randint(len(SPECIAL), tokenizer.vocab_size, ids.shape, generator=g), ids)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
                    num_attention_heads=args.hidden // 32, intermediate_size=2 * args.hidden, max_position_embeddings=args.seq)
torch.manual_seed(0)
model = BertForMaskedLM(config)
training_args = TrainingArguments(
    output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
    gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, optim=args.optim, optim_args=args.optim_args,
    bf16=args.bf16, use_cpu=True, save_steps=args.save_steps, logging_steps=1, report_to="none", seed=0,
    dataloader_num_workers=0, disable_tqdm=True,
)
trainer = Trainer(model=model, args=training_args, train_dataset=Blocks(texts, args.seq))
if args.step_times:
    import time

    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kwargs):
            self.began = time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):
            print(f"rank {int(os.environ.get('RANK', 0))} step {state.global_step} {1000 * (time.perf_counter() - self.began):.0f} ms",
                  flush=True)

    trainer.add_callback(StepTimes())
if args.oktopk:
    from oktopk.integrations import OkTopkCallback

    trainer.add_callback(OkTopkCallback(trainer))  # the one line
trainer.train(resume_from_checkpoint=True if args.resume else None)
trainer.save_model(os.path.join(args.out, "final"))
