"""DDP training steps with gradients on the GPU: plain DDP against the
hook's staging path (each bucket copied whole to pinned host memory, selected
and reduced there, copied back) and its device path (selection and residual
on the GPU, only pairs across PCIe), for ``make gpu-check``.

The model is ``--layers`` square linear layers of width ``--width`` (about
10^8 parameters by default), so DDP's buckets hold ~10^8 gradients. P ranks
share GPU 0 over a gloo process group (``--backend nccl`` needs P GPUs: rank r
on GPU r). Every rank times every step (CUDA synchronized); rank 0 prints,
per method, the slowest rank's median ms per step and each rank's, with the
host-device bytes per step. The methods run in the order given, then in
reverse (``--repeats 2``), each from a fresh model and state.

Before the steps rank 0 times the device path's parts alone on one bucket of
``--layers x --width^2`` float32 gradients at ``--density``: the exact
selection (torch.topk), a reused-threshold selection, and the transfers of
the selected pairs to the host and of as many result pairs back.

    torchrun --nproc-per-node 2 bench/gpu_step.py
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

METHODS = ("ddp", "staging", "device")


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def part_timings(device, n, density, repeats=5):
    """ms of the device path's parts on one bucket of n gradients: (exact
    selection, reused-threshold selection, pairs to host and back)."""
    from oktopk import device as device_path

    g = torch.Generator(device=device).manual_seed(0)
    acc = torch.randn(n, device=device, generator=g)
    k = max(1, int(density * n))
    magnitude = acc.abs()

    def timed(fn):
        out = []
        for _ in range(repeats):
            synchronize(device)
            t = time.perf_counter()
            fn()
            synchronize(device)
            out.append((time.perf_counter() - t) * 1e3)
        return statistics.median(out)

    _, th, _ = device_path.select_by_rules(magnitude, k, 0.0, True)
    exact_ms = timed(lambda: device_path.select_by_rules(magnitude, k, 0.0, True))
    reuse_ms = timed(lambda: device_path.select_by_rules(magnitude, k, th, False))
    indices, _, _ = device_path.select_by_rules(magnitude, k, th, False)
    pinned = device.type == "cuda"
    host_i = torch.empty(indices.numel(), dtype=torch.int32, pin_memory=pinned)
    host_v = torch.empty(indices.numel(), dtype=torch.float32, pin_memory=pinned)

    def transfers():
        host_i.copy_(indices.to(torch.int32))
        host_v.copy_(acc[indices])
        back_i, back_v = host_i.to(device, non_blocking=True), host_v.to(device, non_blocking=True)
        acc[back_i.long()] = back_v

    transfer_ms = timed(transfers)
    return exact_ms, reuse_ms, transfer_ms, indices.numel()


def run_method(method, args, device, rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)]).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    state = None
    if method != "ddp":
        from oktopk import OkTopkState, oktopk_hook

        state = OkTopkState(algorithm="oktopk", density=args.density, warmup_iters=2, device_path=(method == "device"))
        ddp.register_comm_hook(state, oktopk_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
    x = torch.randn(args.batch, args.width, device=device, generator=torch.Generator(device=device).manual_seed(rank))
    seconds = []
    bytes_before = 0
    for step in range(args.warmup + args.steps):
        if step == args.warmup and state is not None:
            bytes_before = state.host_device_bytes
        synchronize(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        ddp(x).square().mean().backward()
        opt.step()
        synchronize(device)
        if step >= args.warmup:
            seconds.append(time.perf_counter() - start)
    moved = 0 if state is None else (state.host_device_bytes - bytes_before) / args.steps
    if state is not None:
        state.close()
    del ddp, model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(seconds) * 1e3, moved


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps first (DDP's two dense ones among them)")
    ap.add_argument("--repeats", type=int, default=2, help="1: the order given; 2: then reversed")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    methods = args.methods.split(",")
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        device = torch.device("cuda", rank if args.backend == "nccl" else 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    n = args.layers * args.width * args.width
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"gpu_step: {world} ranks over {args.backend} on {name} ({torch.cuda.device_count() if device.type == 'cuda' else 0} GPUs "
              f"visible), {n / 1e6:.1f}M parameters in {args.layers} layers, density {args.density}, {os.cpu_count()} CPU cores", flush=True)
        exact_ms, reuse_ms, transfer_ms, count = part_timings(device, n, args.density)
        print(f"device path parts on one bucket of {n / 1e6:.1f}M (rank 0 alone): exact selection {exact_ms:.1f} ms, "
              f"reused threshold {reuse_ms:.1f} ms, {count} pairs to host and back {transfer_ms:.1f} ms; "
              f"selection + transfers {reuse_ms + transfer_ms:.1f} ms (reuse calls), {exact_ms + transfer_ms:.1f} ms (exact calls)", flush=True)
    dist.barrier()
    order = methods + (methods[::-1] if args.repeats > 1 else [])
    medians = {m: [] for m in methods}
    for method in order:
        ms, moved = run_method(method, args, device, rank, world)
        every = [None] * world
        dist.all_gather_object(every, (ms, moved))
        if rank == 0:
            slowest = max(e[0] for e in every)
            medians[method].append(slowest)
            print(f"{method:8s} slowest rank {slowest:8.1f} ms/step; ranks {', '.join(f'{e[0]:.1f}' for e in every)}; "
                  f"host-device {every[0][1] / 1e6:.2f} MB/step", flush=True)
    if rank == 0:
        base = statistics.median(medians["ddp"]) if medians.get("ddp") else None
        for m in methods:
            mid = statistics.median(medians[m])
            rel = f" ({mid / base:.2f}x plain DDP)" if base else ""
            print(f"RESULT {m} ranks={world} backend={args.backend} ms_per_step={mid:.1f}{rel} runs={len(medians[m])}", flush=True)
        if medians.get("staging") and medians.get("device"):
            print(f"RESULT device path {statistics.median(medians['staging']) / statistics.median(medians['device']):.2f}x faster than staging",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
