"""PyTorch Lightning training a small CNN on Fashion-MNIST (Debian's
dataset-fashion-mnist, ``make deps-images``) with SGD and momentum, with
oktopk's hook through Lightning's own DDPStrategy arguments:

    strategy = DDPStrategy(ddp_comm_state=state, ddp_comm_hook=oktopk_hook)   # the one line

and ``OkTopkLightningCallback(state)`` among the callbacks: Lightning's
checkpoint then holds every rank's hook state and ``fit(ckpt_path=...)``
gives each rank its own back; and on CPU, where DDPStrategy registers no
comm hook (Lightning 2.6 registers ``ddp_comm_hook`` on CUDA only), the
callback registers it (docs/frameworks.md). Lightning's defaults stay on (32-bit precision, no
gradient clipping; ``--precision bf16-mixed`` and ``--clip`` change them).
A checkpoint is written at each epoch's end.

    torchrun --nproc-per-node 2 lightning_train.py --out run --oktopk
    torchrun --nproc-per-node 2 lightning_train.py --out run2 --oktopk --resume run/epoch=0-step=4.ckpt

Without ``--oktopk`` it is the same script with plain DDP (``strategy="ddp"``).
"""

import argparse

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from data import fashion_mnist
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True, help="checkpoints' folder")
ap.add_argument("--epochs", type=int, default=2)
ap.add_argument("--batches", type=int, default=4, help="steps per epoch (limit_train_batches)")
ap.add_argument("--batch-size", type=int, default=32, help="per rank")
ap.add_argument("--precision", default="32-true")
ap.add_argument("--clip", type=float, default=None, help="gradient_clip_val (Lightning's default: none)")
ap.add_argument("--resume", default=None, help="a checkpoint to continue from")
ap.add_argument("--oktopk", action="store_true", help="the hook through DDPStrategy, with OkTopkLightningCallback")
ap.add_argument("--strategy-only", action="store_true", help="with --oktopk: DDPStrategy alone, without the callback")
ap.add_argument("--nodes", type=int, default=1)
ap.add_argument("--devices", type=int, default=2, help="processes per node")
args = ap.parse_args()


class FashionCNN(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10),
        )

    def training_step(self, batch, i):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


images, labels = fashion_mnist("train")
data = torch.utils.data.TensorDataset(torch.from_numpy(images[:8192].copy()).float().unsqueeze(1) / 255.0, torch.from_numpy(labels[:8192]))
loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True)

pl.seed_everything(0)
model = FashionCNN()
callbacks = [ModelCheckpoint(dirpath=args.out, save_top_k=-1, every_n_epochs=1)]
if args.oktopk:
    from oktopk import OkTopkState, oktopk_hook
    from oktopk.integrations import OkTopkLightningCallback

    state = OkTopkState()
    strategy = DDPStrategy(ddp_comm_state=state, ddp_comm_hook=oktopk_hook)  # the one line
    # Every rank's hook state in Lightning's checkpoint; and the hook
    # registered on CPU, where DDPStrategy registers comm hooks on CUDA only.
    if not args.strategy_only:
        callbacks.append(OkTopkLightningCallback(state))
else:
    strategy = "ddp"
trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.nodes, strategy=strategy,
                     max_epochs=args.epochs, limit_train_batches=args.batches, precision=args.precision,
                     gradient_clip_val=args.clip, callbacks=callbacks, logger=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(model, loader, ckpt_path=args.resume)
