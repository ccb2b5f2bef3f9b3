"""The ways to reduce a bucket, by the name the measured choice gives each
(``oktopk.choice``): one module per way, one line per module in
:data:`PATHS`. The DDP hook (``oktopk.hook``) and the FSDP2 registration
(``oktopk.fsdp``) look the step's path up here rather than each carrying
its own copy.

Every path module has the same two entry points:

``reduce(state, bucket, tensor, step) -> torch.futures.Future``
    DDP: the average over the ranks of ``tensor`` (``bucket.buffer()``,
    this rank's undivided gradients), written into it; the future DDP
    waits on. ``step`` is ``state.iter`` when the step's buckets fired.

``reduce_(state, group_id, shard, step)``
    FSDP2: the module's gradient shard (its residuals kept under
    ``group_id``) replaced, in place, by its average over the replicas.

Where a path keeps residuals, its module also has the fold that moves them
into the values before a native step (``fold`` for a DDP bucket,
``fold_shard_`` for a shard); the front ends call those before NATIVE's
``reduce``. The Horovod optimizer reduces with Horovod's own collectives
and shares the sparse path's device-path bookkeeping (``path_sparse``).
"""

import torch

from . import path_bf16, path_native, path_quantized, path_sparse
from .choice import BF16, NATIVE, QUANTIZED, SPARSE
from .choice import PATHS as NAMES
from .settings import NATIVE_WARMUP_ITERS

# The bucket dtypes liboktopk reduces; the dense warm-up would take others,
# so they are refused on the first hook call rather than at the first sparse
# step.
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

PATHS = {
    NATIVE: path_native,
    BF16: path_bf16,
    QUANTIZED: path_quantized,
    SPARSE: path_sparse,
}

# Every path the measured choice can take has its module.
assert set(PATHS) == set(NAMES), (sorted(PATHS), sorted(NAMES))


def warmup_path(state, step):
    """The path of warm-up step ``step`` (``step < state.warmup_iters``):
    native, or from DDP's third iteration on ``state.warmup_compression``
    when set (the first two learn the bucket layout the residuals are kept
    in, so they stay native)."""
    if state.warmup_compression is None or step < NATIVE_WARMUP_ITERS:
        return NATIVE
    return state.warmup_compression


def timed_warmup_step(state):
    """The warm-up step the measured choice times as native, to compare the
    sparse probe with: the last one that is native."""
    return (state.warmup_iters if state.warmup_compression is None else NATIVE_WARMUP_ITERS) - 1

