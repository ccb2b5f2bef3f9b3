"""The engine: the one object that owns a step of the DDP hook
(``oktopk.hook``), of the FSDP2 registration (``oktopk.fsdp``) and of
Horovod's optimizer (``oktopk_horovod``, through ``oktopk.groups``), which
are adapters: each turns what its framework hands it (a DDP bucket, an
FSDP2 shard, a named group of parameters) into the engine's terms and
calls it. The ranks are reached through ``oktopk.collectives``.

A step, in the order the engine runs it:

1. **Settle the step before.** A step that came back non-finite on any
   rank (the script skipped the optimizer step) gives back what its groups'
   calls, folds and velocity steps took (``oktopk.reducer.StepFolds``).
2. **Begin.** The ranks agree on the settings (the first steps, and after a
   load; ``oktopk.step``); the measured choice (``oktopk.choice``) times the
   step before and names this step's path; the momentum correction
   (``oktopk.momentum``) begins its step.
3. **Reduce each bucket or shard through the step's path** (``oktopk.paths``:
   native, bf16, fp16, quantized, sparse). Before a path's step, every
   other path folds in what it holds (its residuals), so a switch of path
   loses nothing; under momentum correction the velocity's step is reduced
   in place of the gradient.
4. **Checkpoint** at any step boundary (``oktopk.checkpoint``).

Everything the step involves lives here (the residuals' groups, the
layout of the parameters, the choice, the correction, the worker thread);
only the engine's own modules (``ENGINE_MODULES``) read its private
attributes.
"""

import torch
import torch.distributed as dist

from . import callbacks, checkpoint, continuing, groups
from . import device as device_path_
from .adaptive import AdaptiveControl
from .choice import StepChoice
from .collectives import ProcessGroupCollectives
from .peer_errors import peer_failures_named
from .layout import BucketLayout
from .momentum import MomentumCorrection
from .optimizers import DEMO_LINE, OptimizerWatch
from .path_native import BucketGrads
from .paths import NATIVE, PATHS, SPARSE, SUPPORTED_DTYPES
from .reducer import Reducer, ReducerStats, StepFolds
from .settings import AUTO_MASKING, FLAT, NATIVE_WARMUP_ITERS, Settings, masking_rule
from .step import agree_on_settings, begin_step
from .survivors import ContinuingCollectives

# The modules that make up the engine: they alone read its private
# attributes (tests/python/test_engine_boundary.py counts the others').
ENGINE_MODULES = ("engine", "state", "step", "checkpoint", "groups", "paths", *(f"path_{name}" for name in PATHS), "momentum", "masking", "reducer",
                  "continuing")


def _setting(name):
    group, field = FLAT[name]
    if group is None:
        return property(lambda self: getattr(self._settings, field), doc=f"The ``{name}`` setting (read-only).")
    return property(lambda self: getattr(getattr(self._settings, group), field), doc=f"The ``{name}`` setting (read-only).")


class Engine(ReducerStats):
    """The step's owner (see the module's docstring).
    :class:`oktopk.OkTopkState` is one, for the DDP hook and FSDP2; a front
    end of its own makes one with ``Engine(settings, process_group,
    collectives)``: ``settings`` an :class:`oktopk.Settings`,
    ``collectives`` the :class:`oktopk.Collectives` it reaches the ranks
    through (``None``: ``process_group``'s, torch.distributed's). Horovod's
    optimizer (``oktopk_horovod``) hands it fixed groups of parameters
    (:meth:`start_groups`, :meth:`reduce_group`)."""

    __slots__ = [
        "_settings", "process_group", "_collectives", "iter", "last_density", "last_tau_prime", "_reducer", "_layout", "_pending_state", "_hook_iters",
        "_owner", "_adapt_error", "_choice", "_path", "_residual_groups", "_pooled_iter", "_optimizers", "_device_groups",
        "_library_groups", "_host_buffers", "_quantized", "_quantized_bytes", "_quantized_spill", "_bucket_grads", "_momentum",
        "_agreement_steps", "_folds", "_communicator_at_load", "_link", "_measured_step", "_shard_step", "_new_shard_step",
        "_shard_steps_run", "_shard_slices", "_shard_device", "_group_ids", "_group_front", "_demo_line", "_stateful_groups",
        "_continuing", "_void", "_rank_losses", "_pending_regrouped", "_rejoin", "_rank_joins",
    ]

    def __init__(self, settings, process_group, collectives=None):
        self._settings = settings
        self.process_group = process_group
        # Who the ranks are, the agreements, the communicator's rendezvous
        # (oktopk.collectives): the process group's unless a front end
        # without one gives its own.
        self._collectives = ProcessGroupCollectives(process_group) if collectives is None else collectives
        # on_rank_loss="continue" (oktopk.continuing): the survivors of a lost
        # rank go on; the step it was lost in (step, error) is void until
        # they do, and each loss is recorded.
        self._continuing = settings.faults.on_rank_loss == "continue"
        self._void = None
        self._rank_losses = []
        self._pending_regrouped = False
        # What a rank that comes back is handed: (state_dict, load_state_dict)
        # of the script's own state (rejoin_state), and each join recorded.
        self._rejoin = None
        self._rank_joins = []
        if self._continuing:
            if collectives is not None:
                raise ValueError("on_rank_loss='continue' runs on the DDP hook (OkTopkState): a front end with collectives "
                                 "of its own (Horovod's optimizer) reduces over its framework's, which cannot go on without a "
                                 "lost rank; use Horovod's elastic mode there (docs/failures.md)")
            self._collectives = ContinuingCollectives(process_group)
        self._bucket_grads = BucketGrads()
        # The device path's groups (oktopk.device.DeviceGroup: residual on
        # the device), the groups whose state the library holds with the
        # residual in it (loaded from a checkpoint), and the host memory of
        # the device path's pairs.
        self._device_groups = {}
        self._library_groups = set()
        self._host_buffers = device_path_.HostBuffers()
        # The parameters' canonical numbering, which the momentum
        # correction (oktopk.momentum) keys its velocities by.
        self._layout = BucketLayout()
        self._momentum = None
        m = settings.momentum
        if m.correction:
            index = self._layout.param_index
            rule, steps = masking_rule(m.masking, m.correction, settings.wire.value_dtype)
            self._momentum = MomentumCorrection(lambda p: index.get(id(p)), rule, m.local_clip_norm,
                                                lambda: self._collectives.size(), masking_steps=steps)
        # algorithm None: the measured choice, whose sparse path is "auto",
        # and a compressed dense path for an Adam-family optimizer's
        # parameters (oktopk.optimizers); a named algorithm warns about one.
        # Every SGD step reaches the correction.
        self._optimizers = OptimizerWatch(warn=settings.algorithm is not None,
                                          on_momentum=None if self._momentum is None else self._momentum.stepped,
                                          void=(lambda optimizer, watched: continuing.void_grads(self, optimizer, watched))
                                          if self._continuing else None)
        c = settings.choice
        self._choice = None
        if settings.algorithm is None:
            self._choice = StepChoice(c.sparse_margin, c.recheck_every, adam_candidate=c.dense_compression, sparse=c.sparse,
                                      sparse_after=c.sparse_after)
            watch = self._optimizers
            self._choice.adam_seen = lambda: watch.seen
        # The quantized path's residuals per group of parameters (library
        # tensor id), and a native step's fold of them: each parameter's
        # share of what its group held, until its bucket comes.
        self._quantized = {}
        self._quantized_bytes = 0
        self._quantized_spill = {}
        self.iter = 0
        # The density and τ′ of the latest sparse step (τ′ with adaptive only).
        self.last_density = None
        self.last_tau_prime = None
        # The communicator (made at the first sparse step), its worker
        # thread, and the statistics of its calls (ReducerStats).
        a = settings.adaptation
        self._reducer = Reducer(None if a.adaptive is None else AdaptiveControl(a.adaptive, settings.density, settings.wire.tau_prime))
        # Residuals and thresholds loaded before the communicator existed.
        self._pending_state = {}
        # The link model "auto" chose by (a dict, or None before one was
        # measured): a communicator made again, or a resumed run, gets this
        # one rather than a new measurement that may choose otherwise.
        self._link = None
        # Iterations this process has run through the hook: DDP's first one
        # (0 here) uses its provisional bucket layout, every later one the
        # rebuilt layout, whatever iter a checkpoint resumed from.
        self._hook_iters = 0
        # (rank, world size) a loaded checkpoint belongs to, until checked
        # against this process's (at load, or at communicator setup when the
        # process group did not exist yet at load).
        self._owner = None
        # An adaptation's failure (worker thread), raised by the next bucket.
        self._adapt_error = None
        # The path of the step under way (algorithm None), and the groups
        # whose residual a sparse step may have left non-zero: a step of
        # another path folds those in first.
        self._path = SPARSE
        self._residual_groups = set()
        # The latest iteration that sent a bucket to the regrouping pool.
        self._pooled_iter = None
        # Steps still to begin with the ranks' agreement on the settings
        # (agree_on_settings): the first, where nothing yet depends on them,
        # and the next, once the optimizer has stepped (the family seen).
        self._agreement_steps = 2
        # What this step's folds took from the residuals, given back if its
        # dense sum turns out non-finite (the step is then skipped).
        self._folds = StepFolds()
        # Where a loaded checkpoint's run had its communicator (made at a
        # sparse step, not released since): the path of the step it was
        # saved after, until this run's first step after the warm-up; else
        # None. A native step there makes the communicator again and folds
        # the residuals through it, as that run did.
        self._communicator_at_load = None
        # FSDP2's step: the step under way (iter when it began), whether the
        # next shard begins a new one (a forward of the root module), the
        # steps run in this process, a step whose ξ was measured with the
        # adaptive control (adapted when the next one begins), and each
        # module's parameters and their slices of its flat shard for the
        # momentum correction.
        self._shard_step = None
        self._new_shard_step = True
        self._shard_steps_run = 0
        self._measured_step = None
        self._shard_slices = None
        self._shard_device = None
        # Fixed groups (oktopk.groups, Horovod's optimizer): their ids in
        # the order they are issued, the front end's own settings agreed
        # with the engine's, the line an Adam notice suggests, and the
        # groups the library holds a state of (a sparse call or a load
        # made one): only those are saved.
        self._group_ids = []
        self._group_front = {}
        self._demo_line = None
        self._stateful_groups = set()

    @property
    def settings(self):
        """The :class:`oktopk.Settings` this engine runs by (immutable)."""
        return self._settings

    @property
    def collectives(self):
        """The :class:`oktopk.Collectives` this engine reaches the ranks
        through."""
        return self._collectives

    # ---------------------------------------------------------------- DDP

    def reduce_bucket(self, bucket):
        """A DDP bucket's future: the average of the bucket's gradients over
        the ranks, by the step's path (the DDP hook's whole work)."""
        tensor = bucket.buffer()
        check_tensor(tensor, "oktopk_hook: unsupported bucket")
        correction = self._momentum
        if bucket.index() == 0:
            self._begin_bucket_step(tensor)
        if self._void is not None:
            return continuing.void_bucket(self, bucket, tensor)  # the step lost a rank: on_rank_loss="continue"
        step = self.iter
        work = None
        if correction is not None and correction.active and not correction.idle:
            # Momentum correction (oktopk.momentum): every path below reduces
            # the velocity's step in place of the gradient, and the optimizer
            # gets the G on which its own momentum lands on the average.
            work = correction.before(bucket.parameters(), self._layout.members(bucket), tensor)
        # A failed step (a dead or silent peer) raises, here or from the
        # future; what its buckets that completed before took (their calls,
        # folds and velocity steps) is given back on this rank first.
        try:
            fut = self._reduce_bucket(bucket, tensor)
        except BaseException as error:
            self._folds.fail(error)
            if continuing.lost_a_rank(self, error, step):
                return continuing.done(tensor)
            raise
        if work is None and not self._folds.folded and not self._continuing:
            return fut  # nothing of the step taken so far: nothing to give back (a native step's hot path as before)

        def finish(f):
            try:
                reduced = f.value()
            except BaseException as error:
                self._folds.fail(error)
                if continuing.lost_a_rank(self, error, step):
                    return tensor  # a void step's: its optimizer step steps nothing
                raise
            return reduced if work is None else correction.after(work, reduced)

        return callbacks.then(fut, finish)

    def _begin_bucket_step(self, tensor):
        """At a step's first bucket, before anything of the step reads a
        residual or a velocity."""
        if self._continuing:
            if self._void is not None:
                continuing.go_on(self)  # the step before lost a rank: the survivors go on without it
            continuing.admit_if_due(self)  # ranks that came back join here
        # A step before that came back non-finite anywhere (a NaN in one
        # group skipped it on every rank, and the script skipped the
        # optimizer step) gives back what its other groups' calls, folds
        # and velocity steps took, on every rank alike (StepFolds).
        self._settle_step()
        correction = self._momentum
        if correction is not None:
            correction.record_step(self._folds)
        if self._agreement_steps:
            agree_on_settings(self, tensor.device)
        self._begin_choice(self.iter, tensor.device, untimed=self._hook_iters == 0)
        if correction is not None and correction.active:
            correction.begin_step(idle=self._dense_with_nothing_waiting(self.iter))

    def _settle_step(self):
        """Between steps: a step that came back non-finite anywhere gives
        back what it took (StepFolds.settle) and does not count: ``iter``
        goes back to it, so the warm-up, the schedules and the choice go on
        as if its batch had never been taken, on every rank alike (the
        verdict is)."""
        if self._folds.settle():
            self.iter -= 1

    def _begin_choice(self, step, device, untimed):
        """The measured choice's path of step ``step`` (timing the one
        before), before anything of the step is reduced."""
        choice = self._choice
        if choice is None:
            return
        if step >= self.warmup_iters:
            # The step before was settled at this step's start.
            begin_step(self, step - self.warmup_iters, device, untimed=untimed)
            self._folds.watching = self._path == NATIVE and any(path.holds(self) for path in PATHS.values())
        elif step == self.timed_warmup_step():
            # A native step the choice can compare the sparse probe with.
            # A process resumed from a checkpoint saved before it runs it
            # first, in DDP's provisional layout (dense all the same): timed
            # too, or the resumed run would decide without it where the
            # whole run did not.
            choice.time_warmup_step()
        elif step == self.timed_warmup_step() + 1:
            choice.end_warmup_step()  # a compressed warm-up's step follows it

    def _dense_with_nothing_waiting(self, s):
        """Whether every bucket (or shard) of step ``s``, about to begin, goes
        a dense way (native, or a compressed dense path: every value every
        step) while no sparse residual is held. The momentum correction
        exists for what waits in a sparse residual for many steps and would
        arrive as a burst its momentum multiplies; a dense path sends every
        coordinate every step, and the 4-bit path's residual holds only a
        step's rounding error. So the correction hands the gradient through
        (oktopk.momentum, MomentumCorrection.begin_step): a native step with
        nothing held costs what torch's allreduce_hook (or FSDP2's own
        reduction) does, and a 4-bit step is error feedback on the gradient
        under the optimizer's own momentum, as ZeRO++ runs it, without the
        correction's passes. Its residual then joins the next step's
        gradient, or a corrected step's velocity step: under the optimizer's
        momentum arithmetic (buf = m·buf + g) adding it to either is the
        same."""
        path = self.warmup_path(s) if s < self.warmup_iters else self._path
        return path != SPARSE and not PATHS[SPARSE].holds(self)

    def _reduce_bucket(self, bucket, tensor):
        """The bucket's future, by the step's path."""
        is_last = bucket.is_last()
        # Every bucket of one iteration is in the same phase: they were all
        # fired with the same iter, which the last one advances.
        step = self.iter
        rebuilt = self._hook_iters > 0  # not DDP's first, provisional, layout
        if self._hook_iters < 2:  # the provisional layout and the rebuilt one: every parameter
            self._optimizers.watch(bucket.parameters())
        if is_last:
            self.iter += 1
            self._hook_iters += 1
        if step < self.warmup_iters:
            path = self.warmup_path(step)
            if path == NATIVE or step < NATIVE_WARMUP_ITERS:
                # DDP's two layouts (or a native warm-up); the rebuilt layout's
                # buckets become the groups the residuals are kept in.
                layout = self._layout
                members = layout.members(bucket)  # numbers the parameters in the first layout
                layout.take_unused(members, None)  # resets the marks of parameters DDP found unused
                if rebuilt:
                    layout.learn_group([i for i, _, _ in members])
            return PATHS[path].reduce(self, bucket, tensor, step)
        path = PATHS[self._path]
        folding = [other for other in PATHS.values() if other is not path and other.watches(self)]
        if self.grads_as_bucket_views and not folding and not path.keeps_residual:
            # The bucket becomes the average and nothing else: .grad can
            # point at it, and DDP need not copy it back.
            self._bucket_grads.point(bucket)
        # What the other paths hold joins the values first, so nothing waits
        # there (a fold may reduce the bucket itself: its future then).
        for other in folding:
            fut = other.fold(self, bucket, tensor, step)
            if fut is not None:
                return fut
        return path.reduce(self, bucket, tensor, step)

    # -------------------------------------------------------------- FSDP2

    def attach_shards(self, slices, agree_over_world):
        """FSDP2: ``slices``, each sharded module's (parameters, members,
        padded size) for the momentum correction, in the modules' order
        (None without the correction); ``agree_over_world``: several
        replicate groups, so a step's NaN reaches only its own and whether
        a step was non-finite is agreed over the world (the script skips
        the step everywhere: AMP's scaler agrees over the world)."""
        if self._continuing:
            raise ValueError("on_rank_loss='continue' runs on the DDP hook: FSDP2 gathers and scatters the parameters over "
                             "the process group, which cannot go on without a lost rank; use fail-stop and torchrun's "
                             "--max-restarts there (docs/failures.md)")
        self._shard_slices = slices
        self._folds.agree = self._agree_over_world if agree_over_world else None
        if self._momentum is not None and self._settings.momentum.masking == AUTO_MASKING:
            self._momentum.mask.rule = False  # the default's masking yields where it cannot act: FSDP2's shards (fsdp.register)

    def parameter_index(self):
        """The parameters' canonical numbering (id -> number), which the
        momentum correction keys its velocities by; a front end numbers new
        ones into it in an order every rank shares."""
        return self._layout.param_index

    def add_group(self, group_id, members):
        """A group of parameters whose residuals are kept together under the
        library tensor id ``group_id`` (checkpointed with the state)."""
        self._layout.add_group(group_id, members)

    def detach_shards(self):
        """FSDP2: the registration removed."""
        self._folds.agree = None
        self._shard_slices = None

    def _agree_over_world(self, non_finite):
        flag = torch.tensor([1.0 if non_finite else 0.0], device=self._shard_device)
        with peer_failures_named("the agreement on a non-finite gradient"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def next_shard_step(self):
        """FSDP2: the root module's forward: the next shard begins a step."""
        self._new_shard_step = True

    def reduce_shard(self, number, group_id, shard):
        """FSDP2: the ``number``-th sharded module's gradient shard (its
        residuals kept under ``group_id``) replaced, in place, by its
        average over the replicas, by the step's path."""
        check_tensor(shard, "oktopk.fsdp: unsupported gradient shard")
        if self._new_shard_step:
            self._begin_shard_step(shard)
        # Momentum correction (oktopk.momentum): the shard's gradients
        # become the velocities' steps before any path (or fold) reads
        # them, and the optimizer's G after.
        work = self._correct_shard_before(number, shard)
        try:
            self._reduce_shard(group_id, shard)
        except BaseException as error:
            # A failed step moves nothing, this module's or an earlier one's:
            # their calls, folds and velocity steps are given back.
            self._folds.fail(error)
            raise
        if work is not None:
            self._momentum.after(work, shard.view(-1))

    def _begin_shard_step(self, shard):
        # Before anything reads a residual: a step before that came back
        # non-finite anywhere gives back what its other modules' calls and
        # folds took, on every rank alike (StepFolds).
        self._shard_device = shard.device  # the agreement's flag lives there (NCCL reduces CUDA tensors)
        self._settle_step()
        self._folds.began = True
        correction = self._momentum
        if correction is not None:
            correction.record_step(self._folds)
        if self._agreement_steps:
            agree_on_settings(self, shard.device)  # before anything the settings decide
        if self._measured_step is not None:  # every call of that step is done, on every rank
            self._reducer.adapt(self._measured_step)
            self._measured_step = None
        self._shard_step = self.iter
        self.iter += 1
        self._new_shard_step = False
        self._begin_choice(self._shard_step, shard.device, untimed=self._shard_steps_run == 0)
        self._shard_steps_run += 1
        if correction is not None and correction.active:
            correction.begin_step(idle=self._dense_with_nothing_waiting(self._shard_step))

    def _correct_shard_before(self, number, shard):
        """The correction's ``before`` on module ``number``'s shard, or None
        where it does not apply: off, not yet active (before the
        optimizer's first step), or a float16 shard (FSDP2 divides such a
        sum after the hook: the G would be scaled)."""
        correction = self._momentum
        if correction is None or not correction.active or correction.idle or shard.dtype == torch.float16:
            return None
        params, members, padded = self._shard_slices[number]
        if padded != shard.numel() or not shard.is_contiguous():
            correction._stop(f"FSDP2's gradient shard of module {number} is not laid out as expected ({shard.numel()} "
                             f"values, {padded} expected)")
            return None
        return correction.before(params, members, shard.view(-1))

    def _reduce_shard(self, group_id, shard):
        """The shard's average over the replicas, in place, by the step's path."""
        step = self._shard_step
        if step < self.warmup_iters:
            path = PATHS[self.warmup_path(step)]  # native, or the warm-up's compression
        else:
            path = PATHS[self._path if self._choice is not None else SPARSE]
            # What the other paths hold joins the shard first, so the switch
            # loses nothing.
            for other in PATHS.values():
                if other is not path:
                    other.fold_shard(self, group_id, shard)
        path.reduce_shard(self, group_id, shard, step)

    # ------------------------------------------------- fixed groups (Horovod)

    def start_groups(self, optimizer, groups_in_order, average=True, front=None, demo_line=DEMO_LINE, stacklevel=1):
        """A front end that hands whole groups of parameters, formed before
        the first step and alike on every rank (``oktopk.groups``; Horovod's
        optimizer) begins its run: ``groups_in_order``, (library tensor id,
        parameters) in the order every rank issues them; ``optimizer``, the
        torch optimizer that steps them (an Adam-family one keeps the
        framework's allreduce under the measured choice; SGD with momentum
        gets the momentum correction when ``average``); ``average``: the
        front end wants averages, else sums; ``front``: its own settings
        that decide its collectives (a dict of plain values), agreed across
        the ranks with the engine's; ``demo_line``: the line the notice of
        an Adam-family optimizer suggests. Every rank calls it at once: the
        ranks agree, the communicator is made. ``stacklevel``: the caller's
        frames above this call, for the warning of a named algorithm under
        an Adam-family optimizer."""
        groups.start(self, optimizer, list(groups_in_order), average, front or {}, demo_line, stacklevel + 1)

    def group_call(self):
        """The call of a group issued now (the front end's thread, groups in
        order): the framework's allreduce, or this step's sparse call with
        its density, ξ step and τ′, fixed when the group is issued. Hand it
        to :meth:`reduce_group`."""
        return groups.call(self)

    def reduce_group(self, number, group_id, params, call, average=True):
        """The ``number``-th group (library tensor id ``group_id``): the
        dense gradients of ``params`` replaced, in place, by their average
        (or sum) over the ranks, through ``call`` (:meth:`group_call`). On
        the engine's worker thread (:meth:`submit`), groups in order. A
        group that fails (a dead or silent peer) gives back what the step's
        groups that completed before it took, on this rank, and raises."""
        try:
            groups.reduce_group(self, number, group_id, params, call, average)
        except BaseException as error:
            self._folds.fail(error)
            raise

    def end_group_step(self, grads):
        """Once every group of the step is back (``grads``: the step's
        reduced gradients, read for NaN after a fold): the step settles and
        the next one's path is chosen."""
        groups.end_step(self, grads)

    def agree_if_due(self):
        """The ranks' agreement on the settings, when due (after a load):
        before the first group of a step is issued."""
        if self._agreement_steps:
            groups.agree(self)

    def optimizer_stepped(self, optimizer):
        """After ``optimizer`` stepped the groups' parameters (the momentum
        correction starts from its first step)."""
        groups.stepped(self, optimizer)

    def submit(self, fn, *args):
        """``fn(*args)`` on the engine's worker thread, after everything
        submitted before; its future."""
        return self._reducer.submit(fn, *args)

    def groups_state_dict(self):
        """The fixed groups' checkpoint (``oktopk.groups``: the layout
        Horovod's optimizer saves). Every rank saves its own."""
        return groups.state_dict(self)

    def load_groups_state_dict(self, state, who, check_owner):
        """Restore :meth:`groups_state_dict`; ``who`` names the checkpoint
        in messages; ``check_owner(rank, world_size)`` refuses another
        rank's or another world size's (ValueError saying what to do)."""
        groups.load_state_dict(self, state, who, check_owner)

    @property
    def choice(self):
        """With ``algorithm=None``: what the measured choice chose and why,
        as a dict: ``path`` ("native", "sparse", or None before the first
        decision), the agreed ms per step of each path at the latest
        decision, steps run on each path, steps spent exploring, decisions
        made, and the reason. None when an algorithm was named."""
        return None if self._choice is None else self._choice.summary()

    @property
    def momentum_status(self):
        """The momentum correction's state: "off" (``momentum_correction=False``),
        "waiting" (no SGD step with momentum seen yet), "on", or why it
        stopped (it warned then: for example GradScaler's ``unscale_``)."""
        m = self._momentum
        if m is None:
            return "off"
        if m.stopped is not None:
            return m.stopped
        return "on" if m.active else "waiting"

    def rejoin_state(self, state_dict, load_state_dict):
        """``on_rank_loss="continue"``: what a rank that comes back is handed,
        on every rank alike (as torchft's Manager takes them):
        ``state_dict()``, called on the group's rank 0 at the step it is
        admitted (the model's and optimizer's state, the script's step: what
        the script needs to go on), and ``load_state_dict(d)``, called on the
        joining process by :meth:`join`. What ``state_dict()`` returns
        travels through the job's store (torch.save)."""
        self._rejoin = (state_dict, load_state_dict)

    def join(self, origin=None):
        """``on_rank_loss="continue"``, in a process that comes back as rank
        ``origin`` of the original group (default: ``RANK``): waits until the
        group admits it (at most the timeout, within two of the group's
        steps of its request), loads what the group hands over (through
        :meth:`rejoin_state`'s ``load_state_dict``) and this state's
        position, with empty residuals; returns ``iter``. Its process group
        is one of its own (a group of one, for DDP); its library calls go
        to the group it joined."""
        return continuing.join(self, origin)

    @property
    def rank_joins(self):
        """Each join the run took (``on_rank_loss="continue"``): a dict of the
        ``step`` it joined at, on the members the step by which the join was
        asked for (``asked_by``: two steps before), the ranks that
        ``joined`` (their numbers in the original group), the group's
        ``size`` and this rank's number (``rank``) from then on."""
        return [dict(join) for join in self._rank_joins]

    @property
    def rank_losses(self):
        """Each rank loss the run went on from (``on_rank_loss="continue"``),
        oldest first: a dict of the void ``step``, the ``lost`` ranks (their
        numbers in the original group), the ``survivors`` left, this rank's
        new number (``rank``), ``residual_mass_lost`` (the sum of |residual|
        the lost ranks held, estimated as the survivors' mean: a lost
        rank's own cannot be read) and the ``error`` that voided the step.
        Empty under fail-stop."""
        return [dict(loss) for loss in self._rank_losses]

    @property
    def path(self):
        """The path of the step under way (its name in ``oktopk.paths``)."""
        return self._path

    @property
    def communicator(self):
        """The communicator of the library's calls, or None while there is
        none (before the first sparse step, or released while the measured
        choice keeps the framework's allreduce)."""
        return self._reducer.comm

    # ---------------------------------------------------------- the warm-up

    def warmup_path(self, step):
        """The path of warm-up step ``step`` (:func:`warmup_path`)."""
        return warmup_path(self._settings.warmup, step)

    def timed_warmup_step(self):
        """The warm-up step the measured choice times (:func:`timed_warmup_step`)."""
        return timed_warmup_step(self._settings.warmup)

    # ---------------------------------------------------- what the run holds

    def state_dict(self):
        """Iteration counter, the parameter groups residuals are kept in,
        every group's residual and thresholds, and the rank and world size
        they belong to, so a resumed run continues where this one stopped
        (also into DDP's initial bucket layout), and a checksum of it all.
        Every rank saves its own."""
        if self._void is not None:
            continuing.go_on(self)  # saved as the survivors' group, not the lost one's
        return checkpoint.state_dict(self)

    def load_state_dict(self, state):
        """Restore a state_dict() saved by this same rank of a run of the same
        world size; another rank's or another size's raises ValueError (here,
        or at the first sparse step when the process group does not exist
        yet), saying what to do; so does one whose checksum fails (a
        field or byte changed since it was saved)."""
        checkpoint.load_state_dict(self, state)

    def watch_optimizers(self, params):
        """Watch the optimizers that step ``params``: an Adam-family one
        keeps them dense (oktopk.optimizers), SGD with momentum reaches the
        correction."""
        self._optimizers.watch(params)

    def close(self):
        """Release the worker thread and the communicator. Call it when
        training ends; a state never closed releases them only when it is
        garbage-collected (nothing is registered to run at interpreter
        exit)."""
        self._reducer.close()
        self._layout.remove_hooks()
        self._bucket_grads.remove_hooks()
        self._optimizers.close()


# The settings, read-only, by their flat names (oktopk.settings.FLAT). A
# loaded checkpoint carries where the density's adaptation stands (its
# schedule, bounds and ξ period are part of the run), so the load replaces
# the settings object with one that says so.
for _name in FLAT:
    setattr(Engine, _name, _setting(_name))
del _name


def warmup_path(warmup, step):
    """The path of warm-up step ``step`` (``step < warmup.iters``) under the
    ``Warmup`` settings ``warmup``: native, or, with ``compression`` set,
    compressed on every step but DDP's second. DDP's first runs in its
    provisional bucket layout, where no residual can be kept: it goes in
    bfloat16, which keeps none (``bf16_compress_hook``'s rounding, half the
    bytes). Its second learns the rebuilt layout the residuals are kept in
    and is the native step the measured choice times
    (:func:`timed_warmup_step`), so it stays native. From the third on, the
    warm-up takes ``compression``."""
    if warmup.compression is None or step == NATIVE_WARMUP_ITERS - 1:
        return NATIVE
    if step < NATIVE_WARMUP_ITERS:
        return PATHS["bf16"].name
    return warmup.compression


def timed_warmup_step(warmup):
    """The warm-up step the measured choice times as native, to compare the
    sparse probe with: the last one that is native."""
    return (warmup.iters if warmup.compression is None else NATIVE_WARMUP_ITERS) - 1


def check_tensor(tensor, what):
    """ValueError unless liboktopk can reduce ``tensor``'s dtype on its
    device."""
    if tensor.dtype not in SUPPORTED_DTYPES or tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} of {tensor.dtype} on {tensor.device.type}; "
                         "liboktopk reduces float32, float16 and bfloat16 gradients on CPU or CUDA")

