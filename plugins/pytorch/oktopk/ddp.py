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
import threading

import torch
import torch.distributed as dist

from . import _lib
from ._lib import OkTopkError
from .adaptive import AdaptiveControl, check_adaptive
from .comm import Communicator, XiTally
from .schedule import check_schedule, density_at
from .settings import check_settings, is_int

# The bucket dtypes liboktopk reduces; the dense warm-up would take others,
# so they are refused on the first hook call rather than at the first sparse
# step.
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
    :param algorithm: one of ``oktopk.ALGORITHMS``: ``"auto"`` (the library
        picks per bucket and call from a cost model and the measured link),
        ``"oktopk"``, the dense ones, the sparse baselines. ``None`` (the
        default) is the library's default, ``"oktopk"`` in this version.
    :param warmup_iters: iterations reduced densely first; at least 2.
        DDP reduces its first iteration in a provisional bucket layout and
        rebuilds its buckets after it. The hook keeps residuals in the
        rebuilt layout, which it first sees in the second iteration; only
        from the third on is that layout known before every step, so that a
        checkpoint taken at any step holds it (PowerSGD likewise starts after
        DDP's first two iterations).
    :param tau: Ok-Topk's space repartition period (iterations).
    :param tau_prime: threshold refresh period (iterations).
    :param timeout: seconds a call, or the communicator's setup, may wait for
        a peer before it raises :class:`OkTopkError` instead of hanging.
    :param value_dtype: the precision selected values travel in:
        ``"float32"`` (default), ``"float16"`` or ``"bfloat16"`` (or the torch
        dtype), for the algorithms ``oktopk``, ``topka``, ``gaussiank`` and ``auto``.
        16-bit values make each sent (index, value) pair 6 bytes instead of
        8; the rounding errors stay in the residuals, so nothing is lost.
    :param stochastic_rounding: round 16-bit values up or down at random,
        unbiasedly, instead of to nearest (reproducible: the random bits are
        a hash of the bucket, step, rank and index).
    :param density_schedule: ``None`` (``density`` from the first sparse
        step), or ``(start_density, decay_steps)`` or ``(start_density,
        decay_steps, stage_steps)``: the density starts at
        ``start_density`` and decays exponentially to ``density`` over
        ``decay_steps`` sparse steps, changing every ``stage_steps`` steps
        (see ``oktopk.schedule``). It follows ``iter``, which
        :meth:`state_dict` saves with the schedule, so a resumed run
        continues it exactly.
    :param measure_xi_every: ``None`` (never), or n: every n-th sparse step
        (the first included) also measures ξ, the distance of the result from
        the exact top-k of the accumulated gradients' sum relative to the
        gradients' sum (Assumption 1 of the Ok-Topk paper), over all buckets:
        ``last_xi`` then holds it and ``last_xi_step`` the step (``iter``
        before it), the same on every rank. A measured step costs a dense
        allreduce of twice the gradients more, and its result is bitwise
        what it is unmeasured. Dense algorithms measure nothing.
    :param adaptive: ``None``, or ``(min_density, max_density[, max_xi[,
        min_tau_prime]])``: each step's density and τ′ are set from the
        measured ξ and the ranks' count drift, within these bounds (see
        ``oktopk.adaptive``; ``max_xi`` 1.0 and ``min_tau_prime``
        ``tau_prime // 8`` by default), starting from ``density`` and
        ``tau_prime``; ``measure_xi_every`` is then 50 unless given.
        ``last_density`` and ``last_tau_prime`` say what the latest step
        used. Not with ``density_schedule``.

    With ``find_unused_parameters=True``, a parameter that DDP found unused
    on this rank at a step is held back: its residual is kept, not sent, and
    DDP's result for it (discarded when no rank used it) loses nothing of
    it. The hook learns which parameters were used from
    post-accumulate-grad hooks it registers on the bucket parameters (until
    :meth:`close`); before those are in place, and on torch without them, a
    parameter whose bucket slot is all zeros (which is what DDP leaves for
    an unused one) counts as unused.

    ``algorithm_counts`` counts the library calls per algorithm that ran
    (with ``"auto"``, the one it chose for each bucket and step).

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
        "value_dtype",
        "stochastic_rounding",
        "density_schedule",
        "measure_xi_every",
        "last_density",
        "last_tau_prime",
        "adaptive",
        "_adaptive",
        "_adapt_error",
        "last_k",
        "last_xi",
        "last_xi_step",
        "process_group",
        "iter",
        "bytes_sent",
        "bytes_received",
        "comm_seconds",
        "algorithm_counts",
        "_comm",
        "_worker",
        "_pending_state",
        "_groups",
        "_group_of",
        "_pool",
        "_lock",
        "_param_index",
        "_staging",
        "_hook_iters",
        "_owner",
        "_used",
        "_grad_hooks",
        "_xi_sums",
    ]

    def __init__(self, process_group=None, density=0.01, algorithm=None, warmup_iters=2, tau=64, tau_prime=32, timeout=60.0,
                 value_dtype="float32", stochastic_rounding=False, density_schedule=None, measure_xi_every=None,
                 adaptive=None):
        if not is_int(warmup_iters) or warmup_iters < 2:
            raise ValueError(
                f"warmup_iters must be an integer >= 2 (DDP rebuilds its buckets after the first iteration, and the "
                f"hook learns the rebuilt layout in the second), got {warmup_iters!r}"
            )
        (density, algorithm, tau, tau_prime, timeout, value_dtype, stochastic_rounding, density_schedule, measure_xi_every,
         adaptive) = check_settings(density, algorithm, tau, tau_prime, timeout, value_dtype, stochastic_rounding, density_schedule,
                                    measure_xi_every, adaptive)
        self.adaptive = adaptive
        self._adaptive = None if adaptive is None else AdaptiveControl(adaptive, float(density), int(tau_prime))
        self._adapt_error = None
        self.last_tau_prime = None
        self.density = float(density)
        self.density_schedule = density_schedule
        self.measure_xi_every = measure_xi_every
        # The density of the latest sparse step, the k of each group's latest
        # call, and the latest measured ξ with its step.
        self.last_density = None
        self.last_k = {}
        self.last_xi = None
        self.last_xi_step = None
        # The latest measured step's buckets so far (worker thread, under _lock).
        self._xi_sums = XiTally()
        self.algorithm = algorithm
        self.warmup_iters = int(warmup_iters)
        self.tau = int(tau)
        self.tau_prime = int(tau_prime)
        self.timeout = float(timeout)
        self.value_dtype = value_dtype
        self.stochastic_rounding = stochastic_rounding
        self.process_group = process_group
        self.iter = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.comm_seconds = 0.0
        # Sparse library calls per algorithm that ran (with "auto", what it
        # chose), e.g. {"oktopk": 120, "dense_rabenseifner": 40}.
        self.algorithm_counts = {}
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
        # Iterations this process has run through the hook: DDP's first one
        # (0 here) uses its provisional bucket layout, every later one the
        # rebuilt layout, whatever state.iter a checkpoint resumed from.
        self._hook_iters = 0
        # (rank, world size) a loaded checkpoint belongs to, until checked
        # against this process's (at load, or at communicator setup when the
        # process group did not exist yet at load).
        self._owner = None
        # Canonical index -> whether the parameter's gradient was accumulated
        # since its bucket was last reduced (None: not known, its hook was
        # registered since), and the hooks' handles.
        self._used = {}
        self._grad_hooks = []

    # -- a bucket layout that survives DDP's bucket rebuild ------------------
    #
    # Residuals live in the library under one tensor id per group of
    # parameters. Parameters are numbered as first seen (the first
    # iteration's layout, the same in every run of the same model), a
    # group's id derives from its members, and its residual is laid out in
    # the order of its parameters in the bucket it was learned from, which
    # the layout records (and a checkpoint keeps); so neither DDP's
    # reordering inside a bucket nor a process restart changes which
    # residual a gradient entry meets. That order is the rebuilt bucket's
    # own, so a CPU bucket is reduced in place, with no copy: ascending
    # canonical order, which this hook kept before (and which checkpoints
    # saved then still hold), is the reverse of the order gradients become
    # ready in a typical model, and made every bucket a gather and scatter.
    #
    # The groups are DDP's rebuilt buckets, recorded from the first iteration
    # that is not DDP's first in this process: in a run from the start that
    # is iteration 1, still in the warm-up (warmup_iters >= 2), so the layout
    # is in every checkpoint taken at or after the first sparse step; a run
    # resumed from a checkpoint taken before that learns it the same way. A
    # DDP bucket whose members are not one known group (the first iteration
    # of a resumed run sees DDP's initial layout again) goes to a pool
    # instead; each group is reduced once all its parameters have arrived,
    # and a bucket's future completes once all of its parameters are
    # reduced. Hooks fire in the same order on every rank, so every rank
    # issues the same library calls in the same order.

    def _members(self, bucket):
        """Canonical index and (start, end) in the bucket buffer of each of
        the bucket's parameters, in bucket order."""
        at, members = 0, []
        for p in bucket.parameters():
            index = self._param_index.get(id(p))
            if index is None:
                index = self._param_index[id(p)] = len(self._param_index)
                self._watch(p, index)
            members.append((index, at, at + p.numel()))
            at += p.numel()
        return members

    # -- parameters DDP found unused ----------------------------------------
    #
    # With find_unused_parameters=True, DDP zeroes an unused parameter's slot
    # in the bucket before the hook runs, and when no rank used it, leaves
    # its .grad untouched, discarding what the hook returns for it. A residual
    # the library sent for it would then be lost. So each rank holds back the
    # parameters it did not use at this step (the library keeps their
    # residual); where another rank used one, that rank's values still arrive
    # and DDP applies the average, as without oktopk.
    #
    # A post-accumulate-grad hook marks a parameter used; it runs before
    # DDP's own hook on the same gradient accumulator, so before the bucket
    # is reduced. Under no_sync() the marks accumulate until the synchronised
    # step, as DDP's own record of used parameters does.

    def _watch(self, p, index):
        self._used[index] = None
        if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(lambda _, i=index: self._used.__setitem__(i, True)))

    def _take_unused(self, members, tensor):
        """Canonical indices of the bucket's parameters unused on this rank
        since its last reduction; resets the marks. A parameter without a
        mark yet counts as unused when its slot in tensor is all zeros
        (tensor None: only reset the marks)."""
        unused = set()
        for i, a, b in members:
            used = self._used.get(i)
            if used is None:
                used = tensor is None or bool(tensor[a:b].any())
            self._used[i] = False
            if not used:
                unused.add(i)
        return unused

    def _add_group(self, group_id, members):
        self._groups[group_id] = members
        for i in members:
            self._group_of[i] = group_id

    def _learn_group(self, indices):
        """Record a rebuilt-layout bucket (canonical indices in bucket order)
        as a group, its residual laid out in that order, unless its
        parameters already belong to groups; returns its group id."""
        group_id = _group_id(indices)
        if group_id not in self._groups and not any(i in self._group_of for i in indices):
            self._add_group(group_id, tuple(indices))
        return group_id

    # -- which rank a checkpoint belongs to ---------------------------------

    def _placement(self):
        """(rank, world size) of this process in the state's group, or None
        before the process group exists."""
        if not dist.is_available() or not dist.is_initialized():
            return None
        return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)

    def _check_owner(self):
        """Refuse a checkpoint of another rank or world size: its residuals
        are another rank's unsent gradients, or a partition among another
        number of ranks. Loaded anyway it would make the run drift, or fail
        at the first sparse step."""
        here = self._placement()
        if self._owner is None or here is None:
            return
        (rank, size), (saved_rank, saved_size) = here, self._owner
        if saved_size != size:
            raise ValueError(
                f"oktopk: this OkTopkState checkpoint was saved by a run of {saved_size} ranks, and this run has {size}: "
                f"each rank's residuals are its own and cannot be repartitioned. Resume with {saved_size} ranks, or do "
                f"not load the oktopk state (load only the model and optimizer) and its residuals start afresh."
            )
        if saved_rank != rank:
            raise ValueError(
                f"oktopk: this OkTopkState checkpoint belongs to rank {saved_rank}, and this process is rank {rank} of "
                f"{size}: each rank keeps its own residuals and must load its own state. Save every rank's state_dict() "
                f"(e.g. to a file named with dist.get_rank()), or collect them on rank 0 with dist.gather_object, and "
                f"load on each rank the state of that rank."
            )
        self._owner = None  # checked

    # -- communicator and worker, made on first sparse use -----------------

    def _communicator(self):
        if self._comm is None:
            self._check_owner()
            self._comm = Communicator(self.process_group, self.algorithm, self.density, self.tau, self.tau_prime, self.timeout,
                                      value_dtype=self.value_dtype, stochastic_rounding=self.stochastic_rounding)
            for bucket_id, blob in self._pending_state.items():
                self._comm.load_tensor_state(bucket_id, blob)
            self._pending_state = {}
            # One worker: buckets reach the library in the order DDP fired
            # them, which is the same on every rank; the calls release the
            # GIL, so backward goes on meanwhile.
            self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="oktopk")
        return self._comm

    def _reduce_pieces(self, group_id, pieces, call):
        """Sparse allreduce of the concatenation of pieces ((tensor, start,
        end, held), in the group's layout), written back into them; the held
        ones (parameters unused on this rank) are held back in the library. A
        step the library skipped for a non-finite gradient (on any rank, so on
        every rank) comes back as NaN. call is (density or None, the step when
        ξ is measured or None)."""
        hold, at = [], 0
        for _, a, b, held in pieces:
            if held:
                if hold and hold[-1][1] == at:
                    hold[-1] = (hold[-1][0], at + b - a)
                else:
                    hold.append((at, at + b - a))
            at += b - a
        pieces = [piece[:3] for piece in pieces]
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
            # residual in the group's layout (a CPU bucket whose parameters
            # DDP laid out otherwise, as in the first iteration of a resumed
            # run or under a checkpoint saved in ascending order, or a group
            # spread over buckets, is gathered). The staging memory is the
            # state's, reused.
            host = self._staging_for(n, tensor.dtype, cuda)
            at = 0
            for t, a, b in pieces:
                host[at : at + b - a].copy_(t[a:b])
                at += b - a
        try:
            density, xi_step = call
            tau_prime = None
            if self._adaptive is not None:  # this worker thread adapts them, between steps
                density, tau_prime = self._adaptive.density, self._adaptive.tau_prime
                self.last_density, self.last_tau_prime = density, tau_prime
            stats = self._comm.sparse_allreduce_(group_id, host, hold, density=density, measure_xi=xi_step is not None,
                                                 tau_prime=tau_prime)
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
                ran = _lib.algorithm_name(stats.algorithm)
                self.algorithm_counts[ran] = self.algorithm_counts.get(ran, 0) + 1
                self.last_k[group_id] = stats.k
                if stats.xi >= 0:
                    self._add_xi(xi_step, stats.xi, stats.xi_gradient_norm)
                if self._adaptive is not None and ran == "oktopk":
                    self._adaptive.record(stats.k, stats.local_selected)

    def _adapt(self, step):
        """Worker thread, after the last call of sparse iteration ``step``,
        which measured ξ: agree on the count drift (a one-number allreduce)
        and adapt the density and τ′ of the steps that follow (their calls
        come after this in the worker's queue, on every rank). A failure is
        raised by the next bucket."""
        try:
            drift = torch.tensor([self._adaptive.drift], dtype=torch.float32)
            self._comm.allreduce_(drift, average=True)
            with self._lock:
                xi = self.last_xi if self.last_xi_step == step else None
            self._adaptive.adapt(xi, float(drift.item()))
        except BaseException as e:  # noqa: BLE001 - the next bucket's future carries it to DDP
            self._adapt_error = e

    def _raise_adapt_error(self):
        if self._adapt_error is not None:
            e, self._adapt_error = self._adapt_error, None
            raise e

    def _add_xi(self, step, xi, norm):
        # Under _lock: the step's ξ over its buckets so far.
        self.last_xi = self._xi_sums.add(step, xi, norm)
        self.last_xi_step = step

    def _call(self, step):
        """(density or None, ξ step or None) of sparse iteration ``step``
        (state.iter when its buckets fired): the same on every rank."""
        s = step - self.warmup_iters
        density = None if self.density_schedule is None else density_at(self.density_schedule, self.density, s)
        measure = self.measure_xi_every is not None and s % self.measure_xi_every == 0
        return density, (step if measure else None)

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

    def _reduce_bucket(self, group_id, tensor, slices, fut, stream, call):
        # Worker thread: one DDP bucket that is exactly one group; slices are
        # (start, end, held).
        try:
            self._raise_adapt_error()
            with _on_stream(stream):
                self._reduce_pieces(group_id, [(tensor, a, b, held) for a, b, held in slices], call)
                fut.set_result(tensor)
        except BaseException as e:  # noqa: BLE001 - the future carries it to DDP
            fut.set_exception(e)

    def _pool_bucket(self, tensor, members, unused, fut, stream, call):
        # Worker thread: a DDP bucket that is not one group (see above).
        pending = _PendingBucket(tensor, fut, stream, {i for i, _, _ in members})
        for i, a, b in members:
            self._pool[i] = (pending, a, b, i in unused)

        def reduce_complete_groups():
            for group_id in sorted({self._group_of[i] for i, _, _ in members if i in self._group_of}):
                if all(i in self._pool for i in self._groups[group_id]):
                    self._reduce_pooled(group_id, call)

        self._run_pool(reduce_complete_groups)

    def _flush_pool(self, call):
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
                self._reduce_pooled(group_id, call)

        if self._pool:
            self._run_pool(flush)

    def _run_pool(self, work):
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - every waiting future carries it to DDP
            waiting = {id(p): p for p, _, _, _ in self._pool.values()}
            self._pool.clear()
            for p in waiting.values():
                if not p.future.done():
                    p.future.set_exception(e)

    def _reduce_pooled(self, group_id, call):
        members = self._groups[group_id]
        entries = [self._pool[i] for i in members]
        try:
            self._raise_adapt_error()
            with _on_stream(entries[0][0].stream):
                self._reduce_pieces(group_id, [(p.tensor, a, b, held) for p, a, b, held in entries], call)
        except BaseException as e:  # noqa: BLE001
            for p, _, _, _ in entries:
                if not p.future.done():
                    p.future.set_exception(e)
            raise
        for i, (p, _, _, _) in zip(members, entries):
            del self._pool[i]
            p.remaining.discard(i)
            if not p.remaining:
                with _on_stream(p.stream):
                    p.future.set_result(p.tensor)

    # -- checkpointing -----------------------------------------------------

    def state_dict(self):
        """Iteration counter, the parameter groups residuals are kept in,
        every group's residual and thresholds, and the rank and world size
        they belong to, so a resumed run continues where this one stopped
        (also into DDP's initial bucket layout). Every rank saves its own."""
        tensors = dict(self._pending_state)
        if self._comm is not None:
            if self._worker is not None:
                self._worker.submit(lambda: None).result()  # after every queued bucket
            for group_id in sorted(self._groups):
                tensors[group_id] = self._comm.save_tensor_state(group_id)
        layout = {group_id: list(members) for group_id, members in self._groups.items()}
        rank, size = self._placement() or self._owner or (None, None)
        return {
            "iter": self.iter,
            "density": self.density,
            "density_schedule": self.density_schedule,
            "adaptive": None if self._adaptive is None else {**self._adaptive.state_dict(), "measure_xi_every": self.measure_xi_every},
            "algorithm": self.algorithm,
            "tensors": tensors,
            "layout": layout,
            "rank": rank,
            "world_size": size,
        }

    def load_state_dict(self, state):
        """Restore a state_dict() saved by this same rank of a run of the same
        world size; another rank's or another size's raises ValueError (here,
        or at the first sparse step when the process group does not exist
        yet), saying what to do."""
        if state.get("algorithm", self.algorithm) != self.algorithm:
            raise ValueError(f"checkpoint was made with algorithm {state['algorithm']!r}, this state uses {self.algorithm!r}")
        # The schedule is part of the run: a resumed run continues the saved
        # one (a checkpoint from before schedules existed keeps this state's).
        schedule = check_schedule(state["density_schedule"], self.density) if "density_schedule" in state else self.density_schedule
        previous = self._owner
        self._owner = None if state.get("world_size") is None else (int(state["rank"]), int(state["world_size"]))
        try:
            self._check_owner()
        except ValueError:
            self._owner = previous
            raise
        self.iter = int(state["iter"])
        self.density_schedule = schedule
        # So is the adaptation: where it stood, under the saved bounds.
        if state.get("adaptive") is not None:
            saved = state["adaptive"]
            self.adaptive = check_adaptive(saved["bounds"], self.tau_prime)
            self._adaptive = AdaptiveControl(self.adaptive, self.density, self.tau_prime)
            self._adaptive.load_state_dict(saved)
            self.measure_xi_every = saved["measure_xi_every"]
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
            "value_dtype": self.value_dtype,
            "stochastic_rounding": self.stochastic_rounding,
            "measure_xi_every": self.measure_xi_every,
        }

    def __setstate__(self, state):
        # A state pickled before warm-ups of 1 were refused: its iterations
        # past the warm-up are unaffected by the longer one.
        warmup_iters = max(state["warmup_iters"], 2)
        OkTopkState.__init__(self, None, state["density"], state["algorithm"], warmup_iters, state["tau"], state["tau_prime"], state["timeout"],
                             state.get("value_dtype", "float32"), state.get("stochastic_rounding", False),
                             state.get("density_schedule"), state.get("measure_xi_every"),
                             None if state.get("adaptive") is None else state["adaptive"]["bounds"])
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
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []
        self._used = {i: None for i in self._used}


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
    rebuilt = state._hook_iters > 0  # not DDP's first, provisional, layout
    if is_last:
        state.iter += 1
        state._hook_iters += 1
    members = state._members(bucket)  # numbers the parameters in the first layout
    sparse = phase_iter >= state.warmup_iters
    unused = state._take_unused(members, tensor if sparse else None)
    if not sparse:
        if rebuilt:
            state._learn_group([i for i, _, _ in members])
        group = state.process_group
        world = dist.get_world_size(group)
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(world))
    state._communicator()
    call = state._call(phase_iter)
    if state._adaptive is None:
        state.last_density = state.density if call[0] is None else call[0]
    if tensor.device.type == "cuda":
        # The worker copies on the stream backward produced the bucket on;
        # the future's CUDA events make DDP wait for the copy back.
        fut = torch.futures.Future(devices=[tensor.device])
        stream = torch.cuda.current_stream(tensor.device)
    else:
        fut, stream = torch.futures.Future(), None
    group_id = state._learn_group([i for i, _, _ in members])
    if group_id in state._groups:
        where = {i: (a, b) for i, a, b in members}
        slices = [where[i] + (i in unused,) for i in state._groups[group_id]]  # the group's layout
        state._worker.submit(state._reduce_bucket, group_id, tensor, slices, fut, stream, call)
    else:
        state._worker.submit(state._pool_bucket, tensor, members, unused, fut, stream, call)
    if is_last:
        state._worker.submit(state._flush_pool, call)
        if state._adaptive is not None and call[1] is not None:
            state._worker.submit(state._adapt, call[1])
    return fut
