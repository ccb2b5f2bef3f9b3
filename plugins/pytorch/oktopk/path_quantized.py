"""The quantized path (an Adam-family optimizer's choice, ``oktopk.choice``):
every value every step in 4 bits per block of 32, with error feedback
(``oktopk.quantized``), over the process group. Each group of parameters
(``oktopk.layout``) keeps its residuals in its own layout; before a step of
another path its ``fold`` (DDP) or ``fold_shard`` (FSDP2) moves what a group
holds into the values, so nothing waits. 16-bit buckets and shards go
native.
"""

import torch
import torch.distributed as dist

from . import path_native
from .layout import group_id_of
from .paths import Path
from .quantized import QuantizedGroup


def reduce_group(engine, group_id, pieces):
    """One group's quantized allreduce over ``pieces`` ((tensor, start,
    end) per parameter, in the group's order): in place when they are one
    tensor's consecutive values, else gathered and scattered back."""
    tensor = pieces[0][0]
    sizes = tuple(b - a for _, a, b in pieces)
    group = engine._quantized.get(group_id)
    pg = engine.process_group
    if group is None:
        group = engine._quantized[group_id] = QuantizedGroup(engine._layout.groups[group_id], sizes, dist.get_world_size(pg),
                                                            dist.get_rank(pg), tensor.device)
    group.to(tensor.device)
    in_place = all(t is tensor for t, _, _ in pieces) and all(pieces[k][2] == pieces[k + 1][1] for k in range(len(pieces) - 1))
    flat = tensor[pieces[0][1] : pieces[-1][2]] if in_place else torch.cat([t[a:b] for t, a, b in pieces])
    _allreduce(engine, group_id, group, flat, engine._layout.calls_undoable)
    if not in_place:
        at = 0
        for t, a, b in pieces:
            t[a:b].copy_(flat[at : at + b - a])
            at += b - a


def _allreduce(engine, group_id, group, flat, undoable):
    """``group``'s quantized allreduce of ``flat``, recorded for the step
    (StepFolds): a NaN or Inf on any rank (every rank gets NaN, the
    residuals unchanged) makes the step void; a completed call, when
    ``undoable`` (the step has other groups, whose NaN could void it after
    all), is recorded with what takes it back: the residuals before it,
    which the call replaced rather than wrote over, kept until the next
    step settles."""
    before = (group.residual, group.owner_residual)
    sent, completed = group.allreduce_(flat, engine.process_group)
    engine._quantized_bytes += sent
    if not completed:
        engine._folds.skipped()
    elif undoable:
        def take_back():
            if engine._quantized.get(group_id) is group:  # not replaced by a load since
                group.residual, group.owner_residual = before

        engine._folds.took(take_back)


def give_back(engine, group_id, group):
    """Undo :func:`fold`'s fold of one group (StepFolds): its residuals
    held again, none of them waiting to join a bucket."""
    engine._quantized[group_id] = group
    for i in group.members:
        engine._quantized_spill.pop(i, None)


class Quantized(Path):
    name = "quantized"
    compresses_dense = True
    keeps_residual = True
    described = "quantized with error feedback (oktopk.quantized)"

    def holds(self, engine):
        return bool(engine._quantized or engine._quantized_spill)

    def reduce(self, engine, bucket, tensor, step):
        """Each group of parameters (oktopk.layout) through oktopk.quantized in its
        own layout, with its residuals. A bucket that is one group is reduced
        as it is (in place when in the group's order); the buckets of DDP's
        provisional layout (a resumed run's first step) go through the layout's
        regrouping pool, each group reduced once all its parameters arrived, so
        a resumed run continues exactly. 16-bit buckets go native. The
        collectives run here, in the hook: DDP's own (the used-parameter map
        with find_unused_parameters) share the process group and must keep one
        order on every rank, which a thread of our own would not."""
        if tensor.dtype != torch.float32:
            return path_native.PATH.reduce(engine, bucket, tensor, step)
        layout = engine._layout
        members = layout.members(bucket)
        group_id = layout.learn_group([i for i, _, _ in members]) if engine._hook_iters > 0 else group_id_of([i for i, _, _ in members])
        cuda = tensor.device.type == "cuda"
        fut = torch.futures.Future(devices=[tensor.device]) if cuda else torch.futures.Future()
        if group_id in layout.groups:
            where = {i: (a, b) for i, a, b in members}
            try:
                reduce_group(engine, group_id, [(tensor,) + where[i] for i in layout.groups[group_id]])
                fut.set_result(tensor)
            except Exception as e:  # noqa: BLE001 - DDP raises it from the future
                layout.fail(e)
                if not fut.done():
                    fut.set_exception(e)
            return fut
        layout.reduce_pooled(tensor, members, set(), fut, bucket.is_last(),
                             lambda pooled_id, pieces: reduce_group(engine, pooled_id, [(t, a, b) for t, a, b, _ in pieces]))
        return fut

    def reduce_shard(self, engine, group_id, shard, step):
        """The shard through oktopk.quantized over the replicas, in place, its
        residuals kept under the module's group id. A 16-bit shard goes native."""
        if shard.dtype != torch.float32 or not shard.is_contiguous():
            path_native.PATH.reduce_shard(engine, group_id, shard, step)
            return
        pg = engine.process_group
        group = engine._quantized.get(group_id)
        if group is None:
            group = engine._quantized[group_id] = QuantizedGroup((group_id,), (shard.numel(),), dist.get_world_size(pg), dist.get_rank(pg),
                                                                shard.device)
        _allreduce(engine, group_id, group.to(shard.device), shard.view(-1), engine._layout.calls_undoable)

    def fold(self, engine, bucket, tensor, step):
        """Before a step of another path: what each group holds
        (oktopk.quantized) joins its parameters' values in whichever bucket
        they arrive, so nothing waits."""
        members = engine._layout.members(bucket)
        for group_id in {engine._layout.group_of.get(i) for i, _, _ in members} & set(engine._quantized):
            group = engine._quantized.pop(group_id).to(tensor.device)
            engine._folds.took(lambda group_id=group_id, group=group: give_back(engine, group_id, group))
            held, at = group.held(), 0
            for i, size in zip(group.members, group.sizes):
                engine._quantized_spill[i] = held[at : at + size]
                at += size
        if tensor.dtype != torch.float32:
            return None
        for i, a, b in members:
            piece = engine._quantized_spill.pop(i, None)
            if piece is not None:
                tensor[a:b] += piece
        return None

    def fold_shard(self, engine, group_id, shard):
        """:meth:`fold` for an FSDP2 shard: what the
        module's group holds joins the shard. Simpler than the bucket's fold:
        the shard is the whole group, so nothing spills over to wait for
        another bucket (and a 16-bit shard leaves the group held)."""
        if group_id in engine._quantized and shard.dtype == torch.float32:
            group = engine._quantized.pop(group_id).to(shard.device)
            engine._folds.took(lambda: engine._quantized.__setitem__(group_id, group))
            shard.view(-1).add_(group.held())


PATH = Quantized()
