"""oktopk for Horovod: Ok-Topk sparse allreduce switched on by a compression
choice, the way Horovod users switch on fp16.

>>> import horovod.torch as hvd
>>> from oktopk_horovod import Compression, DistributedOptimizer
>>> compression = Compression.oktopk(density=0.01) if args.oktopk else Compression.none
>>> optimizer = DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
...                                  compression=compression)

Horovod's own ``compression=`` compresses a tensor that Horovod then
allreduces densely, so a sparse exchange needs its own optimizer:
``oktopk_horovod.DistributedOptimizer`` takes ``hvd.DistributedOptimizer``'s
arguments, sends gradients through liboktopk when given an oktopk compressor
and hands everything else to ``hvd.DistributedOptimizer``. Passing the
oktopk compressor to plain ``hvd.DistributedOptimizer`` fails at the first
backward with a message saying so; it never falls back to a dense exchange.

``oktopk_horovod.DeMo`` is ``oktopk.DeMo`` over Horovod's ranks, in
place of ``hvd.DistributedOptimizer``: it exchanges its momentum itself.
"""

import oktopk
from oktopk import OkTopkError

from . import elastic
from .compression import Compression, OkTopkCompressor
from .optim import DeMo
from .optimizer import DistributedOptimizer

__all__ = ["ALGORITHMS", "Compression", "DeMo", "DistributedOptimizer", "OkTopkCompressor", "OkTopkError", "elastic"]


def __getattr__(name):
    # The library's algorithm names, read from it when first asked for.
    if name == "ALGORITHMS":
        return oktopk.ALGORITHMS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
