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

import inspect
import weakref

import torch
import torch.distributed as dist

from .adaptive import AdaptiveControl
from .choice import (BF16, DEFAULT_MARGIN, DEFAULT_RECHECK_EVERY, NATIVE, QUANTIZED, SPARSE, StepChoice, check_choice, check_dense_compression,
                     debug_enabled)
from .quantized import QuantizedGroup
from . import device as device_path_
from .comm import Communicator
from .layout import BucketLayout, group_id_of, on_stream
from .momentum import MomentumCorrection
from .optimizers import OptimizerWatch, dense_notice, family_seen
from .reducer import Reducer, ReducerStats, StepFolds
from .schedule import check_schedule, density_at
from .settings import (DEFAULT_WARMUP_ITERS, DEFAULTS, check_agreement, check_checksum, check_settings, check_warmup_iters, process_group_agreement,
                       settings_digest, with_checksum)

# The bucket dtypes liboktopk reduces; the dense warm-up would take others,
# so they are refused on the first hook call rather than at the first sparse
# step.
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class OkTopkState(ReducerStats):
    """State of :func:`oktopk_hook`: hyperparameters, the communicator, and
    per-bucket residuals and thresholds (kept inside liboktopk).

    :param process_group: the group to reduce over (``None``: the default).
    :param density: fraction of each bucket's entries sent, a real number in
        (0, 1].
    :param algorithm: ``None`` (the default): each step after the warm-up
        takes the faster of two paths, measured: the process group's own
        allreduce (gloo, NCCL, MPI, as ``allreduce_hook``; the residual is
        folded in first, so nothing waits) or the library's sparse
        allreduce with ``"auto"``. The hook times whole steps on every rank,
        agrees on the slowest rank's figures, chooses sparse only when it
        saves ``sparse_margin`` of the step, and probes again every
        ``recheck_every`` steps (see ``oktopk.choice``; ``"auto"`` there
        chooses among the sparse algorithms only; ``choice`` says what
        it chose and why, and ``OKTOPK_DEBUG_AUTO=1`` logs each decision on
        rank 0). Parameters that an Adam-family optimizer steps stay dense
        on every step: the same choice runs between the process group's
        allreduce and ``dense_compression`` (``oktopk.optimizers``).
        Or one of ``oktopk.ALGORITHMS``, run on every step after the
        warm-up: ``"auto"`` (the library picks per bucket and call from a
        cost model and the measured link), ``"oktopk"``, the dense ones, the
        sparse baselines.
    :param warmup_iters: iterations reduced densely first; at least 2.
        DDP reduces its first iteration in a provisional bucket layout and
        rebuilds its buckets after it. The hook keeps residuals in the
        rebuilt layout, which it first sees in the second iteration; only
        from the third on is that layout known before every step, so that a
        checkpoint taken at any step holds it (PowerSGD likewise starts after
        DDP's first two iterations).
    :param sparse_margin: with ``algorithm=None``, the share of the native
        step a sparse step (or, under an Adam-family optimizer, a bfloat16
        one) must save to be chosen (default 0.10): a native step is exact,
        a sparse one leaves most of the gradient waiting.
    :param recheck_every: with ``algorithm=None``, steps between two probes
        of the path not chosen (each probe runs 4 steps; default 200).
    :param dense_compression: with ``algorithm=None``, the path measured
        against the process group's allreduce for parameters an Adam-family
        optimizer steps: ``"bf16"`` (the default: that allreduce in
        bfloat16, as ``bf16_compress_hook``: half the bytes, no residual),
        ``"quantized"`` (every value every step in 4 bits per block of 64
        with error feedback, about 0.13 of float32's bytes,
        ``oktopk.quantized``) or ``None`` (float32 on every step). On the
        AdamW transformer of results/text.md at 200 Mbit/s bf16 reached the
        target within 2% of ``fp16_compress_hook`` and ended at float32's
        loss; quantized reached it 1.2x sooner but ended 0.009 above it.
    :param grads_as_bucket_views: on a step that takes the process group's
        allreduce (native or bfloat16) with nothing to fold, point each
        parameter's ``.grad`` at its slice of the bucket before the
        allreduce (default True), as DDP's own
        ``gradient_as_bucket_view=True`` does, so that DDP need not copy
        the reduced bucket back: a comm hook gets the bucket undivided and
        divides in a pass of its own, where DDP without a hook divides while
        copying in, and this saves that pass back (on loopback the 17.1M
        MLP's native step went from 1.06x plain DDP's to level with it,
        results/ddp_matrix.md). The values are the same bit for bit; what
        changes is that a ``.grad`` tensor kept across steps is overwritten
        by a later step's reduction, as under ``gradient_as_bucket_view``
        (clone one to keep it). Only a parameter whose ``.grad`` is
        contiguous and has its slice's shape and dtype is pointed.
    :param momentum_correction: for parameters that ``torch.optim.SGD`` steps
        with momentum (default True): each rank keeps its own velocity and
        what is reduced, and kept in the residual, is the velocity's step
        rather than the gradient, so a value that waited in the residual
        never arrives as a burst that the optimizer's momentum multiplies
        (Lin et al., Deep Gradient Compression). The optimizer is left as it
        is: the hook hands it the gradient on which its own momentum lands
        on the reduced average, so ``momentum_buffer`` and weight decay keep
        their meaning (``oktopk.momentum``). It starts after the optimizer's
        first step and costs three more copies of the gradients per rank.
        ``.grad`` then holds that gradient, not the average of the ranks':
        a script that rescales ``.grad`` before the step (GradScaler,
        clipping) stops the correction, with a warning. False: the
        optimizer's momentum acts on the sparse average (measured: the demo's
        MLP swings and ends lower, results/sgd.md).
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

    :param device_path: ``None`` (the default): a CUDA bucket takes the
        device path (``oktopk.device``): acc = grad + residual, the local
        selection and the residual stay on the GPU, and only the selected
        and result pairs cross PCIe; ``True``: every bucket takes it, a CPU
        one too (the same arithmetic as the staging path, bit for bit);
        ``False``: never. It runs Ok-Topk (``"auto"`` and the measured
        choice's sparse path mean Ok-Topk there) and measures no ξ: other
        algorithms, ``measure_xi_every`` and ``adaptive`` stage the bucket
        through host memory instead. ``host_device_bytes`` counts what
        either path copies.

    Buckets may be float32, float16 or bfloat16, on CPU or CUDA; CUDA buckets
    take the device path, or are staged through pinned host memory. A step whose gradient holds NaN or
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
        "adaptive",
        "process_group",
        "iter",
        "last_density",
        "last_tau_prime",
        "_reducer",
        "_layout",
        "_pending_state",
        "_hook_iters",
        "_owner",
        "_adapt_error",
        "_choice",
        "_path",
        "_residual_groups",
        "_pooled_iter",
        "_optimizers",
        "device_path",
        "_device_groups",
        "_library_groups",
        "_host_buffers",
        "dense_compression",
        "_quantized",
        "_quantized_bytes",
        "_quantized_spill",
        "grads_as_bucket_views",
        "_bucket_grads",
        "momentum_correction",
        "_momentum",
        "_agreement_steps",
        "_folds",
    ]

    def __init__(self, process_group=None, density=DEFAULTS.density, algorithm=DEFAULTS.algorithm, warmup_iters=DEFAULT_WARMUP_ITERS,
                 tau=DEFAULTS.tau, tau_prime=DEFAULTS.tau_prime, timeout=DEFAULTS.timeout, value_dtype=DEFAULTS.value_dtype,
                 stochastic_rounding=DEFAULTS.stochastic_rounding, density_schedule=DEFAULTS.density_schedule,
                 measure_xi_every=DEFAULTS.measure_xi_every, adaptive=DEFAULTS.adaptive, sparse_margin=DEFAULT_MARGIN,
                 recheck_every=DEFAULT_RECHECK_EVERY, device_path=None, dense_compression=BF16, grads_as_bucket_views=True,
                 momentum_correction=True):
        if device_path not in (None, True, False):
            raise ValueError(f"device_path must be None, True or False, got {device_path!r}")
        # Checked whatever the algorithm, though only the measured choice
        # (algorithm None) reads them: a bad value is refused, never ignored.
        sparse_margin, recheck_every = check_choice(sparse_margin, recheck_every)
        dense_compression = check_dense_compression(dense_compression)
        settings = check_settings(density, "auto" if algorithm is None else algorithm, tau, tau_prime, timeout, value_dtype, stochastic_rounding,
                                  density_schedule, measure_xi_every, adaptive)
        self.warmup_iters = check_warmup_iters(warmup_iters)
        if not isinstance(grads_as_bucket_views, bool):
            raise ValueError(f"grads_as_bucket_views must be True or False, got {grads_as_bucket_views!r}")
        self.grads_as_bucket_views = grads_as_bucket_views
        if not isinstance(momentum_correction, bool):
            raise ValueError(f"momentum_correction must be True or False, got {momentum_correction!r}")
        self.momentum_correction = momentum_correction
        self._bucket_grads = BucketGrads()
        self.device_path = device_path
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
        if momentum_correction:
            index = self._layout.param_index
            self._momentum = MomentumCorrection(lambda p: index.get(id(p)))
        # algorithm None: the measured choice, whose sparse path is "auto",
        # and native or bfloat16 on every step for an Adam-family
        # optimizer's parameters (oktopk.optimizers); a named algorithm
        # warns about one. Every SGD step reaches the correction.
        self._optimizers = OptimizerWatch(warn=algorithm is not None, on_momentum=None if self._momentum is None else self._momentum.stepped)
        self._choice = StepChoice(sparse_margin, recheck_every, adam_candidate=dense_compression) if algorithm is None else None
        self.dense_compression = dense_compression
        # The QUANTIZED path's residuals per group of parameters (library
        # tensor id).
        self._quantized = {}
        self._quantized_bytes = 0
        # A native step's fold: each parameter's share of what its group
        # held, until its bucket comes.
        self._quantized_spill = {}
        if self._choice is not None:
            watch = self._optimizers
            self._choice.adam_seen = lambda: watch.seen
        (self.density, self.algorithm, self.tau, self.tau_prime, self.timeout, self.value_dtype, self.stochastic_rounding,
         self.density_schedule, self.measure_xi_every, self.adaptive) = settings
        if algorithm is None:
            self.algorithm = None
        self.process_group = process_group
        self.iter = 0
        # The density and τ′ of the latest sparse step (τ′ with adaptive only).
        self.last_density = None
        self.last_tau_prime = None
        # The communicator (made at the first sparse step), its worker
        # thread, and the statistics of its calls (ReducerStats).
        self._reducer = Reducer(None if self.adaptive is None else AdaptiveControl(self.adaptive, self.density, self.tau_prime))
        # Residuals and thresholds loaded before the communicator existed.
        self._pending_state = {}
        # Iterations this process has run through the hook: DDP's first one
        # (0 here) uses its provisional bucket layout, every later one the
        # rebuilt layout, whatever state.iter a checkpoint resumed from.
        self._hook_iters = 0
        # (rank, world size) a loaded checkpoint belongs to, until checked
        # against this process's (at load, or at communicator setup when the
        # process group did not exist yet at load).
        self._owner = None
        # An adaptation's failure (worker thread), raised by the next bucket.
        self._adapt_error = None
        # The path of the step under way (algorithm None), and the groups
        # whose residual a sparse step may have left non-zero: a native step
        # folds those in first.
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

    @property
    def quantized_bytes_sent(self):
        """Bytes this rank sent on the QUANTIZED path (``oktopk.quantized``),
        apart from ``bytes_sent`` (the library's sparse calls)."""
        return self._quantized_bytes

    @property
    def choice(self):
        """With ``algorithm=None``: what the hook chose and why, as a dict:
        ``path`` ("native", "sparse", or None before the first decision),
        the agreed ms per step of each path at the latest decision, steps
        run on each path, steps spent exploring, decisions made, and the
        reason. None when an algorithm was named."""
        return None if self._choice is None else self._choice.summary()

    @property
    def sparse_margin(self):
        return None if self._choice is None else self._choice.margin

    @property
    def recheck_every(self):
        return None if self._choice is None else self._choice.recheck_every

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

    # -- checkpointing -----------------------------------------------------

    def state_dict(self):
        """Iteration counter, the parameter groups residuals are kept in,
        every group's residual and thresholds, and the rank and world size
        they belong to, so a resumed run continues where this one stopped
        (also into DDP's initial bucket layout), and a checksum of it all.
        Every rank saves its own."""
        return with_checksum(self._checkpoint())

    def _checkpoint(self):
        self._folds.settle()  # a step skipped for a NaN left its residuals as they were
        tensors = dict(self._pending_state)
        comm = self._reducer.comm
        if comm is not None:
            self._reducer.drain()  # after every queued bucket
            for group_id in sorted(self._layout.groups):
                tensors[group_id] = _save_group(self, comm, group_id)
        rank, size = self._placement() or self._owner or (None, None)
        return {
            "iter": self.iter,
            "density": self.density,
            "density_schedule": self.density_schedule,
            "adaptive": self._reducer.adaptive_state(self.measure_xi_every),
            "algorithm": self.algorithm,
            "tensors": tensors,
            "layout": self._layout.state_dict(),
            "rank": rank,
            "world_size": size,
            "choice": None if self._choice is None else self._choice.state_dict(),
            "residual_groups": sorted(self._residual_groups),
            "quantized": {group_id: group.state_dict() for group_id, group in self._quantized.items()},
            "momentum": {} if self._momentum is None else self._momentum.state_dict(),
        }

    def load_state_dict(self, state):
        """Restore a state_dict() saved by this same rank of a run of the same
        world size; another rank's or another size's raises ValueError (here,
        or at the first sparse step when the process group does not exist
        yet), saying what to do; so does one whose checksum fails (a
        field or byte changed since it was saved)."""
        check_checksum(state, "OkTopkState")
        if state.get("algorithm", self.algorithm) != self.algorithm:
            def named(a):
                return "the measured choice (algorithm=None)" if a is None else f"algorithm {a!r}"
            raise ValueError(f"checkpoint was made with {named(state['algorithm'])}, this state uses {named(self.algorithm)}: "
                             f"make the state with the checkpoint's algorithm")
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
            self.measure_xi_every = self._reducer.load_adaptive(state["adaptive"], self.density, self.tau_prime)
            self.adaptive = self._reducer.adaptive.bounds
        if self._choice is not None and state.get("choice") is not None:
            self._choice.load_state_dict(state["choice"])
        self._quantized = {int(k): QuantizedGroup.from_state_dict(v) for k, v in state.get("quantized", {}).items()}
        if self._momentum is not None:
            self._momentum.load_state_dict(state.get("momentum", {}))
        # A checkpoint from before the choice existed: every group may hold a residual.
        self._residual_groups = set(state.get("residual_groups", state.get("tensors", {}).keys()))
        tensors = dict(state.get("tensors", {}))
        self._layout.load_state_dict(state.get("layout", {}))
        # What decides the collectives may have changed (iter, layout, the
        # choice): the next step begins with the ranks' agreement again.
        self._agreement_steps = max(self._agreement_steps, 1)
        if self._reducer.comm is not None:
            for bucket_id, blob in tensors.items():
                self._reducer.comm.load_tensor_state(bucket_id, blob)
                self._device_groups.pop(bucket_id, None)
            self._library_groups |= set(tensors)
        else:
            self._pending_state = tensors

    def __repr__(self):
        """OkTopkState(...) naming only the settings that differ from their
        defaults: what was chosen for this job, at a glance."""
        values = {"process_group": self.process_group, "density": self.density, "algorithm": self.algorithm,
                  "warmup_iters": self.warmup_iters, "tau": self.tau, "tau_prime": self.tau_prime, "timeout": self.timeout,
                  "value_dtype": self.value_dtype, "stochastic_rounding": self.stochastic_rounding,
                  "density_schedule": self.density_schedule, "measure_xi_every": self.measure_xi_every, "adaptive": self.adaptive,
                  "device_path": self.device_path, "dense_compression": self.dense_compression,
                  "grads_as_bucket_views": self.grads_as_bucket_views, "momentum_correction": self.momentum_correction}
        if self._choice is not None:  # the measured choice's own settings (algorithm None)
            values["sparse_margin"], values["recheck_every"] = self._choice.margin, self._choice.recheck_every
        defaults = {name: p.default for name, p in inspect.signature(OkTopkState.__init__).parameters.items() if name != "self"}
        return "OkTopkState(" + ", ".join(f"{name}={value!r}" for name, value in values.items() if value != defaults[name]) + ")"

    def __getstate__(self):
        return with_checksum(self._checkpoint() | {
            "warmup_iters": self.warmup_iters,
            "tau": self.tau,
            "tau_prime": self.tau_prime,
            "timeout": self.timeout,
            "value_dtype": self.value_dtype,
            "stochastic_rounding": self.stochastic_rounding,
            "measure_xi_every": self.measure_xi_every,
            "device_path": self.device_path,
            "dense_compression": self.dense_compression,
            "grads_as_bucket_views": self.grads_as_bucket_views,
            "momentum_correction": self.momentum_correction,
        })

    def __setstate__(self, state):
        check_checksum(state, "OkTopkState")  # before its fields make the state
        saved_choice = state.get("choice")
        # A state pickled before warm-ups of 1 were refused: its iterations
        # past the warm-up are unaffected by the longer one.
        warmup_iters = max(state["warmup_iters"], 2)
        OkTopkState.__init__(self, None, state["density"], state["algorithm"], warmup_iters, state["tau"], state["tau_prime"], state["timeout"],
                             state.get("value_dtype", DEFAULTS.value_dtype), state.get("stochastic_rounding", DEFAULTS.stochastic_rounding),
                             state.get("density_schedule"), state.get("measure_xi_every"),
                             None if state.get("adaptive") is None else state["adaptive"]["bounds"],
                             *((saved_choice["margin"], saved_choice["recheck_every"]) if saved_choice else ()),
                             device_path=state.get("device_path"), dense_compression=state.get("dense_compression", BF16),
                             grads_as_bucket_views=state.get("grads_as_bucket_views", True),
                             momentum_correction=state.get("momentum_correction", True))
        self.load_state_dict(state)

    def close(self):
        """Release the worker thread and the communicator. Call it when
        training ends; a state never closed releases them only when it is
        garbage-collected (nothing is registered to run at interpreter
        exit)."""
        self._reducer.close()
        self._layout.remove_hooks()
        self._bucket_grads.remove_hooks()
        self._optimizers.close()


# -- the hook's work ---------------------------------------------------------
#
# The hook numbers each bucket's parameters, reduces the dense warm-up with
# torch.distributed, and hands every sparse bucket to the state's reducer:
# a bucket that is exactly one known group is reduced by itself, any other
# goes through the layout's regrouping pool (see oktopk.layout).


def agreement_settings(state):
    """The state's settings that decide which collectives a rank issues
    and when, with where the run stands (a resumed one: its step, layout
    and choice): what every rank must hold alike."""
    choice = state._choice
    groups = sorted((group_id, tuple(members)) for group_id, members in state._layout.state_dict().items())
    return {
        "density": state.density,
        "algorithm": state.algorithm,
        "warmup_iters": state.warmup_iters,
        "tau": state.tau,
        "tau_prime": state.tau_prime,
        "dense_compression": state.dense_compression,
        "value_dtype": state.value_dtype,
        "stochastic_rounding": state.stochastic_rounding,
        "density_schedule": state.density_schedule,
        "measure_xi_every": state.measure_xi_every,
        "adaptive": state.adaptive,
        "sparse_margin": state.sparse_margin,
        "recheck_every": state.recheck_every,
        "device_path": state.device_path,
        "momentum_correction": state.momentum_correction,
        "optimizer_family": family_seen(state._optimizers.seen),
        "iter": state.iter,
        "layout": f"{len(groups)} groups, digest {settings_digest(dict(groups)).hex()[:12]}",
        "choice": None if choice is None else (choice.chosen, choice.candidate, choice.decided_at, choice.confirm_at),
    }


def agree_on_settings(state, device):
    """At the first bucket of a step that begins with it (the first steps,
    and after a load): OkTopkError on every rank, naming each setting and
    every rank's value, unless every rank of the process group holds the
    same agreement_settings (oktopk.settings.check_agreement: one
    fixed-size all_gather, the same on every rank whatever its settings)."""
    check_agreement(agreement_settings(state), *process_group_agreement(state.process_group, device))
    state._agreement_steps -= 1


def _start(state):
    """Make the communicator and its worker at the first sparse step, with
    the residuals a checkpoint loaded before."""
    if state._reducer.comm is None:
        state._check_owner()
        algorithm = "auto" if state.algorithm is None else state.algorithm  # the measured choice's sparse path
        state._reducer.start(Communicator(state.process_group, algorithm, state.density, state.tau, state.tau_prime, state.timeout,
                                          value_dtype=state.value_dtype, stochastic_rounding=state.stochastic_rounding))
        for bucket_id, blob in state._pending_state.items():
            state._reducer.comm.load_tensor_state(bucket_id, blob)
        state._library_groups = set(state._pending_state)
        state._pending_state = {}


def _save_group(state, comm, group_id):
    """A group's state saved from the library, with its residual from the
    device when it takes the device path."""
    group = state._device_groups.get(group_id)
    return comm.save_tensor_state(group_id) if group is None else group.checkpoint(comm, group_id)


def _takes_device_path(state, tensor):
    """Whether a sparse call on ``tensor`` (a bucket) takes the device path
    (see OkTopkState's device_path)."""
    if state.device_path is False or (state.device_path is None and tensor.device.type != "cuda"):
        return False
    return (state.algorithm in (None, "auto", "oktopk") and state.measure_xi_every is None and state._reducer.adaptive is None
            and tensor.numel() <= device_path_.MAX_ELEMENTS)


def _device_group(state, group_id, n, device):
    """The group's device-path state, made at its first call; a state the
    library holds with its residual (loaded from a checkpoint) moves its
    residual to the device."""
    group = state._device_groups.get(group_id)
    if group is None:
        group = device_path_.DeviceGroup(n, device)
        if group_id in state._library_groups:
            comm = state._reducer.comm
            group.load(comm, group_id, comm.save_tensor_state(group_id))
            state._library_groups.discard(group_id)
        state._device_groups[group_id] = group
    return group


def _call(state, step):
    """(density or None, ξ step or None) of sparse iteration ``step``
    (state.iter when its buckets fired): the same on every rank."""
    s = step - state.warmup_iters
    density = None if state.density_schedule is None else density_at(state.density_schedule, state.density, s)
    measure = state.measure_xi_every is not None and s % state.measure_xi_every == 0
    return density, (step if measure else None)


def _reduce_pieces(state, group_id, pieces, call):
    """Worker thread: sparse allreduce of the concatenation of pieces
    ((tensor, start, end, held), in the group's layout), written back into
    them; the held ones (parameters unused on this rank) are held back in the
    library. A step the library skipped for a non-finite gradient comes back
    as NaN (see Reducer.sparse_allreduce_). call is (density or None, the
    step when ξ is measured or None)."""
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
    density, xi_step = call
    if _takes_device_path(state, tensor):
        _reduce_on_device(state, group_id, pieces, hold, density)
        return
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
        # reducer's, reused.
        host = state._reducer.staging_for(n, tensor.dtype, cuda)
        at = 0
        for t, a, b in pieces:
            host[at : at + b - a].copy_(t[a:b])
            at += b - a
    state._residual_groups.add(group_id)  # a native step folds it in first
    if cuda:
        state._reducer.count_host_device(2 * host.numel() * host.element_size())
    tau_prime = None
    adaptive = state._reducer.adaptive
    if adaptive is not None:  # this worker thread adapts them, between steps
        density, tau_prime = adaptive.density, adaptive.tau_prime
        state.last_density, state.last_tau_prime = density, tau_prime
    state._reducer.sparse_allreduce_(group_id, host, hold, density=density, xi_step=xi_step, tau_prime=tau_prime,
                                     sparse_only=state._choice is not None)
    state._folds.see(host)  # a step that folds other buckets: a skipped sparse call skips it too
    if host is not tensor:
        _write_back(pieces, host)


def _write_back(pieces, flat):
    """flat's consecutive slices back into pieces ((tensor, start, end))."""
    at = 0
    for t, a, b in pieces:
        t[a:b].copy_(flat[at : at + b - a])
        at += b - a


def _reduce_on_device(state, group_id, pieces, hold, density):
    """Worker thread: _reduce_pieces on the device path (oktopk.device):
    the pieces gathered on their device when they are not one whole
    buffer, and written back."""
    tensor = pieces[0][0]
    whole = len(pieces) == 1 and pieces[0][1:] == (0, tensor.numel()) and tensor.is_contiguous()
    grad = tensor if whole else torch.cat([t[a:b] for t, a, b in pieces])
    group = _device_group(state, group_id, grad.numel(), grad.device)
    state._residual_groups.add(group_id)  # a native step folds it in first
    reducer = state._reducer
    stats, moved, pairs = device_path_.sparse_allreduce_(reducer.comm, group_id, grad, group, state._host_buffers, hold, density)
    reducer.count_host_device(moved, pairs)
    if stats is not None:
        reducer.record(group_id, stats)
    state._folds.see(grad)
    if not whole:
        _write_back(pieces, grad)


def _reduce_group(state, group_id, pieces, stream, call):
    """Worker thread: one group's pieces reduced on stream, in sparse
    iteration ``call``; first raises an adaptation's failure."""
    _raise_adapt_error(state)
    with on_stream(stream):
        _reduce_pieces(state, group_id, pieces, call)


def _reduce_bucket(state, group_id, tensor, slices, fut, stream, call):
    # Worker thread: one DDP bucket that is exactly one group; slices are
    # (start, end, held).
    try:
        _reduce_group(state, group_id, [(tensor, a, b, held) for a, b, held in slices], stream, call)
        with on_stream(stream):
            fut.set_result(tensor)
    except BaseException as e:  # noqa: BLE001 - the future carries it to DDP
        fut.set_exception(e)


def _pool_bucket(state, tensor, members, unused, fut, stream, call):
    """Worker thread: a bucket that is not one group goes to the layout's
    pool; the groups it completes are reduced."""
    _reduce_pooled(state, call, lambda: state._layout.pool_bucket(tensor, members, unused, fut, stream))


def _flush_pool(state, call):
    """Worker thread, after a step's last bucket: what is still pooled
    becomes new groups, reduced."""
    if state._layout.pooling:
        _reduce_pooled(state, call, state._layout.leftover_groups)


def _reduce_pooled(state, call, ready):
    """Reduce the pooled groups ``ready()`` returns; a failure fails every
    pooled bucket's future (DDP raises it)."""
    layout = state._layout
    try:
        for group_id in ready():
            pieces, stream = layout.pooled(group_id)
            _reduce_group(state, group_id, pieces, stream, call)
            layout.done(group_id)
    except BaseException as e:  # noqa: BLE001 - every waiting future carries it to DDP
        layout.fail(e)


def _adapt(state, step):
    """Worker thread, after the last call of sparse iteration ``step``,
    which measured ξ: adapt the density and τ′ of the steps that follow
    (their calls come after this in the worker's queue, on every rank). A
    failure is raised by the next bucket."""
    try:
        state._reducer.adapt(step)
    except BaseException as e:  # noqa: BLE001 - the next bucket's future carries it to DDP
        state._adapt_error = e


def _raise_adapt_error(state):
    if state._adapt_error is not None:
        e, state._adapt_error = state._adapt_error, None
        raise e


def _native_allreduce(state, tensor):
    """The process group's own allreduce of the bucket, averaged, as
    ``allreduce_hook`` runs it (the dense warm-up, and the native path)."""
    group = state.process_group
    world = dist.get_world_size(group)
    fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()

    def average(f):
        reduced = f.value()[0].div_(world)
        state._folds.see(reduced)
        return reduced

    return fut.then(average)


class BucketGrads:
    """grads_as_bucket_views: points each parameter's ``.grad`` at its slice
    of the bucket (the values are the same: DDP copied the gradients in).
    DDP then finds ``.grad`` already holding the reduced slice and its copy
    back returns at once (ATen's copy_ skips a view of the same memory), as
    under ``gradient_as_bucket_view=True``. A parameter with no ``.grad``
    (unused, which DDP leaves so) or another layout is left alone.

    DDP built without ``gradient_as_bucket_view`` refuses a ``.grad`` that
    is a view of its bucket when the next backward accumulates into it (a
    script that zeroes to zeros, not None): a hook on each pointed
    parameter, run before its gradient is accumulated, gives it a copy of
    its own first. Zeroing to None (torch's default) leaves nothing to copy."""

    def __init__(self):
        self._pointed = {}  # id(param) -> (data_ptr of the slice it was pointed at, hook handle)

    def point(self, bucket):
        with torch.no_grad():
            for param, view in zip(bucket.parameters(), bucket.gradients()):
                grad = param.grad
                if (grad is None or grad.data_ptr() == view.data_ptr() or not grad.is_contiguous() or not param.is_contiguous()
                        or grad.shape != view.shape or grad.dtype != view.dtype or grad.device != view.device):
                    continue
                param.grad = view
                key = id(param)
                handle = self._pointed[key][1] if key in self._pointed else param.register_hook(self._unalias(weakref.ref(param)))
                self._pointed[key] = (view.data_ptr(), handle)

    def _unalias(self, param_ref):
        pointed = self._pointed

        def before_accumulation(grad):
            param = param_ref()
            if param is not None and param.grad is not None and param.grad.data_ptr() == pointed[id(param)][0]:
                param.grad = param.grad.clone()

        return before_accumulation

    def remove_hooks(self):
        for _, handle in self._pointed.values():
            handle.remove()
        self._pointed = {}


def _bf16_allreduce(state, tensor):
    """The process group's allreduce of the bucket in bfloat16, averaged, as
    ``bf16_compress_hook`` runs it: the BF16 path (an Adam-family
    optimizer's choice, oktopk.choice), which only runs while no residual is
    held. A bucket already in 16 bits goes as it is."""
    if tensor.dtype != torch.float32:
        return _native_allreduce(state, tensor)
    group = state.process_group
    compressed = tensor.to(torch.bfloat16).div_(dist.get_world_size(group))
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f):
        return tensor.copy_(f.value()[0])

    return fut.then(decompress)


def _quantized_allreduce(state, bucket, tensor):
    """The QUANTIZED path (an Adam-family optimizer's choice, oktopk.choice):
    each group of parameters (oktopk.layout) through oktopk.quantized in its
    own layout, with its residuals. A bucket that is one group is reduced
    as it is (in place when in the group's order); the buckets of DDP's
    provisional layout (a resumed run's first step) go through the layout's
    regrouping pool, each group reduced once all its parameters arrived, so
    a resumed run continues exactly. 16-bit buckets go native. The
    collectives run here, in the hook: DDP's own (the used-parameter map
    with find_unused_parameters) share the process group and must keep one
    order on every rank, which a thread of our own would not."""
    if tensor.dtype != torch.float32:
        return _native_allreduce(state, tensor)
    layout = state._layout
    members = layout.members(bucket)
    group_id = layout.learn_group([i for i, _, _ in members]) if state._hook_iters > 0 else group_id_of([i for i, _, _ in members])
    cuda = tensor.device.type == "cuda"
    fut = torch.futures.Future(devices=[tensor.device]) if cuda else torch.futures.Future()

    def reduce():
        try:
            if group_id in layout.groups:
                where = {i: (a, b) for i, a, b in members}
                _reduce_quantized_group(state, group_id, [(tensor,) + where[i] for i in layout.groups[group_id]])
                fut.set_result(tensor)
                return
            complete = layout.pool_bucket(tensor, members, set(), fut, None)
            while complete:
                for pooled_id in complete:
                    pieces, _ = layout.pooled(pooled_id)
                    _reduce_quantized_group(state, pooled_id, [(t, a, b) for t, a, b, _ in pieces])
                    layout.done(pooled_id)
                # After the last bucket, what is still pooled belongs to no
                # known group (the model changed): new groups.
                complete = layout.leftover_groups() if bucket.is_last() and layout.pooling else []
        except Exception as e:  # noqa: BLE001 - DDP raises it from the future
            layout.fail(e)
            if not fut.done():
                fut.set_exception(e)

    reduce()
    return fut


def _reduce_quantized_group(state, group_id, pieces):
    """One group's quantized allreduce over ``pieces`` ((tensor, start,
    end) per parameter, in the group's order): in place when they are one
    tensor's consecutive values, else gathered and scattered back."""
    tensor = pieces[0][0]
    sizes = tuple(b - a for _, a, b in pieces)
    group = state._quantized.get(group_id)
    pg = state.process_group
    if group is None:
        group = state._quantized[group_id] = QuantizedGroup(state._layout.groups[group_id], sizes, dist.get_world_size(pg),
                                                            dist.get_rank(pg), tensor.device)
    group.to(tensor.device)
    in_place = all(t is tensor for t, _, _ in pieces) and all(pieces[k][2] == pieces[k + 1][1] for k in range(len(pieces) - 1))
    flat = tensor[pieces[0][1] : pieces[-1][2]] if in_place else torch.cat([t[a:b] for t, a, b in pieces])
    state._quantized_bytes += group.allreduce_(flat, pg)
    if not in_place:
        at = 0
        for t, a, b in pieces:
            t[a:b].copy_(flat[at : at + b - a])
            at += b - a


def _fold_quantized(state, bucket, tensor):
    """Before a native step after QUANTIZED ones: what each group holds
    (oktopk.quantized) joins its parameters' values in whichever bucket
    they arrive, so nothing waits."""
    members = state._layout.members(bucket)
    for group_id in {state._layout.group_of.get(i) for i, _, _ in members} & set(state._quantized):
        group = state._quantized.pop(group_id).to(tensor.device)
        state._folds.took(lambda group_id=group_id, group=group: _give_back_quantized(state, group_id, group))
        held, at = group.held(), 0
        for i, size in zip(group.members, group.sizes):
            state._quantized_spill[i] = held[at : at + size]
            at += size
    if tensor.dtype != torch.float32:
        return
    for i, a, b in members:
        piece = state._quantized_spill.pop(i, None)
        if piece is not None:
            tensor[a:b] += piece


def _give_back_quantized(state, group_id, group):
    """Undo _fold_quantized's fold of one group (StepFolds): its residuals
    held again, none of them waiting to join a bucket."""
    state._quantized[group_id] = group
    for i in group.members:
        state._quantized_spill.pop(i, None)


def _agree_max(state, device):
    """The choice's agreement: the max of each value over the ranks, through
    the process group (on the bucket's device, as NCCL needs)."""
    def agree(values):
        t = torch.tensor(values, dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=state.process_group)
        return [float(v) for v in t.tolist()]

    return agree


def _begin_step(state, s, device, untimed):
    """At the first bucket of sparse-phase step s: the path of this step
    (timing the one before, and deciding when a decision is due)."""
    choice = state._choice
    if choice.agree is None:
        choice.agree = _agree_max(state, device)
        if debug_enabled() and dist.get_rank(state.process_group) == 0:
            choice.log = print
    previous, kept_dense = state._path, choice.kept_dense_for
    state._path = choice.begin_step(s, untimed)
    if kept_dense is None and choice.kept_dense_for is not None and dist.get_rank(state.process_group) == 0:
        print(dense_notice(choice.kept_dense_for, compressed=choice.candidate), flush=True)
    if state._path == SPARSE:
        state._layout.watching = True
    if previous == SPARSE and state._path == NATIVE:
        # The sparse steps' queued work (adaptation) finishes before a fold
        # reads their residuals.
        state._reducer.drain()
    elif previous == NATIVE and state._path == NATIVE and choice.chosen == NATIVE:
        _release_communicator(state)
        if not state._residual_groups and state._layout.watching:
            # Nothing left to fold: which parameters were used no longer
            # matters until the next sparse step.
            state._layout.stop_watching()
    elif choice.candidate != SPARSE and not state._residual_groups and state._layout.watching:
        # No sparse step comes (an Adam-family optimizer), none left a
        # residual: which parameters were used never matters.
        state._layout.stop_watching()


def _release_communicator(state):
    """Once native is chosen and a native step has folded the residuals in:
    save what the communicator holds per group (thresholds, region
    boundaries, held entries) and destroy it, with its worker thread. An
    idle communicator's sockets still wake their owner threads (a few
    percent of a core per rank, felt where ranks share cores); the next
    sparse step, a probe at the latest, makes a new one through the store
    and loads the saved state, as after a checkpoint. Every rank releases
    at the same step (the path is agreed)."""
    reducer = state._reducer
    if reducer.comm is None:
        return
    reducer.drain()
    state._pending_state = {group_id: _save_group(state, reducer.comm, group_id) for group_id in sorted(state._layout.groups)}
    state._device_groups = {}  # their residuals are in the saved states; the next sparse step loads them again
    reducer.close()


def _fold_residual(state, group_id, tensor, slices):
    """Before a native allreduce of a bucket that is group ``group_id``
    (``slices``: (start, end, held) of its parameters in the group's order):
    move the group's residual into it (held slots keep theirs), so the
    switch from sparse loses nothing. Only groups a sparse step left a
    residual in are folded. A bucket laid out otherwise than the group's
    residual (a resumed run's first step), or on CUDA, is staged through
    host memory in the group's order for it, once per switch."""
    comm = state._reducer.comm
    if comm is None or group_id not in state._residual_groups:
        return
    group = state._device_groups.get(group_id)
    if group is not None:
        _fold_on_device(state, group_id, group, tensor, slices)
        return
    hold, at = [], 0
    for a, b, held in slices:
        if held:
            hold.append((at, at + b - a))
        at += b - a
    in_order = all(slices[j][0] == (slices[j - 1][1] if j else 0) for j in range(len(slices))) and at == tensor.numel()
    if in_order and tensor.device.type == "cpu" and tensor.is_contiguous():
        comm.fold_residual_(group_id, tensor, hold)
    else:
        host = torch.cat([tensor[a:b] for a, b, _ in slices]).to("cpu")
        comm.fold_residual_(group_id, host, hold)
        _write_back([(tensor, a, b) for a, b, _ in slices], host)

    def give_back():
        comm.unfold_residual(group_id)
        state._residual_groups.add(group_id)

    state._folds.took(give_back)
    if not hold:
        state._residual_groups.discard(group_id)


def _fold_on_device(state, group_id, group, tensor, slices):
    """_fold_residual for a device-path group: the same fold, where the
    residual is."""
    pieces = [(tensor, a, b) for a, b, _ in slices]
    grad = torch.cat([tensor[a:b] for a, b, _ in slices])
    hold, at = [], 0
    for a, b, held in slices:
        if held:
            hold.append((at, at + b - a))
        at += b - a
    residual = group.residual.clone()
    if device_path_.fold_(grad, group, hold):
        _write_back(pieces, grad)

    def give_back():
        group.residual.copy_(residual)
        state._residual_groups.add(group_id)

    state._folds.took(give_back)
    if not hold:
        state._residual_groups.discard(group_id)


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
    if bucket.index() == 0 and state._agreement_steps:
        agree_on_settings(state, tensor.device)
    correction = state._momentum
    if correction is None or not correction.active:
        return _reduce(state, bucket, tensor)
    # Momentum correction (oktopk.momentum): every path below reduces the
    # velocity's step in place of the gradient, and the optimizer gets the
    # G on which its own momentum lands on the average.
    if bucket.index() == 0:
        correction.begin_step()
    work = correction.before(bucket.parameters(), state._layout.members(bucket), tensor)
    fut = _reduce(state, bucket, tensor)
    if work is None:
        return fut
    return fut.then(lambda f: correction.after(work, f.value()))


def _reduce(state, bucket, tensor):
    """oktopk_hook's future of the bucket's average, by the step's path."""
    is_last = bucket.is_last()
    # Every bucket of one iteration is in the same phase: they were all
    # fired with the same state.iter, which the last one advances.
    phase_iter = state.iter
    rebuilt = state._hook_iters > 0  # not DDP's first, provisional, layout
    if state._hook_iters < 2:  # the provisional layout and the rebuilt one: every parameter
        state._optimizers.watch(bucket.parameters())
    if is_last:
        state.iter += 1
        state._hook_iters += 1
    layout = state._layout
    sparse = phase_iter >= state.warmup_iters
    if state._choice is not None and bucket.index() == 0:
        if sparse:
            state._folds.settle()  # before anything reads the residuals the step before folded
            _begin_step(state, phase_iter - state.warmup_iters, tensor.device, untimed=not rebuilt)
            state._folds.watching = state._path == NATIVE and bool(state._residual_groups or state._quantized or state._quantized_spill)
        elif rebuilt and phase_iter == state.warmup_iters - 1:
            state._choice.time_warmup_step()  # a native step the choice can compare the sparse probe with
    if sparse and state._path == NATIVE and (state._quantized or state._quantized_spill):
        _fold_quantized(state, bucket, tensor)
    if sparse and state._path == NATIVE and not layout.watching and not state._residual_groups:
        # Native chosen, nothing to fold: allreduce_hook's work and no more.
        if state.grads_as_bucket_views:
            state._bucket_grads.point(bucket)
        return _native_allreduce(state, tensor)
    if sparse and state._path == BF16:
        if state.grads_as_bucket_views:
            state._bucket_grads.point(bucket)
        return _bf16_allreduce(state, tensor)  # no sparse step ran: nothing to fold
    if sparse and state._path == QUANTIZED:
        return _quantized_allreduce(state, bucket, tensor)
    members = layout.members(bucket)  # numbers the parameters in the first layout
    unused = layout.take_unused(members, tensor if sparse else None)
    if not sparse:
        if rebuilt:
            layout.learn_group([i for i, _, _ in members])
        return _native_allreduce(state, tensor)
    if state._path == NATIVE:
        group_id = layout.learn_group([i for i, _, _ in members])
        if group_id in layout.groups:
            _fold_residual(state, group_id, tensor, layout.slices(group_id, members, unused))
            if is_last and state._pooled_iter == phase_iter:
                # Buckets of this step that went through the regrouping
                # pool (below) complete their groups.
                state._reducer.submit(_flush_pool, state, _call(state, phase_iter))
            return _native_allreduce(state, tensor)
        if not any(layout.group_of.get(i) in state._residual_groups for i, _, _ in members):
            # Not one group, but none of its groups holds a residual: the
            # native allreduce has nothing to fold.
            return _native_allreduce(state, tensor)
        # A bucket that is not one group (a resumed run's first step, in
        # DDP's provisional layout) whose groups hold residuals goes through
        # the sparse path's regrouping, which keeps each group's residual in
        # its own layout.
    _start(state)
    call = _call(state, phase_iter)
    if state._reducer.adaptive is None:
        state.last_density = state.density if call[0] is None else call[0]
    if tensor.device.type == "cuda":
        # The worker copies on the stream backward produced the bucket on;
        # the future's CUDA events make DDP wait for the copy back.
        fut = torch.futures.Future(devices=[tensor.device])
        stream = torch.cuda.current_stream(tensor.device)
    else:
        fut, stream = torch.futures.Future(), None
    reducer = state._reducer
    group_id = layout.learn_group([i for i, _, _ in members])
    if group_id in layout.groups:
        reducer.submit(_reduce_bucket, state, group_id, tensor, layout.slices(group_id, members, unused), fut, stream, call)
    else:
        state._pooled_iter = phase_iter
        reducer.submit(_pool_bucket, state, tensor, members, unused, fut, stream, call)
    if is_last:
        reducer.submit(_flush_pool, state, call)
        if reducer.adaptive is not None and call[1] is not None:
            reducer.submit(_adapt, state, call[1])
    return fut
