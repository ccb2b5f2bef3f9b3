"""The DDP communication hook: each bucket of one step takes the step's
path (``oktopk.paths``): the dense warm-up, then the measured choice's
path, or the named algorithm's sparse one.

The hook numbers each bucket's parameters, reduces the dense warm-up with
torch.distributed, folds what earlier steps left in the residuals into a
native step's buckets, and hands every other bucket to its path's module.
"""

import torch
import torch.distributed as dist

from . import path_native, path_quantized, path_sparse
from .choice import BF16, NATIVE, QUANTIZED
from .paths import PATHS, SUPPORTED_DTYPES, timed_warmup_step, warmup_path
from .settings import NATIVE_WARMUP_ITERS
from .state import OkTopkState
from .step import agree_on_settings, begin_step


def oktopk_hook(state: OkTopkState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the average of the bucket's gradients over the
    ranks, sparsified by ``state.algorithm`` at ``state.density``.

    Example::

        >>> state = OkTopkState(density=0.01)
        >>> ddp_model.register_comm_hook(state, oktopk_hook)
    """
    tensor = bucket.buffer()
    if tensor.dtype not in SUPPORTED_DTYPES or tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"oktopk_hook: unsupported bucket of {tensor.dtype} on {tensor.device.type}; "
            "liboktopk reduces float32, float16 and bfloat16 gradients on CPU or CUDA"
        )
    correction = state._momentum
    if bucket.index() == 0:
        # Before anything of this step reads a residual or a velocity: a
        # step before that came back non-finite anywhere (a NaN in one
        # group skipped it on every rank, and the script skipped the
        # optimizer step) gives back what its other groups' calls, folds
        # and velocity steps took, on every rank alike (StepFolds).
        state._folds.settle()
        if correction is not None:
            correction.record_step(state._folds)
        if state._agreement_steps:
            agree_on_settings(state, tensor.device)
        _begin(state, tensor)
        if correction is not None and correction.active:
            correction.begin_step(idle=_native_with_nothing_held(state))
    if correction is None or not correction.active or correction.idle:
        return _reduce(state, bucket, tensor)
    # Momentum correction (oktopk.momentum): every path below reduces the
    # velocity's step in place of the gradient, and the optimizer gets the
    # G on which its own momentum lands on the average.
    work = correction.before(bucket.parameters(), state._layout.members(bucket), tensor)
    fut = _reduce(state, bucket, tensor)
    if work is None:
        return fut

    def finish(f):
        try:
            reduced = f.value()
        except BaseException:
            # A failed step (a dead or silent peer) raises; the buckets of it
            # that completed before must not have moved a velocity either.
            correction.give_back_step()
            raise
        return correction.after(work, reduced)

    return fut.then(finish)


def _begin(state, tensor):
    """At a step's first bucket, before anything of the step is reduced:
    the measured choice's path of the step (timing the one before)."""
    if state._choice is None:
        return
    s = state.iter  # the step's: the last bucket advances it
    if s >= state.warmup_iters:
        # The step before was settled at this bucket's start (oktopk_hook).
        begin_step(state, s - state.warmup_iters, tensor.device, untimed=state._hook_iters == 0)
        state._folds.watching = state._path == NATIVE and bool(state._residual_groups or state._quantized or state._quantized_spill)
    elif s == timed_warmup_step(state):
        # A native step the choice can compare the sparse probe with.
        # A process resumed from a checkpoint saved before it runs it
        # first, in DDP's provisional layout (dense all the same): timed
        # too, or the resumed run would decide without it where the
        # whole run did not.
        state._choice.time_warmup_step()
    elif s == timed_warmup_step(state) + 1:
        state._choice.end_warmup_step()  # a compressed warm-up's step follows it


def _native_with_nothing_held(state):
    """Whether every bucket of the step about to begin goes native with no
    residual held anywhere: a dense step whose average is the gradients'
    average and nothing else. The momentum correction then has nothing to
    move (at density 1 it is the optimizer's own momentum) and hands the
    gradient through, so a native step costs what torch's allreduce_hook
    does (oktopk.momentum, MomentumCorrection.begin_step)."""
    s = state.iter
    path = warmup_path(state, s) if s < state.warmup_iters else state._path
    return path == NATIVE and not (state._residual_groups or state._quantized or state._quantized_spill)


def _reduce(state, bucket, tensor):
    """oktopk_hook's future of the bucket's average, by the step's path."""
    is_last = bucket.is_last()
    # Every bucket of one iteration is in the same phase: they were all
    # fired with the same state.iter, which the last one advances.
    phase_iter = state.iter
    rebuilt = state._hook_iters > 0  # not DDP's first, provisional, layout
    if state._hook_iters < 2:  # the provisional layout and the rebuilt one: every parameter
        state._optimizers.watch(bucket.parameters())
    if is_last:
        state.iter += 1
        state._hook_iters += 1
    layout = state._layout
    sparse = phase_iter >= state.warmup_iters
    if not sparse:
        path = warmup_path(state, phase_iter)
        if path == NATIVE or phase_iter < NATIVE_WARMUP_ITERS:
            # DDP's two layouts (or a native warm-up); the rebuilt layout's
            # buckets become the groups the residuals are kept in.
            members = layout.members(bucket)  # numbers the parameters in the first layout
            layout.take_unused(members, None)  # resets the marks of parameters DDP found unused
            if rebuilt:
                layout.learn_group([i for i, _, _ in members])
        return PATHS[path].reduce(state, bucket, tensor, phase_iter)
    if state._path == NATIVE:
        return _native(state, bucket, tensor, phase_iter, is_last)
    if state._path != QUANTIZED and (state._quantized or state._quantized_spill):
        # What a quantized warm-up left in its residuals joins the values
        # first, so nothing waits there.
        path_quantized.fold(state, bucket, tensor)
    elif state._path == BF16 and state.grads_as_bucket_views:
        state._bucket_grads.point(bucket)  # no sparse step ran: nothing to fold
    return PATHS[state._path].reduce(state, bucket, tensor, phase_iter)


def _native(state, bucket, tensor, step, is_last):
    """A bucket of a native step after the warm-up: what the other paths'
    steps left in the residuals joins it first, so the switch loses
    nothing."""
    if state._quantized or state._quantized_spill:
        path_quantized.fold(state, bucket, tensor)
    layout = state._layout
    if not layout.watching and not state._residual_groups:
        # Native chosen, nothing to fold: allreduce_hook's work and no more.
        if state.grads_as_bucket_views:
            state._bucket_grads.point(bucket)
        return path_native.reduce(state, bucket, tensor, step)
    members = layout.members(bucket)
    unused = layout.take_unused(members, tensor)
    group_id = layout.learn_group([i for i, _, _ in members])
    if group_id in layout.groups:
        path_sparse.fold(state, group_id, tensor, layout.slices(group_id, members, unused))
        if is_last and state._pooled_iter == step:
            # Buckets of this step that went through the regrouping
            # pool (below) complete their groups.
            state._reducer.submit(path_sparse.flush_pool, state, path_sparse.call_for(state, step))
        return path_native.reduce(state, bucket, tensor, step)
    if not any(layout.group_of.get(i) in state._residual_groups for i, _, _ in members):
        # Not one group, but none of its groups holds a residual: the
        # native allreduce has nothing to fold.
        return path_native.reduce(state, bucket, tensor, step)
    # A bucket that is not one group (a resumed run's first step, in DDP's
    # provisional layout) whose groups hold residuals.
    return _native_pooled(state, bucket, tensor, members, unused)


def _native_pooled(state, bucket, tensor, members, unused):
    """A native step's bucket in DDP's provisional layout (a resumed run's
    first step) whose groups hold residuals: its parameters wait in the
    layout's pool until each of their groups is complete; each complete
    group is gathered in its own layout, its residual folded in, and
    allreduced as the uninterrupted run's bucket of that group was (the
    same values in the same order). The allreduces run here, in the hook,
    so every rank issues them in the same order, as the QUANTIZED path's."""
    group, world = state.process_group, dist.get_world_size(state.process_group)
    fut = torch.futures.Future(devices=[tensor.device]) if tensor.device.type == "cuda" else torch.futures.Future()

    def reduce_group(group_id, pieces):
        flat = torch.cat([t[a:b] for t, a, b, _ in pieces])
        slices, at = [], 0
        for _, a, b, held in pieces:
            slices.append((at, at + b - a, held))
            at += b - a
        path_sparse.fold(state, group_id, flat, slices)
        dist.all_reduce(flat, group=group)
        state._folds.see(flat.div_(world))
        path_sparse.write_back([(t, a, b) for t, a, b, _ in pieces], flat)

    state._layout.reduce_pooled(tensor, members, unused, fut, bucket.is_last(), reduce_group)
    return fut
