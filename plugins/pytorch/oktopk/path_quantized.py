"""The QUANTIZED path (an Adam-family optimizer's choice, ``oktopk.choice``):
every value every step in 4 bits per block of 64, with error feedback
(``oktopk.quantized``), over the process group. Each group of parameters
(``oktopk.layout``) keeps its residuals in its own layout; before a native
step :func:`fold` (DDP) or :func:`fold_shard_` (FSDP2) moves what a group
holds into the values, so nothing waits. 16-bit buckets and shards go
native.
"""

import torch
import torch.distributed as dist

from . import path_native
from .layout import group_id_of
from .quantized import QuantizedGroup


def reduce(state, bucket, tensor, step):
    """The QUANTIZED path (an Adam-family optimizer's choice, oktopk.choice):
    each group of parameters (oktopk.layout) through oktopk.quantized in its
    own layout, with its residuals. A bucket that is one group is reduced
    as it is (in place when in the group's order); the buckets of DDP's
    provisional layout (a resumed run's first step) go through the layout's
    regrouping pool, each group reduced once all its parameters arrived, so
    a resumed run continues exactly. 16-bit buckets go native. The
    collectives run here, in the hook: DDP's own (the used-parameter map
    with find_unused_parameters) share the process group and must keep one
    order on every rank, which a thread of our own would not."""
    if tensor.dtype != torch.float32:
        return path_native.reduce(state, bucket, tensor, step)
    layout = state._layout
    members = layout.members(bucket)
    group_id = layout.learn_group([i for i, _, _ in members]) if state._hook_iters > 0 else group_id_of([i for i, _, _ in members])
    cuda = tensor.device.type == "cuda"
    fut = torch.futures.Future(devices=[tensor.device]) if cuda else torch.futures.Future()
    if group_id in layout.groups:
        where = {i: (a, b) for i, a, b in members}
        try:
            reduce_group(state, group_id, [(tensor,) + where[i] for i in layout.groups[group_id]])
            fut.set_result(tensor)
        except Exception as e:  # noqa: BLE001 - DDP raises it from the future
            layout.fail(e)
            if not fut.done():
                fut.set_exception(e)
        return fut
    layout.reduce_pooled(tensor, members, set(), fut, bucket.is_last(),
                         lambda pooled_id, pieces: reduce_group(state, pooled_id, [(t, a, b) for t, a, b, _ in pieces]))
    return fut


def reduce_group(state, group_id, pieces):
    """One group's quantized allreduce over ``pieces`` ((tensor, start,
    end) per parameter, in the group's order): in place when they are one
    tensor's consecutive values, else gathered and scattered back."""
    tensor = pieces[0][0]
    sizes = tuple(b - a for _, a, b in pieces)
    group = state._quantized.get(group_id)
    pg = state.process_group
    if group is None:
        group = state._quantized[group_id] = QuantizedGroup(state._layout.groups[group_id], sizes, dist.get_world_size(pg),
                                                            dist.get_rank(pg), tensor.device)
    group.to(tensor.device)
    in_place = all(t is tensor for t, _, _ in pieces) and all(pieces[k][2] == pieces[k + 1][1] for k in range(len(pieces) - 1))
    flat = tensor[pieces[0][1] : pieces[-1][2]] if in_place else torch.cat([t[a:b] for t, a, b in pieces])
    _allreduce(state, group_id, group, flat, state._layout.calls_undoable)
    if not in_place:
        at = 0
        for t, a, b in pieces:
            t[a:b].copy_(flat[at : at + b - a])
            at += b - a


def _allreduce(state, group_id, group, flat, undoable):
    """``group``'s quantized allreduce of ``flat``, recorded for the step
    (StepFolds): a NaN or Inf on any rank (every rank gets NaN, the
    residuals unchanged) makes the step void; a completed call, when
    ``undoable`` (the step has other groups, whose NaN could void it after
    all), is recorded with what takes it back: the residuals before it,
    which the call replaced rather than wrote over, kept until the next
    step settles."""
    before = (group.residual, group.owner_residual)
    sent, completed = group.allreduce_(flat, state.process_group)
    state._quantized_bytes += sent
    if not completed:
        state._folds.skipped()
    elif undoable:
        def take_back():
            if state._quantized.get(group_id) is group:  # not replaced by a load since
                group.residual, group.owner_residual = before

        state._folds.took(take_back)


def fold(state, bucket, tensor):
    """Before a native step after QUANTIZED ones: what each group holds
    (oktopk.quantized) joins its parameters' values in whichever bucket
    they arrive, so nothing waits."""
    members = state._layout.members(bucket)
    for group_id in {state._layout.group_of.get(i) for i, _, _ in members} & set(state._quantized):
        group = state._quantized.pop(group_id).to(tensor.device)
        state._folds.took(lambda group_id=group_id, group=group: give_back(state, group_id, group))
        held, at = group.held(), 0
        for i, size in zip(group.members, group.sizes):
            state._quantized_spill[i] = held[at : at + size]
            at += size
    if tensor.dtype != torch.float32:
        return
    for i, a, b in members:
        piece = state._quantized_spill.pop(i, None)
        if piece is not None:
            tensor[a:b] += piece


def give_back(state, group_id, group):
    """Undo :func:`fold`'s fold of one group (StepFolds): its residuals
    held again, none of them waiting to join a bucket."""
    state._quantized[group_id] = group
    for i in group.members:
        state._quantized_spill.pop(i, None)


# -- FSDP2: a module's shard is one group, reduced in place ----------------


def reduce_(state, group_id, shard, step):
    """The QUANTIZED path (an Adam-family optimizer's choice, oktopk.choice):
    the shard through oktopk.quantized over the replicas, in place, its
    residuals kept under the module's group id. A 16-bit shard goes native."""
    if shard.dtype != torch.float32 or not shard.is_contiguous():
        path_native.reduce_(state, group_id, shard, step)
        return
    pg = state.process_group
    group = state._quantized.get(group_id)
    if group is None:
        group = state._quantized[group_id] = QuantizedGroup((group_id,), (shard.numel(),), dist.get_world_size(pg), dist.get_rank(pg),
                                                            shard.device)
    _allreduce(state, group_id, group.to(shard.device), shard.view(-1), state._layout.calls_undoable)


def fold_shard_(state, group_id, shard):
    """:func:`fold` for an FSDP2 shard, before a native step: what the
    module's group holds joins the shard. Simpler than the bucket's fold:
    the shard is the whole group, so nothing spills over to wait for
    another bucket (and a 16-bit shard leaves the group held)."""
    if group_id in state._quantized and shard.dtype == torch.float32:
        group = state._quantized.pop(group_id).to(shard.device)
        state._folds.took(lambda: state._quantized.__setitem__(group_id, group))
        shard.view(-1).add_(group.held())
