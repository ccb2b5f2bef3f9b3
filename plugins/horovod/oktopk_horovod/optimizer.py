"""A Horovod distributed optimizer whose gradients travel through
liboktopk's sparse allreduce.

Like ``hvd.DistributedOptimizer`` it wraps a torch optimizer, hooks every
parameter's gradient accumulation, reduces gradients while backward goes on,
and waits for them in ``synchronize()`` (called by ``step()``). Differences,
and why:

* Parameters are grouped into buckets in the order of their *names*, which
  every rank agrees on (checked at construction), and each bucket keeps its
  own residual and thresholds inside liboktopk under an id derived from its
  parameter names; so the same bucket means the same thing on every rank, in
  every step and after a restart.
* Buckets are issued to the library strictly in bucket order, from one
  worker thread, whatever order autograd finishes them in: every rank then
  makes the same calls in the same order.
* The library computes the average over ranks; ``op=hvd.Sum`` scales it back.
  ``gradient_predivide_factor`` (Average only) needs no work: the library
  sums in float32 and divides once, so the result is the same average.
* Sparse gradients (``nn.Embedding(sparse=True)``) are made dense when
  ``sparse_as_dense=True``, as in Horovod, and reduced like every other
  gradient; otherwise they are refused with a message saying so (Horovod
  would allgather them, which is not a sparse allreduce).
"""

import contextlib
import threading
import warnings

import horovod.torch as hvd
import torch

from oktopk import log
from oktopk.adaptive import AdaptiveControl
from oktopk.checkpoint import check_link, check_version
from oktopk.choice import NATIVE, SPARSE, StepChoice, debug_enabled
from oktopk.momentum import MOMENTUM_OPTIMIZER, MomentumCorrection
from oktopk import device as device_path_
from oktopk.optimizers import HOROVOD_DEMO_LINE, adam_family, dense_notice, family_seen, sparse_warning
from oktopk.path_sparse import save_group
from oktopk.reducer import Reducer, ReducerStats, StepFolds
from oktopk.schedule import check_schedule, density_at
from oktopk.settings import check_checksum, with_checksum

from .buckets import check_ranks_agree, make_buckets, parameters_by_name, reduce_bucket
from .compression import OkTopkCompressor
from .collectives import HorovodCollectives, check_owner

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb
CHECKPOINT_VERSION = 1  # the layout of oktopk_state_dict(): each of its fields always written


def DistributedOptimizer(
    optimizer,
    named_parameters=None,
    compression=hvd.Compression.none,
    backward_passes_per_step=1,
    op=hvd.Average,
    gradient_predivide_factor=1.0,
    num_groups=0,
    groups=None,
    sparse_as_dense=False,
    process_set=hvd.global_process_set,
    bucket_bytes=BUCKET_BYTES,
):
    """``hvd.DistributedOptimizer`` with one more compression choice:
    given ``Compression.oktopk(...)`` the gradients are reduced by
    liboktopk's sparse allreduce; given anything else this *is*
    ``hvd.DistributedOptimizer``."""
    if not isinstance(compression, OkTopkCompressor):
        return hvd.DistributedOptimizer(
            optimizer,
            named_parameters=named_parameters,
            compression=compression,
            backward_passes_per_step=backward_passes_per_step,
            op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            num_groups=num_groups,
            groups=groups,
            sparse_as_dense=sparse_as_dense,
            process_set=process_set,
        )
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError("oktopk: op must be hvd.Average or hvd.Sum (Adasum is not a sparse reduction)")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step!r}")
    if num_groups or groups is not None:
        raise ValueError("oktopk: num_groups/groups are not supported; buckets are formed by bucket_bytes")
    if process_set is not hvd.global_process_set:
        raise ValueError("oktopk: only the global process set is supported")
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, ReducerStats), dict(_SparseDistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op, bucket_bytes, sparse_as_dense)


class _SparseDistributedOptimizer(torch.optim.Optimizer, ReducerStats):
    # Mixed into the wrapped optimizer's own class (as Horovod does), so
    # isinstance checks, param_groups and state_dict behave as before. Its
    # statistics (bytes_sent, algorithm_counts, last_xi...) are its
    # reducer's (ReducerStats), as the DDP state's are.

    def __init__(self, params, named_parameters, compressor, backward_passes_per_step, op, bucket_bytes, sparse_as_dense):
        super(self.__class__, self).__init__(params)
        self._compressor = compressor
        self._sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = backward_passes_per_step
        self._op = op
        # Every collective outside the library's transport: Horovod's.
        self._collectives = HorovodCollectives("oktopk")
        named = parameters_by_name(self.param_groups, named_parameters)
        check_ranks_agree([name for name, _ in named])
        self._buckets = make_buckets(named, bucket_bytes)
        self._bucket_bytes = bucket_bytes
        self._bucket_of = {}
        for bucket in self._buckets:
            for p in bucket.params:
                self._bucket_of[p] = bucket
        # Steps whose gradients were reduced (the density schedule's and ξ's
        # step count, saved by oktopk_state_dict), the schedule, the density
        # and τ′ of the latest step.
        self.sparse_step = 0
        self.density_schedule = compressor.density_schedule
        self.last_density = None
        self.last_tau_prime = None
        self._measure_xi_every = compressor.measure_xi_every
        # The communicator, the worker thread that issues the buckets to it
        # in bucket order on every rank, and the calls' statistics.
        adaptive = compressor.adaptive
        self._reducer = Reducer(None if adaptive is None else AdaptiveControl(adaptive, compressor.density, compressor.tau_prime))
        # Bucket states saved when the measured choice released an idle
        # communicator, and the link "auto" chose by: the next one keeps both.
        self._pending_state, self._link = {}, None
        # With algorithm None, the measured choice between Horovod's own
        # allreduce and the sparse one (oktopk.choice): the path of the step
        # under way, decided where the step before it ended, and the buckets
        # whose residual a sparse step may have left non-zero.
        self._choice = None
        self._path = SPARSE
        self._residual_groups = set()
        # What this step's folds took from the residuals, given back when
        # its sum turns out non-finite (the step is then skipped).
        self._folds = StepFolds()
        # The buckets the library holds a state of (a sparse call or a load
        # made one): only those are saved, in checkpoints and on release.
        self._stateful_ids = set()
        # The device path's buckets (oktopk.device.DeviceGroup: residual on
        # the gradients' device), the buckets whose library state holds its
        # residual (a checkpoint loaded), and the pairs' host memory.
        self._device_groups = {}
        self._library_ids = set()
        self._host_buffers = device_path_.HostBuffers()
        # Before any collective the settings decide (the choice's first
        # agreement, the communicator's setup): every rank must hold them
        # alike. A load sets this again: the first gradient hook after it
        # agrees before issuing a bucket.
        self._agree_on_settings()
        # An Adam-family optimizer keeps Horovod's allreduce with algorithm
        # None, and is warned about with a named one (oktopk.optimizers).
        adam = adam_family(self)
        if adam is not None and compressor.algorithm is not None:
            warnings.warn(sparse_warning(adam), stacklevel=3)
        if compressor.algorithm is None:
            self._choice = StepChoice(compressor.sparse_margin, compressor.recheck_every)
            collectives, cpu = self._collectives, torch.device("cpu")
            self._choice.agree = lambda values: collectives.max(values, cpu)
            self._choice.adam_seen = lambda: adam
            if debug_enabled() and self._collectives.rank() == 0:
                self._choice.log = log.decisions()
            # This step's time starts here, in no step's path: untimed.
            self._path = self._choice.begin_step(self.sparse_step, untimed=True)
        # Momentum correction (oktopk.momentum) when this optimizer is SGD
        # averaging: parameters numbered in bucket order (by name, alike on
        # every rank and across restarts).
        self._momentum = None
        if compressor.momentum_correction and isinstance(self, MOMENTUM_OPTIMIZER) and op == hvd.Average:
            index = {p: i for i, p in enumerate(p for bucket in self._buckets for p in bucket.params)}
            self._momentum = MomentumCorrection(index.get)
        self._reducer.start(self._make_communicator())
        # Guards the hooks' count of final gradients and the issue of buckets.
        self._lock = threading.Lock()
        self._should_synchronize = True
        self._synchronized = False
        self._grad_accs = []
        self._reset_step()
        if self._collectives.size() > 1:
            self._register_hooks()

    # -- hooks: a bucket is issued once every gradient in it is final -------

    def _reset_step(self):
        self._passes = {p: 0 for p in self._bucket_of}
        for bucket in self._buckets:
            bucket.pending = len(bucket.params)
            bucket.future = None
        self._next_bucket = 0

    def _register_hooks(self):
        for p in self._bucket_of:
            if p.requires_grad:
                # The gradient accumulator's hook runs once p.grad is final
                # for this backward pass (Horovod's way, before torch had
                # post-accumulate-grad hooks).
                grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
                grad_acc.register_hook(self._make_hook(p))
                self._grad_accs.append(grad_acc)

    def _make_hook(self, p):
        def hook(*ignore):
            with self._lock:
                if self._passes[p] >= self.backward_passes_per_step:
                    raise AssertionError(
                        "Gradients were computed more than backward_passes_per_step times before "
                        "optimizer.step() or optimizer.synchronize(); raise backward_passes_per_step "
                        "to accumulate gradients locally."
                    )
                if self._agreement_due:
                    self._agree_on_settings()
                self._passes[p] += 1
                if self._passes[p] == self.backward_passes_per_step:
                    self._bucket_of[p].pending -= 1
                    self._issue_ready_buckets()

        return hook

    def _issue_ready_buckets(self):
        # Strictly in bucket order: the same calls in the same order on
        # every rank, whatever order autograd finished the buckets in.
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].pending == 0:
            bucket = self._buckets[self._next_bucket]
            bucket.future = self._reducer.submit(self._reduce, bucket, NATIVE if self._path == NATIVE else self._call())
            self._next_bucket += 1

    def _call(self):
        """(density or None, ξ step or None, τ′ or None) of this step's
        calls, the same on every rank (the step count is, and the adaptation
        its ranks agreed on). Not oktopk.path_sparse.call_for: the step
        count here is sparse_step (Horovod has no dense warm-up to count
        from), and the adapted density and τ′ are read here, when the
        bucket is issued, where the DDP hook's worker thread reads them at
        the call."""
        step, every = self.sparse_step, self._measure_xi_every
        density = None if self.density_schedule is None else density_at(self.density_schedule, self._compressor.density, step)
        tau_prime = None
        adaptive = self._reducer.adaptive
        if adaptive is not None:  # adapted in synchronize(), between steps
            density, tau_prime = adaptive.density, adaptive.tau_prime
            self.last_tau_prime = tau_prime
        self.last_density = self._compressor.density if density is None else density
        return density, (step if every is not None and step % every == 0 else None), tau_prime

    def _reduce(self, bucket, call):
        """Worker thread: the bucket's gradients replaced by their average,
        through the path of ``call``; with momentum correction each
        parameter's velocity step goes in and the gradient on which the
        optimizer's momentum lands on the average comes out."""
        for p in bucket.params:
            if p.grad.is_sparse and self._sparse_as_dense:
                p.grad = p.grad.to_dense()
        correction = self._momentum
        if correction is None or not correction.active or any(p.grad.is_sparse or not p.grad.is_contiguous() for p in bucket.params):
            reduce_bucket(self, bucket, call)
            return
        if bucket.index == 0:
            correction.begin_step()
        work = [(p, correction.before([p], [(correction.index_of(p), 0, p.numel())], p.grad.view(-1))) for p in bucket.params]
        reduce_bucket(self, bucket, call)
        for p, w in work:
            if w is not None:
                correction.after(w, p.grad.view(-1))

    def _agreement_settings(self):
        """The settings that decide which collectives a rank issues and
        when, with where the run stands (a resumed one: its step and
        choice): what every rank must hold alike."""
        c, choice = self._compressor, self._choice
        return {
            "density": c.density, "algorithm": c.algorithm, "tau": c.tau, "tau_prime": c.tau_prime, "value_dtype": c.value_dtype,
            "stochastic_rounding": c.stochastic_rounding, "density_schedule": self.density_schedule,
            "measure_xi_every": self._measure_xi_every, "adaptive": c.adaptive, "sparse_margin": c.sparse_margin,
            "recheck_every": c.recheck_every, "device_path": c.device_path, "momentum_correction": c.momentum_correction,
            "optimizer_family": family_seen(adam_family(self)), "op": str(self._op), "backward_passes_per_step": self.backward_passes_per_step,
            "bucket_bytes": self._bucket_bytes, "buckets": len(self._buckets), "step": self.sparse_step,
            "choice": None if choice is None else (choice.chosen, choice.candidate, choice.decided_at, choice.confirm_at, self._path),
        }

    def _agree_on_settings(self):
        if self._collectives.size() > 1:
            self._collectives.check_agreement(self._agreement_settings(), torch.device("cpu"))
        self._agreement_due = False

    # -- Horovod's optimizer interface --------------------------------------

    def synchronize(self):
        """Wait until every gradient has been reduced. Parameters that got
        no gradient this step are reduced as zeros, as Horovod does, so every
        rank makes the same calls."""
        if self._collectives.size() > 1:
            with self._lock:
                for bucket in self._buckets[self._next_bucket :]:
                    for p in bucket.params:
                        if self._passes[p] < self.backward_passes_per_step:
                            if p.grad is None:
                                p.grad = torch.zeros_like(p)
                            self._passes[p] = self.backward_passes_per_step
                            bucket.pending -= 1
                self._issue_ready_buckets()
            try:
                for bucket in self._buckets:
                    bucket.future.result()
                if self._folds.folded and self._path == NATIVE:  # a NaN shows in the folded sum, on every rank
                    self._folds.watching = True
                    for bucket in self._buckets:
                        for p in bucket.params:
                            self._folds.see(p.grad)
                # A step that came back non-finite is skipped: what its folds
                # and its other buckets' calls took goes back (StepFolds).
                self._folds.settle()
                if (self._reducer.adaptive is not None and self.sparse_step % self._measure_xi_every == 0
                        and self._reducer.comm is not None):
                    # Every call of the step is done: the reducer's
                    # communicator is free for the drift's allreduce.
                    self._reducer.adapt(self.sparse_step)
                self.sparse_step += 1
                if self._choice is not None:
                    # The step just reduced ends here: time it, and choose
                    # the path of the next one (every rank, at the same step).
                    previous, kept_dense = self._path, self._choice.kept_dense_for
                    self._path = self._choice.begin_step(self.sparse_step)
                    if kept_dense is None and self._choice.kept_dense_for is not None and self._collectives.rank() == 0:
                        log.notice(dense_notice(self._choice.kept_dense_for, demo_line=HOROVOD_DEMO_LINE))
                    self._follow_path(previous)
            finally:
                self._reset_step()
        self._synchronized = True

    def _make_communicator(self):
        """The communicator over every Horovod rank, its endpoints exchanged
        through Horovod's own collectives (every rank at the same point)."""
        s = self._compressor.settings
        comm = self._collectives.communicator(
            "auto" if s.algorithm is None else s.algorithm,  # the measured choice's sparse path
            s.density, s.wire.tau, s.wire.tau_prime, s.timeout, value_dtype=s.wire.value_dtype,
            stochastic_rounding=s.wire.stochastic_rounding)
        if self._link is not None:
            comm.set_link(self._link)
        return comm

    def _follow_path(self, previous):
        """Between steps, on every rank alike (the path is agreed): once
        native is chosen and a native step has folded every residual in, save
        the buckets' states and destroy the idle communicator (its sockets
        would still wake their threads); before the next sparse step make a
        new one and load them. The worker thread stays: native buckets run
        on it too."""
        reducer = self._reducer
        if (reducer.comm is not None and previous == NATIVE and self._path == NATIVE and self._choice.chosen == NATIVE
                and not self._residual_groups):
            reducer.drain()
            self._pending_state = {tensor_id: save_group(reducer.comm, self._device_groups, tensor_id) for tensor_id in sorted(self._stateful_ids)}
            self._device_groups = {}  # their residuals are in the saved states, loaded again at the next sparse step
            self._link = reducer.comm.link() or self._link
            reducer.comm.destroy()
            reducer.comm = None
        elif reducer.comm is None and self._path == SPARSE:
            reducer.comm = self._make_communicator()
            for tensor_id, blob in self._pending_state.items():
                reducer.comm.load_tensor_state(tensor_id, blob)
            self._library_ids |= set(self._pending_state)
            self._pending_state = {}

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For code that calls ``synchronize()`` itself (gradient clipping):
        ``step()`` inside this context does not synchronize again."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                import warnings

                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code."
                )
            self.synchronize()
        self._synchronized = False
        loss = super(self.__class__, self).step(closure)
        if self._momentum is not None:
            self._momentum.stepped(self)
        return loss

    def zero_grad(self, *args, **kwargs):
        if any(bucket.future is not None for bucket in self._buckets):
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                "or optimizer.synchronize(). This is prohibited as it can cause a race condition."
            )
        return super(self.__class__, self).zero_grad(*args, **kwargs)

    # -- checkpointing of the sparse state ------------------------------------

    def oktopk_state_dict(self):
        """Every bucket's residual and thresholds, the rank and world size
        they belong to, the step count with the density schedule, and where
        the adaptation stands, to save beside the optimizer's
        ``state_dict()`` so a resumed run continues exactly. Every rank saves
        its own."""
        self._reducer.drain()
        if self._reducer.comm is None:  # released while native is chosen
            tensors = dict(self._pending_state)
        else:
            tensors = {tensor_id: save_group(self._reducer.comm, self._device_groups, tensor_id) for tensor_id in sorted(self._stateful_ids)}
            self._link = self._reducer.comm.link() or self._link
        return with_checksum({"version": CHECKPOINT_VERSION, "link": self._link, "rank": self._collectives.rank(), "world_size": self._collectives.size(), "tensors": tensors, "step": self.sparse_step,
                "density_schedule": self.density_schedule,
                "adaptive": self._reducer.adaptive_state(self._measure_xi_every),
                "choice": None if self._choice is None else {**self._choice.state_dict(), "path": self._path},
                "residual_ids": sorted(self._residual_groups),
                "momentum": {} if self._momentum is None else self._momentum.state_dict()})

    def load_oktopk_state_dict(self, state):
        """Restore this rank's ``oktopk_state_dict()``. Another rank's, or
        one saved at another world size, raises ValueError: residuals are
        each rank's own unsent gradients and cannot be repartitioned. So
        does one whose checksum fails (a field or byte changed since it was
        saved)."""
        check_checksum(state, "oktopk_horovod")
        check_version(state, CHECKPOINT_VERSION, "oktopk_horovod")
        check_owner(state["rank"], state["world_size"])
        tensors = state["tensors"]
        # The schedule and its step count are part of the run: a resumed run
        # continues the saved one.
        schedule = check_schedule(state["density_schedule"], self._compressor.density)
        ids = {bucket.tensor_id for bucket in self._buckets}
        for tensor_id in tensors:
            if tensor_id not in ids:
                raise ValueError(f"oktopk: checkpoint holds bucket {tensor_id:#x}, which this model does not have")
        if self._reducer.comm is None:
            self._pending_state = dict(tensors)
        else:
            for tensor_id, blob in tensors.items():
                self._reducer.comm.load_tensor_state(tensor_id, blob)
                self._device_groups.pop(tensor_id, None)
            self._library_ids |= set(tensors)
        self.density_schedule = schedule
        self.sparse_step = int(state["step"])
        # So is the adaptation: where it stood, under the saved bounds.
        if state["adaptive"] is not None:
            self._measure_xi_every = self._reducer.load_adaptive(state["adaptive"], self._compressor.density, self._compressor.tau_prime)
        # And the measured choice: the next step's path, and the decisions.
        if self._choice is not None and state["choice"] is not None:
            self._choice.load_state_dict(state["choice"])
            self._path = state["choice"]["path"]
        self._link = check_link(state["link"])  # None: measure anew
        if self._link is not None and self._reducer.comm is not None:
            self._reducer.comm.set_link(self._link)
        self._residual_groups = set(state["residual_ids"])
        self._stateful_ids = set(tensors.keys())
        if self._momentum is not None:
            self._momentum.load_state_dict(state["momentum"])
        # What decides the collectives may have changed (the step, the
        # choice): the next step's first gradient hook agrees again.
        self._agreement_due = True

    @property
    def choice(self):
        """With ``Compression.oktopk(algorithm=None)``: what the optimizer
        chose and why (see ``OkTopkState.choice``); else None."""
        return None if self._choice is None else self._choice.summary()

    def close(self):
        """Release the worker thread and the communicator. Call it when
        training ends; an optimizer never closed releases them only when
        it is garbage-collected (nothing is registered to run at
        interpreter exit)."""
        self._reducer.close()
