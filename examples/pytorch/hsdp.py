"""The BERT-style model of bert.py trained with HSDP (FSDP2 on a 2-D
mesh): parameters sharded within each replica, gradients reduced across
replicas. Dense, FSDP2 shards over the whole mesh and all-reduces each
gradient shard over the replicate dimension itself; with ``--oktopk`` it
shards over the shard dimension only and ``oktopk.fsdp.register`` reduces
the shards across the replicas sparsely:

    python -m torch.distributed.run --nproc-per-node 4 examples/pytorch/hsdp.py
    python -m torch.distributed.run --nproc-per-node 4 examples/pytorch/hsdp.py --oktopk --algorithm oktopk

4 ranks make a 2 x 2 mesh (replicate x shard). Every rank trains on its own
batches, as with DDP, so the run compares with bert.py's at the same steps.
Prints the loss, and the gradient bytes each rank sends per step on each
mesh dimension: the reduce-scatter's over the shard dimension (the same in
both modes) and the all-reduce's over the replicate dimension (FSDP2's ring,
or what the sparse calls sent).
"""

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bert import TinyBert, markov_corpus  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--oktopk", action="store_true")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--algorithm", default=None, help="an oktopk.ALGORITHMS name (default: the measured choice between gloo's allreduce and sparse)")
    ap.add_argument("--shard", type=int, default=2, help="ranks per replica (the shard dimension)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--demo", action="store_true", help="train with oktopk.optim.DeMo across the replicas instead of Adam")
    ap.add_argument("--demo-lr", type=float, default=3e-3, help="DeMo's learning rate (its sign step's size)")
    args = ap.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world // args.shard, args.shard), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = TinyBert(args.vocab, seq=args.seq)
    numel = sum(p.numel() for p in model.parameters())
    # Dense: FSDP2's own HSDP over the 2-D mesh. Sparse: shard only; the
    # replicate dimension is oktopk's.
    shard_on = mesh["shard"] if args.oktopk or args.demo else mesh
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=shard_on)
    fully_shard(model, mesh=shard_on)
    state = None
    if args.oktopk:
        import oktopk.fsdp
        from oktopk import OkTopkState

        state = OkTopkState(process_group=mesh.get_group("replicate"), density=args.density, algorithm=args.algorithm, tau_prime=128)
        oktopk.fsdp.register(model, state)  # the one line that switches the replicas to sparse
    if args.demo:
        import oktopk.optim

        # The one line for Adam users: DeMo exchanges each shard's momentum with its replicas.
        opt = oktopk.optim.DeMo(model.parameters(), lr=args.demo_lr, process_group=mesh.get_group("replicate"))
    else:
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = markov_corpus(args.vocab, args.seq, args.steps * args.batch_size, seed=100 + rank)
    mask_id = args.vocab
    start = time.perf_counter()
    recent = []
    for step in range(args.steps):
        ids = data[step * args.batch_size : (step + 1) * args.batch_size]
        mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(step * 97 + rank)) < 0.15
        logits = model(ids.masked_fill(mask, mask_id))
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
                print(f"step {step}: masked-token loss {mean:.3f} (mean of the last {len(recent)} steps; uniform: {math.log(args.vocab):.3f})", flush=True)
    elapsed = time.perf_counter() - start
    shard, replicas = args.shard, world // args.shard
    # Per rank and step, in float32 gradient bytes, by ring arithmetic: the
    # reduce-scatter sends (S-1)/S of the gradients; a dense all-reduce of a
    # shard sends 2(R-1)/R of it.
    shard_bytes = (shard - 1) / shard * numel * 4
    ring_bytes = 2 * (replicas - 1) / replicas * numel / shard * 4
    if args.demo:  # DeMo's own count of its exchanges, indices included
        replicate_bytes = opt.bytes_sent / args.steps
    elif state is None:
        replicate_bytes = ring_bytes
    else:  # the sparse calls' own count, and the ring's for the warm-up and the steps that took gloo's allreduce
        sparse_steps = state.choice["steps"]["sparse"] if state.choice else args.steps - state.warmup_iters
        replicate_bytes = (state.bytes_sent + (args.steps - sparse_steps) * ring_bytes) / args.steps
        sparse_step_bytes = state.bytes_sent / max(sparse_steps, 1)
    if rank == 0:
        mode = "demo" if args.demo else "dense" if state is None else "oktopk"
        path = "" if state is None or state.choice is None else f" path={state.choice['path']}"
        if state is not None:  # what one sparse step sends, beside the run's average
            path += f" replicate_bytes_per_sparse_step={sparse_step_bytes:.0f}"
        print(f"RESULT mode={mode} mesh={replicas}x{shard} final_loss={mean:.3f} ms_per_iter={1000 * elapsed / args.steps:.1f} "
              f"shard_bytes_per_iter={shard_bytes:.0f} replicate_bytes_per_iter={replicate_bytes:.0f}{path}", flush=True)
    if state is not None:
        state.close()
    if args.demo:
        opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
