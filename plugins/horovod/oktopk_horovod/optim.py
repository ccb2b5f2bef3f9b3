"""oktopk's DeMo for Horovod jobs: the ranks connect through Horovod's own
collectives, and there is no gradient allreduce (no
``hvd.DistributedOptimizer``): the optimizer exchanges its own state.

>>> import horovod.torch as hvd
>>> import oktopk_horovod
>>> hvd.init()
>>> opt = oktopk_horovod.DeMo(model.parameters(), lr=3e-3, weight_decay=0.01)   # was hvd.DistributedOptimizer(AdamW(...))
>>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
"""

import oktopk

from .collectives import HorovodCollectives


def DeMo(params, **kwargs):
    """``oktopk.DeMo`` over every Horovod rank (its arguments but
    ``process_group``, ``communicator``, ``agreement`` and
    ``collectives``). Do not wrap it in ``hvd.DistributedOptimizer``: it
    exchanges its momentum itself."""
    for name in ("process_group", "communicator", "agreement", "collectives"):
        if name in kwargs:
            raise ValueError(f"oktopk_horovod.DeMo: {name} is set by Horovod, not by the caller")
    # Its collectives named apart from the optimizer's ("oktopk.optim.*").
    return oktopk.DeMo(params, collectives=HorovodCollectives("oktopk.optim"), **kwargs)
