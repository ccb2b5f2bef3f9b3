"""The dense paths an Adam-family optimizer's buckets can take, alone (no
training around them): torch.distributed's gloo allreduce of n float32,
the same in bfloat16 (``bf16_compress_hook``'s wire format), and
``oktopk.quantized``'s 4-bit allreduce with error feedback (rounding in
the library, and as tensor operations); beside them the quantized path's
two exchanges and its local work as tensor operations. Each figure is the
median over ``--reps`` calls, each started after a barrier, of the slowest
rank's time; rank 0 prints ``name,ms`` lines. Run it on the emulated
cluster:

    BENCH_MODE=netns BENCH_RATE=200mbit bench/cluster.sh 4 OUT \\
        "OMP_NUM_THREADS=1 PYTHONPATH=plugins/pytorch python bench/dense_paths.py"
"""

import argparse
import time

import torch
import torch.distributed as dist

from oktopk import quantized
from oktopk.quantized import BLOCK, QuantizedGroup, dequantize, pack, quantize, unpack


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1890688, help="values (default: the text benchmark's transformer)")
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(args.n, generator=torch.Generator().manual_seed(rank))
    group = QuantizedGroup((0,), (args.n,), world, rank, "cpu")
    frame = group.frame_bytes()

    def timed(name, call):
        seconds = []
        for _ in range(args.reps):
            dist.barrier()
            start = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - start)
        slowest = torch.tensor([sorted(seconds)[args.reps // 2]])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"{name},{1e3 * slowest.item():.1f}", flush=True)

    whole_blocks = x[: args.n // BLOCK * BLOCK]  # quantize() takes whole blocks; the group pads

    def local_work():
        codes, scales = quantize(whole_blocks)
        dequantize(unpack(pack(codes)), scales)

    send, received = torch.zeros(world, frame, dtype=torch.uint8), torch.empty(world, frame, dtype=torch.uint8)
    own = torch.zeros(frame, dtype=torch.uint8)
    timed("float32_allreduce", lambda: dist.all_reduce(x.clone()))
    timed("bf16_allreduce", lambda: dist.all_reduce(x.to(torch.bfloat16)))
    timed("quantized_allreduce", lambda: group.allreduce_(x.clone(), None))
    # The same call with the rounding done by tensor operations (as on a
    # GPU, and on the CPU before the library's one-pass rounding).
    library_rounds = quantized._library_rounds
    quantized._library_rounds = lambda *settings: False
    timed("quantized_allreduce_tensors", lambda: group.allreduce_(x.clone(), None))
    quantized._library_rounds = library_rounds
    timed("quantized_all_to_all", lambda: dist.all_to_all_single(received, send))
    timed("quantized_allgather", lambda: dist.all_gather([torch.empty_like(own) for _ in range(world)], own))
    timed("quantized_local_work", local_work)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
