"""oktopk.optim's optimizers for Horovod jobs: the ranks connect through
Horovod's own collectives, and there is no gradient allreduce (no
``hvd.DistributedOptimizer``): the optimizer exchanges its own state.

>>> import horovod.torch as hvd
>>> import oktopk_horovod
>>> hvd.init()
>>> opt = oktopk_horovod.DeMo(model.parameters(), lr=3e-3, weight_decay=0.01)   # was hvd.DistributedOptimizer(AdamW(...))
>>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
"""

import horovod.torch as hvd
from oktopk.comm import Communicator
from oktopk.optim import DeMo as _DeMo

from .optimizer import _default_bind_host, horovod_agreement


def _horovod_communicator(density, timeout):
    """A communicator over every Horovod rank, with the Ok-Topk algorithm,
    its endpoints exchanged through Horovod's collectives (every rank at
    the same point: the optimizer's first step)."""
    return Communicator.from_exchange(
        hvd.rank(),
        hvd.size(),
        lambda token: hvd.broadcast_object(token, root_rank=0, name="oktopk.optim.token"),
        lambda endpoint: hvd.allgather_object(endpoint, name="oktopk.optim.endpoints"),
        "oktopk",
        density,
        timeout=timeout,
        bind_host=_default_bind_host(),
    )


def DeMo(params, **kwargs):
    """``oktopk.optim.DeMo`` over every Horovod rank (its arguments but
    ``process_group`` and ``communicator``). Do not wrap it in
    ``hvd.DistributedOptimizer``: it exchanges its momentum itself."""
    for name in ("process_group", "communicator", "agreement"):
        if name in kwargs:
            raise ValueError(f"oktopk_horovod.DeMo: {name} is set by Horovod, not by the caller")
    return _DeMo(params, communicator=_horovod_communicator, agreement=horovod_agreement("oktopk.optim.settings"), **kwargs)
