"""The BERT-style model of bert.py cut into 2 pipeline stages
(``torch.distributed.pipelining``, GPipe schedule), each stage replicated
data-parallel over its own group of replicas with FSDP2 (a shard dimension
of 1 rank: replicas, not shards). Dense, FSDP2 all-reduces each stage's
gradients over its replicas; with ``--oktopk``, ``oktopk.fsdp.register``
does it sparsely: one communicator per stage's group of replicas, set up
through that group's own store keys.

    python -m torch.distributed.run --nproc-per-node 4 examples/pytorch/pipeline.py
    python -m torch.distributed.run --nproc-per-node 4 examples/pytorch/pipeline.py --oktopk --algorithm oktopk

4 ranks make a 2 x 2 mesh (stage x replica): ranks 0 and 1 are replicas of
stage 0 (embeddings and the first encoder layer), ranks 2 and 3 of stage 1
(the second layer and the output head). Each replica feeds its own
batches of 32 sequences in 4 micro-batches, so a step sees as many
sequences as bert.py's 4 ranks of 16. Prints the loss, and the bytes each
rank sends per step on each mesh dimension: the activations and their
gradients between stages, and the gradient all-reduce between replicas
(the ring's, or what the sparse calls sent).

Why not DDP per stage: in the torch this project pins, DDP under a
pipeline schedule fails its bucket rebuild after the first step (several
micro-batch backward passes), and with ``static_graph=True`` the last
stage's replicas are never synchronized. The DDP hook itself has no such
limit; FSDP2's hook path is what works here.
"""

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bert import TinyBert, markov_corpus  # noqa: E402

IGNORE = -100  # targets of unmasked tokens: not in the loss


class FirstStage(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.tokens, self.positions, self.layer = model.tokens, model.positions, model.encoder.layers[0]

    def forward(self, ids):
        return self.layer(self.tokens(ids) + self.positions)


class LastStage(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.layer, self.head = model.encoder.layers[1], model.head

    def forward(self, hidden):
        return self.head(self.layer(hidden))


def masked_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--oktopk", action="store_true")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--algorithm", default=None, help="an oktopk.ALGORITHMS name (default: the measured choice between gloo's allreduce and sparse)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=32, help="sequences per replica and step")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        raise SystemExit("pipeline.py runs on 4 ranks: 2 stages x 2 replicas")
    torch.set_num_threads(1)
    # The shard dimension has 1 rank: FSDP2 here only replicates each stage
    # (why not DDP: see the top of this file).
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("stage", "replica", "shard"))
    stage_index, replica = rank // 2, rank % 2
    torch.manual_seed(0)
    model = TinyBert(args.vocab, seq=args.seq, layers=2)  # every rank builds it whole, then keeps its stage
    part = FirstStage(model) if stage_index == 0 else LastStage(model)
    numel = sum(p.numel() for p in part.parameters())
    # Dense: FSDP2's own all-reduce over the replicas. Sparse: oktopk's.
    fully_shard(part, mesh=mesh["shard"] if args.oktopk else mesh["replica", "shard"])
    state = None
    if args.oktopk:
        import oktopk.fsdp
        from oktopk import OkTopkState

        state = OkTopkState(process_group=mesh.get_group("replica"), density=args.density, algorithm=args.algorithm, tau_prime=128)
        oktopk.fsdp.register(part, state)  # the one line, on this stage's replicas
    stage = PipelineStage(part, stage_index, 2, torch.device("cpu"), group=mesh.get_group("stage"))
    schedule = ScheduleGPipe(stage, args.microbatches, loss_fn=masked_loss)
    opt = torch.optim.Adam(part.parameters(), lr=args.lr)
    # Both stages of a replica draw the same batches (the first needs the
    # inputs, the last the targets).
    data = markov_corpus(args.vocab, args.seq, args.steps * args.batch_size, seed=100 + replica)
    mask_id = args.vocab
    dim = model.head.in_features
    start = time.perf_counter()
    recent = []
    for step in range(args.steps):
        ids = data[step * args.batch_size : (step + 1) * args.batch_size]
        mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(step * 97 + replica)) < 0.15
        opt.zero_grad()
        if stage_index == 0:
            schedule.step(ids.masked_fill(mask, mask_id))
        else:
            losses = []
            schedule.step(target=ids.masked_fill(~mask, IGNORE), losses=losses)
            recent = (recent + [sum(x.item() for x in losses) / len(losses)])[-25:]
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            mean = torch.tensor([sum(recent) / len(recent) if recent else 0.0])
            dist.all_reduce(mean)
            mean = mean.item() / 2  # the last stage's 2 replicas
            if rank == 0 and step % 50 == 0:
                print(f"step {step}: masked-token loss {mean:.3f} (mean of the last steps' micro-batches; uniform: {math.log(args.vocab):.3f})", flush=True)
    elapsed = time.perf_counter() - start
    # Per rank and step, in float32 bytes: a stage boundary carries the
    # activations forward and their gradients back; the replicas' ring
    # all-reduce of a stage sends 2(R-1)/R of its gradients.
    stage_bytes = args.batch_size * args.seq * dim * 4
    ring_bytes = 2 * (2 - 1) / 2 * numel * 4
    if state is None:
        replica_bytes = ring_bytes
    else:  # the sparse calls' own count, and the ring's for the warm-up and the steps that took gloo's allreduce
        sparse_steps = state.choice["steps"]["sparse"] if state.choice else args.steps - state.warmup_iters
        replica_bytes = (state.bytes_sent + (args.steps - sparse_steps) * ring_bytes) / args.steps
    figures = torch.tensor([replica_bytes, numel], dtype=torch.float64)
    gathered = [torch.zeros_like(figures) for _ in range(world)]
    dist.all_gather(gathered, figures)
    if rank == 0:
        mode = "dense" if state is None else "oktopk"
        per_stage = " ".join(f"stage{s}_replica_bytes_per_iter={gathered[2 * s][0].item():.0f}" for s in range(2))
        print(f"RESULT mode={mode} mesh=2x2 final_loss={mean:.3f} ms_per_iter={1000 * elapsed / args.steps:.1f} "
              f"stage_bytes_per_iter={stage_bytes} {per_stage}", flush=True)
    if state is not None:
        state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
