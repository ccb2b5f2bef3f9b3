"""The DDP communication hook: an adapter that hands each bucket to the
state's engine (``oktopk.engine``), which reduces it by the step's path: the
dense warm-up, then the measured choice's path, or the named algorithm's
sparse one.
"""

import torch
import torch.distributed as dist

from .state import OkTopkState


def oktopk_hook(state: OkTopkState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the average of the bucket's gradients over the
    ranks, sparsified by ``state.algorithm`` at ``state.density``.

    Example::

        >>> state = OkTopkState(density=0.01)
        >>> ddp_model.register_comm_hook(state, oktopk_hook)
    """
    return state.reduce_bucket(bucket)
