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

It is an adapter: the step (the measured choice, each bucket's reduction
through its path with the residual folded in on a native one, the momentum
correction, the take-back of a non-finite step, the adaptation, the
checkpoint) is the engine's (``oktopk.Engine``, its fixed groups), reached
through Horovod's collectives (``oktopk_horovod.collectives``). What is
Horovod's own stays here: the buckets and their names, the gradient hooks,
the order buckets are issued in, ``synchronize()`` and ``step()``.
"""

import contextlib
import os
import threading

import horovod.torch as hvd
import torch

import oktopk
from horovod.common.exceptions import HorovodInternalError
from oktopk import OkTopkError

from .buckets import check_ranks_agree, make_buckets, parameters_by_name
from .collectives import HorovodCollectives, check_owner
from .compression import OkTopkCompressor

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb
# The line the notice of an Adam-family optimizer suggests.
DEMO_LINE = "opt = oktopk_horovod.DeMo(model.parameters(), lr=3e-3, weight_decay=0.01)"


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
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_SparseDistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op, bucket_bytes, sparse_as_dense)


class _SparseDistributedOptimizer(torch.optim.Optimizer):
    # Mixed into the wrapped optimizer's own class (as Horovod does), so
    # isinstance checks, param_groups and state_dict behave as before. Its
    # statistics (bytes_sent, algorithm_counts, last_xi...) are its
    # engine's, as the DDP state's are.

    def __init__(self, params, named_parameters, compressor, backward_passes_per_step, op, bucket_bytes, sparse_as_dense):
        super(self.__class__, self).__init__(params)
        self._sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = backward_passes_per_step
        self._average = op == hvd.Average
        named = parameters_by_name(self.param_groups, named_parameters)
        self._names = [name for name, _ in named]
        self._buckets = make_buckets(named, bucket_bytes)
        self._bucket_of = {}
        for bucket in self._buckets:
            for p in bucket.params:
                self._bucket_of[p] = bucket
        self._compressor = compressor
        self._front = {"op": str(op), "backward_passes_per_step": backward_passes_per_step, "bucket_bytes": bucket_bytes}
        # The engine that owns the step (oktopk.Engine), its collectives
        # Horovod's: it agrees with the other ranks on its settings and on
        # this front end's (what decides the collectives each rank
        # issues), makes the communicator and names step 0's path.
        self.engine = self._new_engine()
        # Under horovodrun's elastic mode a worker that joins builds its
        # optimizer while the others are inside hvd.elastic.run's reset:
        # the engine starts (a collective) in the state's sync(), on every
        # rank at once (oktopk_horovod.elastic), or at the first backward.
        self._elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        self._started = False
        if not self._elastic:
            self._start(stacklevel=4)
        # Guards the hooks' count of final gradients and the issue of buckets.
        self._lock = threading.Lock()
        self._should_synchronize = True
        self._synchronized = False
        self._grad_accs = []
        self._reset_step()
        if self._elastic or self.engine.collectives.size() > 1:
            self._register_hooks()

    def _new_engine(self):
        return oktopk.Engine(self._compressor.settings, None, HorovodCollectives("oktopk"))

    @property
    def started(self):
        """Whether the engine has started (its settings agreed, its
        communicator made): at construction, or under horovodrun's elastic
        mode at the state's sync() or the first backward."""
        return self._started

    def _start(self, stacklevel=3):
        """Every rank at once: the ranks agree on the parameters' names, and
        the engine starts (its settings agreed, its communicator made)."""
        check_ranks_agree(self._names)
        self.engine.start_groups(self, [(bucket.tensor_id, bucket.params) for bucket in self._buckets], average=self._average,
                                 front=self._front, demo_line=DEMO_LINE, stacklevel=stacklevel)
        self._started = True

    def oktopk_restart(self, saved=None, held=None):
        """Every rank at once, after horovodrun's elastic mode re-formed the
        ranks (``oktopk_horovod.elastic.State.sync``): a new engine over the
        ranks as they are now, its communicator made afresh. ``saved``:
        this rank's ``oktopk_state_dict()`` of the last commit, or None. It
        is loaded where every rank holds one of its own rank and of this
        world size (each rank's residuals are its own); else every rank
        starts with empty residuals. ``held``: whether this rank held a
        state it passes as None (one of an older commit). Returns "loaded",
        "empty" (no rank held one: nothing lost) or "dropped" (some rank's
        was dropped)."""
        held = saved is not None if held is None else held
        if self._started:
            self.engine.close()
        self.engine = self._new_engine()
        self._started = False
        self._reset_step()
        if self.engine.collectives.size() == 1:
            return "dropped" if held else "empty"
        self._start()
        mine = saved is not None and saved.get("rank") == hvd.rank() and saved.get("world_size") == hvd.size()
        every = hvd.allgather_object((mine, held), name="oktopk.elastic.saved")
        if all(m for m, _ in every):
            self.load_oktopk_state_dict(saved)
            return "loaded"
        return "dropped" if any(held for _, held in every) else "empty"

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
            if self._elastic:
                if self.engine.collectives.size() == 1:
                    return  # one rank: its gradients are the average
                if not self._started:
                    self._start()  # no state's sync() came first: the first backward, on every rank
            with self._lock:
                if self._passes[p] >= self.backward_passes_per_step:
                    raise AssertionError(
                        "Gradients were computed more than backward_passes_per_step times before "
                        "optimizer.step() or optimizer.synchronize(); raise backward_passes_per_step "
                        "to accumulate gradients locally."
                    )
                self.engine.agree_if_due()
                self._passes[p] += 1
                if self._passes[p] == self.backward_passes_per_step:
                    self._bucket_of[p].pending -= 1
                    self._issue_ready_buckets()

        return hook

    def _issue_ready_buckets(self):
        # Strictly in bucket order: the same calls in the same order on
        # every rank, whatever order autograd finished the buckets in. The
        # call (the path, the sparse call's density) is fixed here.
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].pending == 0:
            bucket = self._buckets[self._next_bucket]
            bucket.future = self.engine.submit(self._reduce, bucket, self.engine.group_call())
            self._next_bucket += 1

    def _reduce(self, bucket, call):
        """The engine's worker thread: the bucket's gradients replaced by
        their average (or sum, under op=hvd.Sum), sparse ones made dense
        first where allowed."""
        for p in bucket.params:
            if p.grad.is_sparse:
                if not self._sparse_as_dense:
                    raise ValueError(
                        "oktopk: a parameter has a sparse gradient (nn.Embedding(sparse=True)); "
                        "pass sparse_as_dense=True to reduce it as a dense gradient"
                    )
                p.grad = p.grad.to_dense()
        self.engine.reduce_group(bucket.index, bucket.tensor_id, bucket.params, call, self._average)

    # -- Horovod's optimizer interface --------------------------------------

    def synchronize(self):
        """Wait until every gradient has been reduced. Parameters that got
        no gradient this step are reduced as zeros, as Horovod does, so every
        rank makes the same calls."""
        if self.engine.collectives.size() > 1:
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
                try:
                    for bucket in self._buckets:
                        bucket.future.result()
                except OkTopkError as e:
                    if self._elastic and e.lost_peer:
                        # A lost or silent rank: hvd.elastic.run restores the
                        # last commit and re-forms the ranks on this error.
                        raise HorovodInternalError(str(e)) from e
                    raise
                # The step ends here, on every rank alike: a non-finite one
                # is taken back, and the next one's path is chosen.
                self.engine.end_group_step(p.grad for bucket in self._buckets for p in bucket.params)
            finally:
                self._reset_step()
        self._synchronized = True

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
        self.engine.optimizer_stepped(self)
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
        the adaptation, the measured choice and the momentum correction
        stand, to save beside the optimizer's ``state_dict()`` so a resumed
        run continues exactly. Every rank saves its own."""
        return self.engine.groups_state_dict()

    def load_oktopk_state_dict(self, state):
        """Restore this rank's ``oktopk_state_dict()``. Another rank's, or
        one saved at another world size, raises ValueError: residuals are
        each rank's own unsent gradients and cannot be repartitioned. So
        does one whose checksum fails (a field or byte changed since it was
        saved)."""
        self.engine.load_groups_state_dict(state, "oktopk_horovod", check_owner)

    @property
    def sparse_step(self):
        """Steps whose gradients were reduced (the density schedule's and
        ξ's step count)."""
        return self.engine.iter

    @property
    def density_schedule(self):
        return self.engine.density_schedule

    @property
    def last_density(self):
        """The density of the latest step's sparse calls."""
        return self.engine.last_density

    @property
    def last_tau_prime(self):
        """The τ′ of the latest step's sparse calls (with ``adaptive``)."""
        return self.engine.last_tau_prime

    @property
    def choice(self):
        """With ``Compression.oktopk(algorithm=None)``: what the optimizer
        chose and why (see ``OkTopkState.choice``); else None."""
        return self.engine.choice

    def close(self):
        """Release the worker thread and the communicator. Call it when
        training ends; an optimizer never closed releases them only when
        it is garbage-collected (nothing is registered to run at
        interpreter exit)."""
        self.engine.close()


def _statistic(name):
    return property(lambda self: getattr(self.engine, name), doc=getattr(oktopk.Engine, name).__doc__)


# The engine's statistics (bytes_sent, algorithm_counts, last_xi...), as
# the optimizer's own attributes.
for _name in oktopk.Engine.STATISTICS:
    setattr(_SparseDistributedOptimizer, _name, _statistic(_name))
del _name
