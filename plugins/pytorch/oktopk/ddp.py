"""Ok-Topk as a PyTorch DDP communication hook.

Example::

    >>> from oktopk import OkTopkState, oktopk_hook
    >>> state = OkTopkState(process_group=None, density=0.01)
    >>> ddp_model.register_comm_hook(state, oktopk_hook)

The hook receives each bucket of this rank's (undivided) gradients and
returns a future of their average over the ranks, like PyTorch's
``allreduce_hook``, but only about ``density`` of the entries travel; the
rest wait in a per-bucket residual (error feedback).
"""

import concurrent.futures
import contextlib
import hashlib
import numbers
import threading

import torch
import torch.distributed as dist

from . import _lib
from ._lib import ALGORITHMS, OkTopkError
from .comm import Communicator

# The bucket dtypes liboktopk reduces; the dense warm-up would take others,
# so they are refused on the first hook call rather than at the first sparse
# step.
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_INT32 = 2**31 - 1


def _is_real(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _group_id(members):
    """The library tensor id of a group of parameters (canonical indices)."""
    key = ",".join(str(i) for i in sorted(members)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


class _PendingBucket:
    """A DDP bucket waiting in the regrouping pool: its future completes
    once every parameter in it has been reduced with its group."""

    __slots__ = ["tensor", "future", "stream", "remaining"]

    def __init__(self, tensor, future, stream, remaining):
        self.tensor, self.future, self.stream, self.remaining = tensor, future, stream, remaining


class OkTopkState:
    """State of :func:`oktopk_hook`: hyperparameters, the communicator, and
    per-bucket residuals and thresholds (kept inside liboktopk).

    :param process_group: the group to reduce over (``None``: the default).
    :param density: fraction of each bucket's entries sent, a real number in
        (0, 1].
    :param algorithm: one of ``oktopk.ALGORITHMS`` (``"oktopk"`` by default;
        dense ones, the sparse baselines).
    :param warmup_iters: iterations reduced densely first. DDP rebuilds its
        buckets after the first iteration, so per-bucket state is only safe
        from the second on (PowerSGD keeps a warm-up for the same reason);
        at least 1.
    :param tau: Ok-Topk's space repartition period (iterations).
    :param tau_prime: threshold refresh period (iterations).
    :param timeout: seconds a call, or the communicator's setup, may wait for
        a peer before it raises :class:`OkTopkError` instead of hanging.

    Buckets may be float32, float16 or bfloat16, on CPU or CUDA; CUDA buckets
    are staged through pinned host memory. A step whose gradient holds NaN or
    Inf on any rank comes back as NaN on every rank (the library skips it and
    keeps its state), so ``torch.amp.GradScaler`` or the script's own check
    skips the optimizer step, as with ``allreduce_hook``.
    """

    __slots__ = [
        "density",
        "algorithm",
        "warmup_iters",
        "tau",
        "tau_prime",
        "timeout",
        "process_group",
        "iter",
        "bytes_sent",
        "bytes_received",
        "comm_seconds",
        "_comm",
        "_worker",
        "_pending_state",
        "_groups",
        "_group_of",
        "_pool",
        "_lock",
        "_param_index",
        "_staging",
    ]

    def __init__(self, process_group=None, density=0.01, algorithm="oktopk", warmup_iters=1, tau=64, tau_prime=32, timeout=60.0):
        if not _is_real(density) or not 0.0 < density <= 1.0:
            raise ValueError(f"density must be a real number in (0, 1], got {density!r}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; one of {', '.join(ALGORITHMS)}")
        if not _is_int(warmup_iters) or warmup_iters < 1:
            raise ValueError(f"warmup_iters must be an integer >= 1 (DDP rebuilds buckets after the first iteration), got {warmup_iters!r}")
        for name, value in (("tau", tau), ("tau_prime", tau_prime)):
            if not _is_int(value) or not 1 <= value <= _MAX_INT32:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not _is_real(timeout) or not 0.0 < timeout <= _MAX_INT32 / 1000:
            raise ValueError(f"timeout must be a positive number of seconds (at most {_MAX_INT32 // 1000}), got {timeout!r}")
        self.density = float(density)
        self.algorithm = algorithm
        self.warmup_iters = int(warmup_iters)
        self.tau = int(tau)
        self.tau_prime = int(tau_prime)
        self.timeout = float(timeout)
        self.process_group = process_group
        self.iter = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.comm_seconds = 0.0
        self._comm = None
        self._worker = None
        self._pending_state = {}
        # The layout residuals are kept in: library tensor id -> the sorted
        # canonical indices of its parameters, and each parameter's group.
        self._groups = {}
        self._group_of = {}
        # Regrouping pool (worker thread only): canonical index -> (pending
        # bucket, start, end) of a parameter waiting for the rest of its group.
        self._pool = {}
        self._lock = threading.Lock()
        self._param_index = {}
        # Staging memory (worker thread only), one per kind (pinned or not),
        # grown to the largest group and reused by every call; see
        # _staging_for.
        self._staging = {}

    # -- a bucket layout that survives DDP's bucket rebuild ------------------
    #
    # Residuals live in the library under one tensor id per group of
    # parameters. Parameters are numbered as first seen (the first
    # iteration's layout, the same in every run of the same model), a group
    # is kept in ascending canonical order, and its id derives from its
    # members, so neither DDP's reordering inside a bucket nor a process
    # restart changes which residual a gradient entry meets.
    #
    # The groups are the buckets of the first sparse iteration (DDP's rebuilt
    # layout). A DDP bucket whose members are not one known group (the first
    # iteration of a resumed run sees DDP's initial layout again) goes to a
    # pool instead; each group is reduced once all its parameters have
    # arrived, and a bucket's future completes once all of its parameters
    # are reduced. Hooks fire in the same order on every rank, so every rank
    # issues the same library calls in the same order.

    def _members(self, bucket):
        """Canonical index and (start, end) in the bucket buffer of each of
        the bucket's parameters, in bucket order."""
        at, members = 0, []
        for p in bucket.parameters():
            index = self._param_index.setdefault(id(p), len(self._param_index))
            members.append((index, at, at + p.numel()))
            at += p.numel()
        return members

    def _add_group(self, group_id, members):
        self._groups[group_id] = members
        for i in members:
            self._group_of[i] = group_id

    # -- communicator and worker, made on first sparse use -----------------

    def _communicator(self):
        if self._comm is None:
            self._comm = Communicator(self.process_group, self.algorithm, self.density, self.tau, self.tau_prime, self.timeout)
            for bucket_id, blob in self._pending_state.items():
                self._comm.load_tensor_state(bucket_id, blob)
            self._pending_state = {}
            # One worker: buckets reach the library in the order DDP fired
            # them, which is the same on every rank; the calls release the
            # GIL, so backward goes on meanwhile.
            self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="oktopk")
        return self._comm

    def _reduce_pieces(self, group_id, pieces):
        """Sparse allreduce of the concatenation of pieces ((tensor, start,
        end), canonical order), written back into them. A step the library
        skipped for a non-finite gradient (on any rank, so on every rank)
        comes back as NaN."""
        merged = [pieces[0]]
        for t, a, b in pieces[1:]:
            if t is merged[-1][0] and a == merged[-1][2]:
                merged[-1] = (t, merged[-1][1], b)  # adjacent in one buffer: one copy
            else:
                merged.append((t, a, b))
        pieces = merged
        tensor = pieces[0][0]
        n = sum(b - a for _, a, b in pieces)
        cuda = tensor.device.type == "cuda"
        if not cuda and len(pieces) == 1 and pieces[0][1:] == (0, tensor.numel()) and tensor.is_contiguous():
            host = tensor  # in place
        else:
            # The one copy of a bucket that remains, and why: the library
            # reads host memory (a CUDA bucket is copied to pinned host
            # memory, so both copies are DMA transfers), and it keeps the
            # residual in the group's canonical order (a CPU bucket whose
            # parameters DDP laid out otherwise, or spread over buckets, is
            # gathered). The staging memory is the state's, reused.
            host = self._staging_for(n, tensor.dtype, cuda)
            at = 0
            for t, a, b in pieces:
                host[at : at + b - a].copy_(t[a:b])
                at += b - a
        try:
            stats = self._comm.sparse_allreduce_(group_id, host)
        except OkTopkError as e:
            if e.code != _lib.NON_FINITE:
                raise
            stats = None
            host.fill_(float("nan"))
        if host is not tensor:
            at = 0
            for t, a, b in pieces:
                t[a:b].copy_(host[at : at + b - a])
                at += b - a
        if stats is not None:
            with self._lock:
                self.bytes_sent += stats.bytes_sent
                self.bytes_received += stats.bytes_received
                self.comm_seconds += stats.total_seconds

    def _staging_for(self, n, dtype, pinned):
        """n elements of dtype in the state's staging memory (pinned for
        CUDA buckets): allocated once, grown only for a larger group, and
        reused by every call, which the single worker thread makes one at a
        time. Each call's copies back to the bucket finish before the next
        call writes it (copies to a CUDA tensor from pinned memory without
        non_blocking wait for the transfer)."""
        need = n * torch.empty(0, dtype=dtype).element_size()
        buf = self._staging.get(pinned)
        if buf is None or buf.numel() < need:
            self._staging[pinned] = None  # the old buffer goes before the new one comes
            buf = torch.empty(need, dtype=torch.uint8, pin_memory=pinned)
            self._staging[pinned] = buf
        return buf[:need].view(dtype)

    def _reduce_bucket(self, group_id, tensor, slices, fut, stream):
        # Worker thread: one DDP bucket that is exactly one group.
        try:
            with _on_stream(stream):
                self._reduce_pieces(group_id, [(tensor, a, b) for a, b in slices])
                fut.set_result(tensor)
        except BaseException as e:  # noqa: BLE001 - the future carries it to DDP
            fut.set_exception(e)

    def _pool_bucket(self, tensor, members, fut, stream):
        # Worker thread: a DDP bucket that is not one group (see above).
        pending = _PendingBucket(tensor, fut, stream, {i for i, _, _ in members})
        for i, a, b in members:
            self._pool[i] = (pending, a, b)

        def reduce_complete_groups():
            for group_id in sorted({self._group_of[i] for i, _, _ in members if i in self._group_of}):
                if all(i in self._pool for i in self._groups[group_id]):
                    self._reduce_pooled(group_id)

        self._run_pool(reduce_complete_groups)

    def _flush_pool(self):
        # Worker thread, after an iteration's last bucket: parameters still
        # pooled belong to no known group (the model changed since the
        # checkpoint); each bucket's leftovers become a new group.
        def flush():
            leftovers = {}
            for i in sorted(self._pool):
                leftovers.setdefault(id(self._pool[i][0]), []).append(i)
            for group in leftovers.values():
                group_id = _group_id(group)
                self._add_group(group_id, tuple(group))
                self._reduce_pooled(group_id)

        if self._pool:
            self._run_pool(flush)

    def _run_pool(self, work):
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - every waiting future carries it to DDP
            waiting = {id(p): p for p, _, _ in self._pool.values()}
            self._pool.clear()
            for p in waiting.values():
                if not p.future.done():
                    p.future.set_exception(e)

    def _reduce_pooled(self, group_id):
        members = self._groups[group_id]
        entries = [self._pool[i] for i in members]
        try:
            with _on_stream(entries[0][0].stream):
                self._reduce_pieces(group_id, [(p.tensor, a, b) for p, a, b in entries])
        except BaseException as e:  # noqa: BLE001
            for p, _, _ in entries:
                if not p.future.done():
                    p.future.set_exception(e)
            raise
        for i, (p, _, _) in zip(members, entries):
            del self._pool[i]
            p.remaining.discard(i)
            if not p.remaining:
                with _on_stream(p.stream):
                    p.future.set_result(p.tensor)

    # -- checkpointing -----------------------------------------------------

    def state_dict(self):
        """Iteration counter, the parameter groups residuals are kept in, and
        every group's residual and thresholds, so a resumed run continues
        where this one stopped (also into DDP's initial bucket layout)."""
        tensors = dict(self._pending_state)
        if self._comm is not None:
            if self._worker is not None:
                self._worker.submit(lambda: None).result()  # after every queued bucket
            for group_id in sorted(self._groups):
                tensors[group_id] = self._comm.save_tensor_state(group_id)
        layout = {group_id: list(members) for group_id, members in self._groups.items()}
        return {"iter": self.iter, "density": self.density, "algorithm": self.algorithm, "tensors": tensors, "layout": layout}

    def load_state_dict(self, state):
        if state.get("algorithm", self.algorithm) != self.algorithm:
            raise ValueError(f"checkpoint was made with algorithm {state['algorithm']!r}, this state uses {self.algorithm!r}")
        self.iter = int(state["iter"])
        tensors = dict(state.get("tensors", {}))
        self._groups, self._group_of = {}, {}
        for group_id, members in state.get("layout", {}).items():
            self._add_group(group_id, tuple(members))
        if self._comm is not None:
            for bucket_id, blob in tensors.items():
                self._comm.load_tensor_state(bucket_id, blob)
        else:
            self._pending_state = tensors

    def __getstate__(self):
        return self.state_dict() | {
            "warmup_iters": self.warmup_iters,
            "tau": self.tau,
            "tau_prime": self.tau_prime,
            "timeout": self.timeout,
        }

    def __setstate__(self, state):
        OkTopkState.__init__(self, None, state["density"], state["algorithm"], state["warmup_iters"], state["tau"], state["tau_prime"], state["timeout"])
        self.load_state_dict(state)

    def close(self):
        """Release the worker thread and the communicator. Call it when
        training ends; a state never closed releases them only when it is
        garbage-collected (nothing is registered to run at interpreter
        exit)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None
        self._staging = {}


def _on_stream(stream):
    """Run on the CUDA stream backward produced the bucket on (None: CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def oktopk_hook(state: OkTopkState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the average of the bucket's gradients over the
    ranks, sparsified by ``state.algorithm`` at ``state.density``.

    Example::

        >>> state = OkTopkState(density=0.01)
        >>> ddp_model.register_comm_hook(state, oktopk_hook)
    """
    tensor = bucket.buffer()
    if tensor.dtype not in SUPPORTED_DTYPES or tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"oktopk_hook: unsupported bucket of {tensor.dtype} on {tensor.device.type}; "
            "liboktopk reduces float32, float16 and bfloat16 gradients on CPU or CUDA"
        )
    is_last = bucket.is_last()
    # Every bucket of one iteration is in the same phase: they were all
    # fired with the same state.iter, which the last one advances.
    phase_iter = state.iter
    if is_last:
        state.iter += 1
    members = state._members(bucket)  # numbers the parameters in the first layout
    if phase_iter < state.warmup_iters:
        group = state.process_group
        world = dist.get_world_size(group)
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(world))
    state._communicator()
    if tensor.device.type == "cuda":
        # The worker copies on the stream backward produced the bucket on;
        # the future's CUDA events make DDP wait for the copy back.
        fut = torch.futures.Future(devices=[tensor.device])
        stream = torch.cuda.current_stream(tensor.device)
    else:
        fut, stream = torch.futures.Future(), None
    indices = sorted(i for i, _, _ in members)
    group_id = _group_id(indices)
    if group_id in state._groups or not any(i in state._group_of for i in indices):
        if group_id not in state._groups:
            state._add_group(group_id, tuple(indices))
        slices = [(a, b) for _, a, b in sorted(members)]  # canonical order
        state._worker.submit(state._reduce_bucket, group_id, tensor, slices, fut, stream)
    else:
        state._worker.submit(state._pool_bucket, tensor, members, fut, stream)
    if is_last:
        state._worker.submit(state._flush_pool)
    return fut
