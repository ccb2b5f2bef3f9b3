"""The VGG-style digits CNN of examples/pytorch/cnn.py, trained with
Horovod. As with Horovod's own ``--fp16-allreduce``, going sparse is only
the compression choice, behind ``--oktopk``; both together send the sparse
values as float16:

    horovodrun --gloo -np 4 -H localhost:4 python examples/horovod/horovod_cnn.py
    horovodrun --gloo -np 4 -H localhost:4 python examples/horovod/horovod_cnn.py --oktopk
    horovodrun --gloo -np 4 -H localhost:4 python examples/horovod/horovod_cnn.py --oktopk --fp16-allreduce
"""

import argparse
import os
import sys
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pytorch"))
from cnn import VGGStyle, accuracy, digits  # noqa: E402  the same model and data as the DDP example

import oktopk_horovod  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--oktopk", action="store_true", help="Ok-Topk sparse allreduce")
    ap.add_argument("--fp16-allreduce", action="store_true", help="Horovod's fp16 compression; with --oktopk, float16 sparse values")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--algorithm", default=None, help="an oktopk.ALGORITHMS name, e.g. oktopk or auto (default: the measured choice between the framework's allreduce and sparse)")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=16, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-seed", type=int, default=None, help="model init seed (default: --seed; + rank to test the broadcast)")
    args = ap.parse_args(argv)

    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed if args.init_seed is None else args.init_seed + rank)
    (xtr, ytr), (xte, yte) = digits(args.seed)
    model = VGGStyle()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # Horovod: the compression choice is the only change for sparse allreduce;
    # --fp16-allreduce keeps its meaning there: the values travel as float16.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    if args.oktopk:
        compression = oktopk_horovod.Compression.oktopk(
            density=args.density, algorithm=args.algorithm, value_dtype="float16" if args.fp16_allreduce else "float32"
        )
    opt = oktopk_horovod.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    shard = torch.arange(rank, len(ytr), world)[: len(ytr) // world]
    steps_per_epoch = len(shard) // args.batch_size
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * steps_per_epoch)
    steps, start = 0, time.perf_counter()
    for epoch in range(args.epochs):
        perm = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))]
        for i in range(0, len(perm) - args.batch_size + 1, args.batch_size):
            idx = perm[i : i + args.batch_size]
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            steps += 1
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f} test accuracy {accuracy(model, xte, yte):.2f}%", flush=True)
    elapsed = time.perf_counter() - start
    acc = accuracy(model, xte, yte)
    if rank == 0:
        mode = ("oktopk" if args.oktopk else "dense") + ("-fp16" if args.fp16_allreduce else "")
        sent = f" bytes_sent_per_rank_per_iter={opt.bytes_sent / steps:.0f}" if args.oktopk else ""
        print(f"RESULT mode={mode} ranks={world} accuracy={acc:.2f}% ms_per_iter={1000 * elapsed / steps:.2f}{sent}", flush=True)
    param_bytes = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    bytes_sent = opt.bytes_sent if args.oktopk else None
    if args.oktopk:
        opt.close()
    return {"accuracy": acc, "params": param_bytes, "steps": steps, "bytes_sent": bytes_sent}


if __name__ == "__main__":
    main()
