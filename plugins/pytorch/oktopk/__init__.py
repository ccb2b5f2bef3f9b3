"""oktopk: Ok-Topk sparse allreduce for PyTorch (DDP communication hook).

>>> from oktopk import OkTopkState, oktopk_hook
>>> ddp_model.register_comm_hook(OkTopkState(density=0.01), oktopk_hook)
"""

from ._lib import ALGORITHMS, OkTopkError, library_path, library_version
from .comm import Communicator
from .ddp import OkTopkState, oktopk_hook

__all__ = ["ALGORITHMS", "Communicator", "OkTopkError", "OkTopkState", "library_path", "library_version", "oktopk_hook"]
