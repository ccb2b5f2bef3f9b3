"""The native path: the process group's own allreduce (gloo, NCCL, MPI), as
``allreduce_hook`` runs it. The dense warm-up takes it, and so does every
step the measured choice (``oktopk.choice``) gives to native; what the other
paths' residuals hold is folded in before it, by the engine (each path's
``fold``), so the switch loses nothing.
"""

import weakref

import torch
import torch.distributed as dist

from . import callbacks
from .peer_errors import value_of
from .paths import Path


class Native(Path):
    name = "native"

    def reduce(self, engine, bucket, tensor, step):
        """The process group's own allreduce of the bucket, averaged, as
        ``allreduce_hook`` runs it (the dense warm-up, and the native path)."""
        group = engine.process_group
        world = dist.get_world_size(group)
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def average(f):
            reduced = value_of(f, f"the native allreduce of step {step}")[0].div_(world)
            engine._folds.see(reduced)
            return reduced

        return callbacks.then(fut, average)

    def reduce_shard(self, engine, group_id, shard, step):
        """The replicate group's own allreduce, averaged, in place."""
        engine._folds.see(engine._collectives.allreduce_(shard))


PATH = Native()


class BucketGrads:
    """grads_as_bucket_views: points each parameter's ``.grad`` at its slice
    of the bucket (the values are the same: DDP copied the gradients in).
    DDP then finds ``.grad`` already holding the reduced slice and its copy
    back returns at once (ATen's copy_ skips a view of the same memory), as
    under ``gradient_as_bucket_view=True``. A parameter with no ``.grad``
    (unused, which DDP leaves so) or another layout is left alone.

    DDP built without ``gradient_as_bucket_view`` refuses a ``.grad`` that
    is a view of its bucket when the next backward accumulates into it (a
    script that zeroes to zeros, not None): a hook on each pointed
    parameter, run before its gradient is accumulated, gives it a copy of
    its own first. Zeroing to None (torch's default) leaves nothing to copy."""

    def __init__(self):
        self._pointed = {}  # id(param) -> (data_ptr of the slice it was pointed at, hook handle)

    def point(self, bucket):
        with torch.no_grad():
            for param, view in zip(bucket.parameters(), bucket.gradients()):
                grad = param.grad
                if (grad is None or grad.data_ptr() == view.data_ptr() or not grad.is_contiguous() or not param.is_contiguous()
                        or grad.shape != view.shape or grad.dtype != view.dtype or grad.device != view.device):
                    continue
                param.grad = view
                key = id(param)
                handle = self._pointed[key][1] if key in self._pointed else param.register_hook(self._unalias(weakref.ref(param)))
                self._pointed[key] = (view.data_ptr(), handle)

    def _unalias(self, param_ref):
        pointed = self._pointed

        def before_accumulation(grad):
            param = param_ref()
            if param is not None and param.grad is not None and param.grad.data_ptr() == pointed[id(param)][0]:
                param.grad = param.grad.clone()

        return before_accumulation

    def remove_hooks(self):
        for _, handle in self._pointed.values():
            handle.remove()
        self._pointed = {}
