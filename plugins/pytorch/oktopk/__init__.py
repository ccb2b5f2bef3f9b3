"""oktopk: Ok-Topk sparse allreduce for PyTorch (DDP communication hook).

>>> from oktopk import OkTopkState, oktopk_hook
>>> ddp_model.register_comm_hook(OkTopkState(density=0.01), oktopk_hook)
"""

from . import _lib
from ._lib import OkTopkError, library_path, library_version
from .collectives import Collectives, ProcessGroupCollectives
from .comm import Communicator, route_source_address
from .ddp import OkTopkState, oktopk_hook
from .engine import Engine
from .settings import Adaptation, Choice, Faults, Momentum, Settings, Warmup, Wire

__all__ = ["ALGORITHMS", "Adaptation", "Choice", "Collectives", "Communicator", "DeMo", "Engine", "Faults", "Momentum", "OkTopkError", "OkTopkState",
           "ProcessGroupCollectives", "Settings", "Warmup", "Wire", "library_path", "library_version", "oktopk_hook",
           "route_source_address"]


def __getattr__(name):
    # ALGORITHMS, the names the library knows ("auto" included), comes from
    # the library itself, loaded when first asked for.
    if name == "ALGORITHMS":
        return _lib.algorithms()
    # DeMo (oktopk.optim.DeMo: the optimizer that exchanges its own
    # momentum), imported when first asked for: a gradient hook's job
    # never loads its transform.
    if name == "DeMo":
        from .optim import DeMo

        return DeMo
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
