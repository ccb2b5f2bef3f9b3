"""A process group's collective failing, named as the library names its own
failures: an ``OkTopkError`` that says which of the step's collectives
failed, what a closed connection can mean, and the process group's own
words. The engine's paths, its collectives and the 4-bit path's owners
call the process group (gloo, NCCL, MPI) through these.
"""

import contextlib

import torch.distributed as dist

from . import _lib


def peer_failure(err, what):
    """``err``, raised by a process group's collective, as an ``OkTopkError``
    that names ``what`` failed; None when ``err`` is not the process group's
    transport failing (a programming error passes through as it is).

    Why: when one of three or more ranks stops, gloo fails the others in
    different words. The first survivor whose wait ends at the process
    group's timeout says it timed out, and closes its connections; the next
    one then reads "Connection closed by peer", which names neither the
    stop nor the timeout. The error says both causes a closed connection
    has, and keeps gloo's (or NCCL's) own words."""
    if isinstance(err, _lib.OkTopkError):
        return None
    message = str(err)
    dist_error = getattr(dist, "DistError", None)
    if not ((dist_error is not None and isinstance(err, dist_error)) or "gloo" in message.lower()):
        return None
    code = _lib.TIMEOUT if "timed out" in message.lower() or "timeout" in message.lower() else _lib.REMOTE_ERROR
    return _lib.OkTopkError(code, f"oktopk: {_lib.result_name(code)}: {what} over the process group failed: {message.strip()} "
                                  "(a rank closes its connections when it dies, or when its own wait for a stopped or slow rank "
                                  "ends at the process group's timeout; the other ranks' errors say which)")


@contextlib.contextmanager
def peer_failures_named(what):
    """Re-raise a process group's failure inside the block as
    :func:`peer_failure` names it."""
    try:
        yield
    except RuntimeError as err:
        named = peer_failure(err, what)
        if named is None:
            raise
        raise named from err


def value_of(future, what):
    """``future.value()`` of a process group's collective, its failure named
    by :func:`peer_failure` (for the callbacks of DDP's futures)."""
    with peer_failures_named(what):
        return future.value()
