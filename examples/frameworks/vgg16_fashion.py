"""torchvision's VGG-16 (``vgg16(num_classes=10)``, initialised afresh:
134M parameters, no weights downloaded) on Fashion-MNIST (Debian's
dataset-fashion-mnist, ``make deps-images``), each 28x28 grey image
padded to 32x32 and repeated over three channels, trained with plain DDP
and SGD with momentum and weight decay. ``--oktopk`` adds the one line:

    model.register_comm_hook(OkTopkState(), oktopk_hook)

or, with no line at all, run it under the launcher:

    torchrun --nproc-per-node 2 vgg16_fashion.py --oktopk
    python -m oktopk.run --nproc-per-node 2 vgg16_fashion.py

Every step moves 134M gradients (537 MB in float32): on a slow link the
dense allreduce is most of the step, which is where the hook helps.
"""

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from data import fashion_mnist
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision.models import vgg16

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=100)
ap.add_argument("--batch-size", type=int, default=32, help="per rank")
ap.add_argument("--lr", type=float, default=0.01)
ap.add_argument("--oktopk", action="store_true")
ap.add_argument("--algorithm", default=None, help="with --oktopk: name the algorithm of every step after the warm-up (on a fast "
                "link the default measured choice keeps DDP's allreduce; accuracy studies name one)")
ap.add_argument("--every-rank", action="store_true", help="every rank prints its steps' times (benchmarks), not rank 0 alone")
ap.add_argument("--seed", type=int, default=0, help="the model's initial weights and the order of the images")
ap.add_argument("--eval", type=int, default=0, help="at the end, rank 0's accuracy on the first N test images (0: none)")
args = ap.parse_args()


def to_input(images):
    """28x28 grey uint8 images as VGG's input: padded to 32x32 (as LeNet's
    input was), normalised, repeated over three channels."""
    x = np.pad(images, ((0, 0), (2, 2), (2, 2)))
    x = torch.from_numpy(x).float().div_(255.0).sub_(0.2860).div_(0.3530)  # Fashion-MNIST's mean and deviation
    return x.unsqueeze(1).expand(-1, 3, -1, -1)


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
images, labels = fashion_mnist("train")
data = torch.utils.data.TensorDataset(to_input(images), torch.from_numpy(labels))
sampler = torch.utils.data.distributed.DistributedSampler(data, seed=args.seed)
loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)

torch.manual_seed(args.seed)
model = DDP(vgg16(num_classes=10))
if args.oktopk:
    from oktopk import OkTopkState, oktopk_hook

    model.register_comm_hook(OkTopkState(algorithm=args.algorithm), oktopk_hook)  # the one line
opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
params = sum(p.numel() for p in model.parameters())
if rank == 0:
    print(f"vgg16: {params:,} parameters, {world} ranks, {args.batch_size} images a rank a step", flush=True)

step, epoch = 0, 0
while step < args.steps:
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        t = time.perf_counter()
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if args.every_rank:
            print(f"rank {rank} step {step} loss {loss.item():.4f} {1000 * (time.perf_counter() - t):.0f} ms", flush=True)
        elif rank == 0:
            print(f"step {step} loss {loss.item():.4f} {1000 * (time.perf_counter() - t):.0f} ms", flush=True)
        if step == args.steps:
            break
    epoch += 1
if args.eval and rank == 0:
    test_images, test_labels = fashion_mnist("t10k")
    model.eval()
    with torch.no_grad():
        right = sum(int((model.module(to_input(test_images[i : i + 100])).argmax(1) == torch.from_numpy(test_labels[i : i + 100])).sum())
                    for i in range(0, min(args.eval, len(test_labels)), 100))
    print(f"accuracy {100.0 * right / min(args.eval, len(test_labels)):.2f} on {min(args.eval, len(test_labels))} test images", flush=True)
dist.barrier()
dist.destroy_process_group()
