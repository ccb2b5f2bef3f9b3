"""Python callbacks on a process group's futures (``Future.then``), counted
until they are freed, and waited for at exit.

Why: the backend's own thread runs such a callback (gloo's worker, when
its allreduce completes), marks the future ``then`` returned as done, and
only then takes the GIL once more to release the callable. DDP's step
waits on that future, so a script that ends right after its last step can
reach interpreter finalization before the release. The backend thread's
request for the GIL then ends the thread (``pthread_exit``) through C++
frames that allow no unwinding, and the whole process aborts ("terminate
called without an active exception"): a run that finished, reported as a
crash. Seen here on 1 in 6 runs of a 10-step script on 2 loaded cores
whose last steps were native after a 4-bit probe (two chained callbacks).

So each callback is counted while it lives (a ``weakref.finalize`` on the
function, run by the release itself), and an ``atexit`` hook, which runs
before finalization while threads may still take the GIL, sleeps (the GIL
released) until none is left, for at most ``DRAIN_SECONDS``.
"""

import atexit
import threading
import time
import weakref

DRAIN_SECONDS = 2.0  # the longest exit waits for the backend's threads to release their callbacks

_lock = threading.Lock()
_alive = 0


def _released():
    global _alive
    with _lock:
        _alive -= 1


def then(fut, fn):
    """``fut.then(fn)``, ``fn`` counted until the backend releases it."""
    global _alive
    with _lock:
        _alive += 1
    done = weakref.finalize(fn, _released)
    done.atexit = False  # counted by its release, not by weakref's own exit hook
    return fut.then(fn)


def alive():
    """Callbacks handed to a backend and not yet released."""
    return _alive


@atexit.register
def _drain():
    deadline = time.monotonic() + DRAIN_SECONDS
    while _alive > 0 and time.monotonic() < deadline:
        time.sleep(0.001)
