"""Ok-Topk as a PyTorch DDP communication hook.

Example::

    >>> from oktopk import OkTopkState, oktopk_hook
    >>> state = OkTopkState(process_group=None, density=0.01)
    >>> ddp_model.register_comm_hook(state, oktopk_hook)

The hook receives each bucket of this rank's (undivided) gradients and
returns a future of their average over the ranks, like PyTorch's
``allreduce_hook``, but only about ``density`` of the entries travel; the
rest wait in a per-bucket residual (error feedback).

This module is where both are imported from; they live in ``state.py``
(``OkTopkState``, whose pickles still name this module, an
``oktopk.engine.Engine``: the one owner of a step) and ``hook.py``
(``oktopk_hook``, the adapter that hands it each bucket), and the ways a
bucket is reduced in ``paths.py`` and its ``path_*.py`` modules (see
docs/architecture.md).
"""

from .hook import oktopk_hook
from .path_native import BucketGrads
from .paths import SUPPORTED_DTYPES
from .state import OkTopkState
from .step import agree_on_settings, agreement_settings

# The names these helpers had here before they moved, for code that
# imported them from this module.
from .path_sparse import call_for as _call
from .path_sparse import reduce_on_device as _reduce_on_device
from .path_sparse import start as _start
from .path_sparse import takes_device_path as _takes_device_path
from .step import begin_step as _begin_step

# Every name above, the old private ones included (so that linters count
# them as used).
__all__ = ["BucketGrads", "OkTopkState", "SUPPORTED_DTYPES", "agree_on_settings", "agreement_settings", "oktopk_hook",
           "_begin_step", "_call", "_reduce_on_device", "_start", "_takes_device_path"]
