"""torch's store during a communicator's setup (``oktopk.comm``): the
store the ranks meet through, and waits on it that end within the
communicator's timeout whatever the store does."""

import datetime
import threading

import torch.distributed as dist

from . import _lib
from ._lib import OkTopkError


def store_for(group):
    """The store oktopk keeps ``group``'s rendezvous keys in: the default
    process group's, under a prefix of the group's ranks."""
    store = dist.distributed_c10d._get_default_store()
    if group is None or group is dist.GroupMember.WORLD:
        name = "world"
    else:
        name = "g" + "-".join(map(str, dist.get_process_group_ranks(group)))
    return dist.PrefixStore(f"oktopk/{name}/", store)


def wait_for(store, keys, timeout, what, missing=None):
    """store.wait bounded by the communicator's timeout; a rank that died
    during setup becomes OkTopkError instead of a wait as long as the
    store's own (torchrun: 30 minutes)."""
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001 - DistStoreError, or the store is gone
        detail = ""
        if missing is not None:
            try:
                detail = f" (missing: {missing()})"
            except Exception:  # noqa: BLE001 - the store itself may be gone
                pass
        # torch's store raises DistStoreError when the wait times out, and
        # DistNetworkError when the store itself is gone (torch < 2.1 has
        # neither class: every failure counts as the remote's).
        timed_out = isinstance(e, getattr(dist, "DistStoreError", ())) and not isinstance(e, getattr(dist, "DistNetworkError", ()))
        code = _lib.TIMEOUT if timed_out else _lib.REMOTE_ERROR
        raise OkTopkError(code, f"communicator setup: {what} not in the store within {timeout:g} s{detail}; "
                                f"a rank died or never reached its first oktopk step: {e}") from e


# Seconds a store exchange may run past the communicator's timeout before
# it is abandoned: its own wait reports a missing rank first, by name.
STORE_GRACE = 2.0


def bounded(exchange, timeout, what):
    """``exchange()`` (store operations) on a helper thread, abandoned with
    OkTopkError (TIMEOUT) if it has not returned ``timeout`` + STORE_GRACE
    seconds later. Why: every store operation reads the store's answer
    under the timeout the store was made with (torchrun: 30 minutes), and
    a store.wait that times out still waits that long for the answer to
    its "stop waiting" when the store's host is stopped (SIGSTOP, a frozen
    node), whatever the wait's own timeout. The abandoned thread ends when
    the store answers or its own timeout passes; the job has lost a rank
    either way."""
    done = {}

    def run():
        try:
            done["value"] = exchange()
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            done["error"] = e

    thread = threading.Thread(target=run, name="oktopk-store", daemon=True)
    thread.start()
    thread.join(timeout + STORE_GRACE)
    if thread.is_alive():
        raise OkTopkError(_lib.TIMEOUT, f"communicator setup: {what}: the store did not answer within {timeout + STORE_GRACE:g} s; "
                                        f"the store's host (rank 0's) is stopped or unreachable")
    if "error" in done:
        raise done["error"]
    return done["value"]
