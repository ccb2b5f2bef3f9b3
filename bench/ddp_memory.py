"""Peak resident memory of a DDP training run, plain or through oktopk's
hook: the CNN of examples/pytorch/cnn.py (``--width 13``: about 16M
parameters, 66 MB of float32 gradients) over gloo on CPU, the same data,
initialization and steps for both. Rank 0 prints one line: each rank's
peak RSS (VmHWM of /proc/self/status, which counts every allocation the
process made: torch's, gloo's, liboktopk's Go heap and ZeroMQ's), their
maximum, and the gradient's size.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 bench/ddp_memory.py --hook ddp
    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 bench/ddp_memory.py --hook oktopk
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "pytorch"))
from cnn import VGGStyle, digits  # noqa: E402


def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hook", choices=("ddp", "oktopk"), required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=13)
    ap.add_argument("--batch-size", type=int, default=4, help="per rank")
    ap.add_argument("--density", type=float, default=0.01)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    (xtr, ytr), _ = digits(0)
    model = DDP(VGGStyle(args.width))
    state = None
    if args.hook == "oktopk":
        from oktopk import OkTopkState, oktopk_hook

        state = OkTopkState(density=args.density)
        model.register_comm_hook(state, oktopk_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    params = sum(p.numel() for p in model.parameters())
    shard = torch.arange(rank, len(ytr), world)
    for step in range(args.steps):
        at = step * args.batch_size % (len(shard) - args.batch_size)
        idx = shard[at : at + args.batch_size]
        loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    peak = torch.tensor([status_kib("VmHWM")], dtype=torch.int64)
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(peaks, peak)
    staged = None
    if state is not None:
        staged = {("pinned" if k else "host"): v.numel() for k, v in state._reducer.staging.items()}
        state.close()
    if rank == 0:
        kib = [int(p.item()) for p in peaks]
        print(f"RESULT hook={args.hook} ranks={world} params={params} steps={args.steps} batch_per_rank={args.batch_size} "
              f"peak_rss_kib={kib} max_peak_rss_mib={max(kib) / 1024:.1f} gradient_mib={params * 4 / 2**20:.1f} "
              f"staging_bytes={staged}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
