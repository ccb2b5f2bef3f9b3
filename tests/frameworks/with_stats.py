"""with_stats.py SCRIPT ARGS...: run a framework example unchanged, as
``python SCRIPT ARGS...`` would, then write this rank's view of oktopk to
$FW_STATS/rank{RANK}.json for the tests: each DistributedDataParallel
module's comm hooks, and each OkTopkState's statistics (bytes the library
sent, the 4-bit path's, the measured choice), and under the launcher
what ``oktopk.autohook.registered`` holds. The objects are found by the
garbage collector's list, so the example needs no line for the test, under
the launcher or with its own registration alike."""

import atexit
import gc
import json
import os
import runpy
import sys


def write():
    import warnings

    warnings.simplefilter("ignore")  # isinstance over every object touches deprecated module attributes
    from torch.nn.parallel import DistributedDataParallel as DDP

    from oktopk import OkTopkState

    modules, states = [], []
    for o in gc.get_objects():
        if isinstance(o, DDP):
            modules.append([f"{getattr(h, '__module__', '')}.{getattr(h, '__qualname__', '')}" for h, _ in getattr(o, "_comm_hooks", [])])
        elif isinstance(o, OkTopkState):
            states.append({"bytes_sent": o.bytes_sent, "quantized_bytes_sent": o.quantized_bytes_sent,
                           "choice": o.choice, "momentum_status": o.momentum_status, "repr": repr(o)})
    # Under the launcher: what oktopk.autohook registered, (module, state)
    # pairs. Each rank runs `python -m oktopk.autohook`, so the module is
    # __main__ there (and oktopk.autohook only if something imported it).
    found = {id(m): m for m in (sys.modules.get("oktopk.autohook"), sys.modules.get("__main__"))
             if m is not None and hasattr(m, "registered") and hasattr(m, "install")}
    registered = [{"module": type(m.module).__name__, "bytes_sent": s.bytes_sent}
                  for autohook in found.values() for m, s in autohook.registered]
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(os.environ["FW_STATS"], f"rank{rank}.json"), "w") as f:
        json.dump({"ddp_hooks": modules, "states": states, "autohook_registered": registered}, f, default=str)


def one_line_defaults():
    """FW_ONE_LINE (JSON): OkTopkState keywords that the example's own
    OkTopkState(...) takes unless it names them. The tests run a few steps;
    the one line's early 4-bit steps (sparse_after, 100 by default) would
    outlast them, so the tests that exercise the sparse path under a
    framework give sparse_after=0 here (and OKTOPK_SPARSE_AFTER=0 to the
    launcher), and the example stays as it is."""
    defaults = json.loads(os.environ.get("FW_ONE_LINE") or "{}")
    if not defaults:
        return
    from oktopk import state

    init = state.OkTopkState.__init__

    def with_defaults(self, *args, **kwargs):
        init(self, *args, **{**defaults, **kwargs})

    state.OkTopkState.__init__ = with_defaults


one_line_defaults()
script = os.path.abspath(sys.argv[1])
sys.argv = [script] + sys.argv[2:]
sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it
atexit.register(write)
globals_ = runpy.run_path(script, run_name="__main__")  # kept: the script's objects stay alive until write()
