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
    native, or, with ``state.warmup_compression`` set, compressed on every
    step but DDP's second. DDP's first runs in its provisional bucket layout,
    where no residual can be kept: it goes in bfloat16, which keeps none
    (``bf16_compress_hook``'s rounding, half the bytes). Its second learns
    the rebuilt layout the residuals are kept in and is the native step the
    measured choice times (``timed_warmup_step``), so it stays native. From
    the third on, the warm-up takes ``state.warmup_compression``."""
    if state.warmup_compression is None or step == NATIVE_WARMUP_ITERS - 1:
        return NATIVE
    if step < NATIVE_WARMUP_ITERS:
        return BF16
    return state.warmup_compression


def timed_warmup_step(state):
    """The warm-up step the measured choice times as native, to compare the
    sparse probe with: the last one that is native."""
    return (state.warmup_iters if state.warmup_compression is None else NATIVE_WARMUP_ITERS) - 1

