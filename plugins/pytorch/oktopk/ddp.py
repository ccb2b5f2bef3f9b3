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
import hashlib
import threading

import torch
import torch.distributed as dist

from . import _lib
from ._lib import ALGORITHMS, OkTopkError
from .comm import Communicator


class OkTopkState:
    """State of :func:`oktopk_hook`: hyperparameters, the communicator, and
    per-bucket residuals and thresholds (kept inside liboktopk).

    :param process_group: the group to reduce over (``None``: the default).
    :param density: fraction of each bucket's entries sent, in (0, 1].
    :param algorithm: one of ``oktopk.ALGORITHMS`` (``"oktopk"`` by default;
        dense ones, the sparse baselines).
    :param warmup_iters: iterations reduced densely first. DDP rebuilds its
        buckets after the first iteration, so per-bucket state is only safe
        from the second on (PowerSGD keeps a warm-up for the same reason);
        at least 1.
    :param tau: Ok-Topk's space repartition period (iterations).
    :param tau_prime: threshold refresh period (iterations).
    :param timeout: seconds a call may wait for a peer before it raises
        :class:`OkTopkError` instead of hanging.
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
        "_bucket_ids",
        "_lock",
        "_param_index",
    ]

    def __init__(self, process_group=None, density=0.01, algorithm="oktopk", warmup_iters=1, tau=64, tau_prime=32, timeout=60.0):
        if not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; one of {', '.join(ALGORITHMS)}")
        if not isinstance(warmup_iters, int) or warmup_iters < 1:
            raise ValueError(f"warmup_iters must be an integer >= 1 (DDP rebuilds buckets after the first iteration), got {warmup_iters!r}")
        for name, value in (("tau", tau), ("tau_prime", tau_prime)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self.density = float(density)
        self.algorithm = algorithm
        self.warmup_iters = warmup_iters
        self.tau = tau
        self.tau_prime = tau_prime
        self.timeout = float(timeout)
        self.process_group = process_group
        self.iter = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.comm_seconds = 0.0
        self._comm = None
        self._worker = None
        self._pending_state = {}
        self._bucket_ids = set()
        self._lock = threading.Lock()
        self._param_index = {}

    # -- a bucket layout that survives DDP's bucket rebuild ------------------

    def _canonical(self, bucket):
        """The bucket's tensor id and, if its entries must be reordered, the
        order of its parameters in the canonical layout.

        DDP rebuilds its buckets after the first iteration, which reorders
        parameters inside them, and a resumed run sees the first layout again.
        Residuals are kept in one canonical order instead: parameters numbered
        as first seen (the first iteration's layout, the same in every run of
        the same model), and a bucket's tensor id derived from its members.
        """
        params = bucket.parameters()
        index = [self._param_index.setdefault(id(p), len(self._param_index)) for p in params]
        order = sorted(range(len(params)), key=index.__getitem__)
        members = ",".join(str(index[i]) for i in order).encode()
        tensor_id = int.from_bytes(hashlib.blake2b(members, digest_size=8).digest(), "little")
        if order == list(range(len(params))):
            return tensor_id, None
        sizes = [p.numel() for p in params]
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        return tensor_id, [(starts[i], starts[i] + sizes[i]) for i in order]

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

    def _reduce(self, bucket_id, slices, tensor, fut):
        try:
            if slices is not None:
                # Canonical order: the library's residual layout never changes.
                host = torch.cat([tensor[a:b] for a, b in slices])
            elif tensor.device.type != "cpu":
                host = torch.empty(tensor.shape, dtype=tensor.dtype)
                host.copy_(tensor)
            else:
                host = tensor if tensor.is_contiguous() else tensor.contiguous()
            if host.device.type != "cpu":
                # Stage through pinned host memory; the library reads CPU memory.
                staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
                staged.copy_(host)
                host = staged
            stats = self._comm.sparse_allreduce_(bucket_id, host)
            if slices is not None:
                at = 0
                for a, b in slices:
                    tensor[a:b].copy_(host[at : at + b - a])
                    at += b - a
            elif host is not tensor:
                tensor.copy_(host)
            with self._lock:
                self.bytes_sent += stats.bytes_sent
                self.bytes_received += stats.bytes_received
                self.comm_seconds += stats.total_seconds
            fut.set_result(tensor)
        except BaseException as e:  # noqa: BLE001 - the future carries it to DDP
            fut.set_exception(e)

    # -- checkpointing -----------------------------------------------------

    def state_dict(self):
        """Iteration counter and every bucket's residual and thresholds, so
        a resumed run continues where this one stopped."""
        tensors = dict(self._pending_state)
        if self._comm is not None:
            if self._worker is not None:
                self._worker.submit(lambda: None).result()  # after every queued bucket
            for bucket_id in sorted(self._bucket_ids):
                tensors[bucket_id] = self._comm.save_tensor_state(bucket_id)
        return {"iter": self.iter, "density": self.density, "algorithm": self.algorithm, "tensors": tensors}

    def load_state_dict(self, state):
        if state.get("algorithm", self.algorithm) != self.algorithm:
            raise ValueError(f"checkpoint was made with algorithm {state['algorithm']!r}, this state uses {self.algorithm!r}")
        self.iter = int(state["iter"])
        tensors = dict(state.get("tensors", {}))
        self._bucket_ids = set(tensors)
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
        """Release the communicator (also done at interpreter exit)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None


def oktopk_hook(state: OkTopkState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the average of the bucket's gradients over the
    ranks, sparsified by ``state.algorithm`` at ``state.density``.

    Example::

        >>> state = OkTopkState(density=0.01)
        >>> ddp_model.register_comm_hook(state, oktopk_hook)
    """
    tensor = bucket.buffer()
    if bucket.is_last():
        # Counted now, but every bucket of this iteration already knows
        # which phase it is in: they were all fired with the same state.iter.
        phase_iter = state.iter
        state.iter += 1
    else:
        phase_iter = state.iter
    if phase_iter < state.warmup_iters:
        state._canonical(bucket)  # number the parameters in the first layout
        group = state.process_group
        world = dist.get_world_size(group)
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(world))
    state._communicator()
    bucket_id, slices = state._canonical(bucket)
    state._bucket_ids.add(bucket_id)
    fut = torch.futures.Future()
    state._worker.submit(state._reduce, bucket_id, slices, tensor, fut)
    return fut
