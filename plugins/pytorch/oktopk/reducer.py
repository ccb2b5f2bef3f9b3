"""What the DDP hook (``oktopk.ddp``) and the Horovod optimizer
(``oktopk_horovod``) share below their own bookkeeping of buckets: one
communicator and the one worker thread that makes every library call on it,
the staging memory those calls reuse, their statistics, the adaptive control
they feed, and what a step the library skipped for a non-finite gradient
becomes (NaN on every rank).

Why one worker thread: the library takes one call at a time per
communicator, and every rank must make the same calls in the same order.
The front ends submit buckets in an order every rank agrees on, and the one
thread keeps it; the calls release the GIL, so backward goes on meanwhile.
"""

import concurrent.futures
import threading

import torch

from . import _lib
from ._lib import OkTopkError
from .adaptive import AdaptiveControl, check_adaptive
from .comm import XiTally


class Reducer:
    """A communicator's worker thread, staging memory and statistics.

    ``adaptive`` is the :class:`oktopk.adaptive.AdaptiveControl` the calls
    feed (or None). The statistics (``bytes_sent``, ``bytes_received``,
    ``comm_seconds``, ``algorithm_counts``, ``last_k`` per tensor id,
    ``last_xi`` and ``last_xi_step``) are written by the worker thread under
    ``lock``."""

    def __init__(self, adaptive=None):
        self.comm = None
        self.worker = None
        self.adaptive = adaptive
        self.lock = threading.Lock()
        # Staging memory (worker thread only), one per kind (pinned or not),
        # grown to the largest tensor and reused by every call.
        self.staging = {}
        self.bytes_sent = 0
        self.bytes_received = 0
        self.comm_seconds = 0.0
        # Library calls per algorithm that ran (with "auto", what it chose
        # for each tensor and step), e.g. {"oktopk": 120, "dense_ring": 40}.
        self.algorithm_counts = {}
        self.last_k = {}
        self.last_xi = None
        self.last_xi_step = None
        self._xi = XiTally()
        # Bytes copied between host and device by the sparse calls (staging a
        # CUDA bucket whole, or the device path's pairs), and per call
        # counted.
        self.host_device_bytes = 0
        self.host_device_calls = 0
        # The device path's pairs per call summed: selected and result.
        self.host_device_pairs = 0

    # -- lifecycle -----------------------------------------------------------

    def start(self, comm):
        """Take ``comm`` (a :class:`oktopk.Communicator`) and start the worker
        thread that will make its calls."""
        self.comm = comm
        self.worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="oktopk")

    def submit(self, fn, *args):
        """Run ``fn(*args)`` on the worker thread after everything submitted
        before; returns its ``concurrent.futures.Future``."""
        return self.worker.submit(fn, *args)

    def drain(self):
        """Wait until everything submitted so far has run."""
        if self.worker is not None:
            self.worker.submit(lambda: None).result()

    def close(self):
        """Stop the worker thread (after what it was given) and destroy the
        communicator."""
        if self.worker is not None:
            self.worker.shutdown(wait=True)
            self.worker = None
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None
        self.staging = {}

    # -- worker thread -------------------------------------------------------

    def staging_for(self, n, dtype, pinned):
        """n elements of dtype in the staging memory (pinned for CUDA
        tensors): allocated once, grown only for a larger tensor, and reused
        by every call, which the single worker thread makes one at a time.
        Each call's copies back finish before the next call writes it (copies
        to a CUDA tensor from pinned memory without non_blocking wait for the
        transfer)."""
        need = n * torch.empty(0, dtype=dtype).element_size()
        buf = self.staging.get(pinned)
        if buf is None or buf.numel() < need:
            self.staging[pinned] = None  # the old buffer goes before the new one comes
            buf = torch.empty(need, dtype=torch.uint8, pin_memory=pinned)
            self.staging[pinned] = buf
        return buf[:need].view(dtype)

    def sparse_allreduce_(self, tensor_id, host, hold=(), density=None, xi_step=None, tau_prime=None, sparse_only=False,
                          undoable=False):
        """Worker thread: the communicator's sparse allreduce of ``host`` (a
        contiguous CPU tensor) in place, its statistics recorded; ``xi_step``
        (None: not measured) is the step whose ξ the call measures. A step
        the library skipped because a gradient held NaN or Inf (on some rank,
        so on every rank; residuals kept) comes back as NaN in ``host``, as a
        dense average would, so AMP's scaler or the user's own check skips
        the optimizer step on every rank; the call then returns None, else
        its statistics. ``sparse_only``: "auto" never runs a dense algorithm
        (the caller's own dense path is the alternative). ``undoable``: the
        call can be taken back (Communicator.undo_call)."""
        try:
            stats = self.comm.sparse_allreduce_(tensor_id, host, hold, density=density, measure_xi=xi_step is not None,
                                                tau_prime=tau_prime, sparse_only=sparse_only, undoable=undoable)
        except OkTopkError as e:
            if e.code != _lib.NON_FINITE:
                raise
            host.fill_(float("nan"))
            return None
        return self.record(tensor_id, stats, xi_step)

    def count_host_device(self, nbytes, pairs=0):
        """Worker thread: one call's bytes between host and device (and, on
        the device path, its selected and result pairs)."""
        with self.lock:
            self.host_device_bytes += nbytes
            self.host_device_calls += 1
            self.host_device_pairs += pairs

    def record(self, tensor_id, stats, xi_step=None):
        """Worker thread: a completed call's statistics; returns them."""
        with self.lock:
            # A step that measures ξ moves a dense allreduce more: the
            # traffic a user pays for counts it.
            self.bytes_sent += stats.bytes_sent + stats.xi_bytes_sent
            self.bytes_received += stats.bytes_received + stats.xi_bytes_received
            self.comm_seconds += stats.total_seconds
            ran = _lib.algorithm_name(stats.algorithm)
            self.algorithm_counts[ran] = self.algorithm_counts.get(ran, 0) + 1
            self.last_k[tensor_id] = stats.k
            if stats.xi >= 0:
                self.last_xi = self._xi.add(xi_step, stats.xi, stats.xi_gradient_norm)
                self.last_xi_step = xi_step
            if self.adaptive is not None and ran == "oktopk":
                self.adaptive.record(stats.k, stats.local_selected)
        return stats

    # -- adaptive density and τ′ ---------------------------------------------

    def adapt(self, step):
        """After every call of step ``step``, which measured ξ: agree on the
        count drift (a one-number allreduce through the library) and adapt
        the density and τ′ of the steps that follow. Called where no call of
        the communicator can run at the same time (the worker thread, or
        once every submitted call has finished)."""
        drift = torch.tensor([self.adaptive.drift], dtype=torch.float32)
        self.comm.allreduce_(drift, average=True)
        with self.lock:
            xi = self.last_xi if self.last_xi_step == step else None
        self.adaptive.adapt(xi, float(drift.item()))

    def adaptive_state(self, measure_xi_every):
        """What a checkpoint saves of the adaptation (None without it)."""
        return None if self.adaptive is None else {**self.adaptive.state_dict(), "measure_xi_every": measure_xi_every}

    def load_adaptive(self, saved, density, tau_prime):
        """Continue the adaptation an :meth:`adaptive_state` saved, under its
        bounds (checked against ``tau_prime``), from ``density`` and
        ``tau_prime`` as the run's settings; returns its ``measure_xi_every``.
        ValueError for bounds that are not valid here."""
        bounds = check_adaptive(saved["bounds"], tau_prime)
        self.adaptive = AdaptiveControl(bounds, density, tau_prime)
        self.adaptive.load_state_dict(saved)
        return saved["measure_xi_every"]


def _stat(name, doc):
    return property(lambda self: getattr(self._reducer, name), doc=doc)


class ReducerStats:
    """A front end's statistics, read from its ``_reducer``, as its own
    attributes (the DDP state's and the Horovod optimizer's are the same)."""

    __slots__ = ()

    bytes_sent = _stat("bytes_sent", "Bytes this rank sent in sparse calls, ξ's measurements included.")
    bytes_received = _stat("bytes_received", "Bytes this rank received in sparse calls, ξ's measurements included.")
    comm_seconds = _stat("comm_seconds", "Seconds the sparse calls took.")
    algorithm_counts = _stat("algorithm_counts", 'Library calls per algorithm that ran (with "auto", the one it chose).')
    last_k = _stat("last_k", "The k of each tensor id's latest call.")
    last_xi = _stat("last_xi", "ξ of the latest measured step over its calls so far (None: none measured).")
    last_xi_step = _stat("last_xi_step", "The step last_xi belongs to.")
    host_device_bytes = _stat("host_device_bytes", "Bytes the sparse calls copied between host and device memory (oktopk.device).")
    host_device_calls = _stat("host_device_calls", "Sparse calls whose host-device bytes are counted in host_device_bytes.")
    host_device_pairs = _stat("host_device_pairs", "The device path's selected and result pairs, summed over its calls.")


# The statistics' names, for a front end that shows them as its own.
ReducerStats.STATISTICS = tuple(name for name, value in vars(ReducerStats).items() if isinstance(value, property))


class StepFolds:
    """What one step took out of the residuals and velocities, to give back
    when the step turns out void (a NaN or Inf anywhere in it): the folds
    of a native step (the library's, the device path's, the quantized
    path's residuals), the DDP hook's sparse calls, and the momentum
    correction's velocities.

    A fold moves a residual into this rank's values before the framework's
    dense allreduce. A NaN or Inf on another rank shows only in that sum,
    after every rank folded; the step is then skipped (AMP's scaler, or the
    caller's own check), and what was folded would be lost with it. So on
    a step that folds, the front end shows every reduced tensor of the step
    to :meth:`see`. A sparse step's groups are reduced one call each: a NaN
    in one group skips that call on every rank (:meth:`skipped`), but the
    step's other calls completed, and their residuals, thresholds and call
    counts moved on (what they sent is lost with the step); each completed
    call is recorded with the function that takes it back
    (``oktopk_tensor_undo_call``, :meth:`took`). Before the next step (or a
    checkpoint) :meth:`settle` gives back everything of a step that was not
    finite anywhere: each residual and velocity is then exactly what it was
    before the step, on every rank (the sums and the skips, and so the
    verdict, are the same on every rank). On a step without a NaN this
    costs a closure per call, dropped at the next step."""

    def __init__(self):
        self.watching = False  # this step may fold: see() checks its sums
        self.non_finite = False
        self._undo = []
        # Where one rank's groups do not see every group of the step (HSDP
        # with several replicate groups: a NaN reaches only its own), the
        # verdict is agreed by every rank: ``agree(non_finite)`` returns
        # whether the step was non-finite on any rank (a collective), called
        # by settle() once per step that ``began``, on every rank alike.
        self.agree = None
        self.began = False

    def took(self, undo):
        """A fold, call or velocity step of this step, and the function that
        gives it back."""
        self._undo.append(undo)

    def skipped(self):
        """A group of this step came back non-finite (the library skipped its
        call on every rank, or its dense average is NaN): the step is void,
        and :meth:`settle` gives back the rest of it."""
        self.non_finite = True

    @property
    def folded(self):
        """Whether this step folded anything."""
        return bool(self._undo)

    def see(self, reduced):
        """A reduced tensor of this step (the dense sum, averaged)."""
        if self.watching and not self.non_finite and not bool(torch.isfinite(reduced).all()):
            self.non_finite = True

    def fail(self, error):
        """The step under way failed (a call raised: a dead or silent peer,
        a mismatch): give back, now, everything it took on this rank (the
        calls of its groups that completed, its folds, its velocity steps),
        so that the residuals, quantized residuals and velocities are as
        before the step, whatever a later checkpoint saves. A take-back
        that fails itself is added to ``error``'s notes; ``error`` is the
        one raised. Returns how many were given back."""
        undo, given_back = self._undo, 0
        self._undo, self.non_finite, self.watching, self.began = [], False, False, False
        for give_back in reversed(undo):
            try:
                give_back()
                given_back += 1
            except BaseException as e:  # noqa: BLE001 - the step's own error is the one to raise
                error.add_note(f"oktopk: giving back what the failed step took also failed: {e!r}")
        return given_back

    def settle(self):
        """Between steps: give back what the step took if it was not finite
        anywhere; returns whether it was not (a void step, which the
        engine then does not count)."""
        non_finite = self.non_finite
        if self.agree is not None and self.began:
            non_finite = self.agree(non_finite)
        if non_finite:
            for undo in reversed(self._undo):
                undo()
        self._undo, self.non_finite, self.watching, self.began = [], False, False, False
        return bool(non_finite)
