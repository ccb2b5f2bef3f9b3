"""The state of the DDP hook (``oktopk.hook``) and of the FSDP2
registration (``oktopk.fsdp``): their settings and where the run stands.
Its checkpoint (``state_dict``, and pickling) is made and checked in
``oktopk.checkpoint``.

``OkTopkState`` keeps the module name ``oktopk.ddp``, where it was defined
first and from where it is still imported: pickles and ``torch.load``
allow-lists name it so, and a state pickled by this version loads in an
older one.
"""

import inspect

from .adaptive import AdaptiveControl
from . import checkpoint
from .choice import BF16, DEFAULT_MARGIN, DEFAULT_RECHECK_EVERY, SPARSE, StepChoice, check_choice, check_dense_compression
from . import device as device_path_
from .layout import BucketLayout
from .momentum import MomentumCorrection
from .optimizers import OptimizerWatch
from .path_native import BucketGrads
from .reducer import Reducer, ReducerStats, StepFolds
from .settings import DEFAULT_WARMUP_ITERS, DEFAULTS, check_momentum_options, check_process_group, check_settings, check_warmup_iters


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
    :param warmup_compression: how the warm-up's iterations are reduced:
        ``None`` (the default: the process group's allreduce in float32,
        exact), ``"quantized"`` (4 bits per value with error feedback, as
        ``dense_compression``; what the residuals hold joins the first step
        after the warm-up) or ``"bf16"``, on every iteration but DDP's first
        (always bfloat16: no residual can be kept in its provisional layout)
        and second (native: the step the measured choice times). A long
        warm-up then costs a few bits per value a step, not 32: on the
        demo's MLP at 200 Mbit/s (results/sgd.md) 10 warm-up steps with
        ``momentum_masking="waited"`` reached 95% in dense's steps.
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
        copying in, and this saves that pass back (on loopback without it
        the 17.1M MLP's native step took 1.06x plain DDP's, with it the
        same, results/ddp_matrix.md). The values are the same bit for bit; what
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
        first step and costs three more copies of the gradients per rank
        (two without weight decay).
        ``.grad`` then holds that gradient, not the average of the ranks':
        a script that rescales ``.grad`` before the step (GradScaler,
        clipping) stops the correction, with a warning. False: the
        optimizer's momentum acts on the sparse average (measured: the demo's
        MLP swings and ends lower, results/sgd.md).
    :param momentum_masking: with the correction, DGC's momentum factor
        masking (default False): True zeroes this rank's velocity where its
        entry was sent (every entry on a dense step: at density 1 this is
        SGD without momentum); "waited" only where an entry was sent after
        waiting in the residual (at density 1 nothing waits: dense SGD).
        float32 values only (``oktopk.momentum``, results/sgd.md).
    :param local_clip_norm: with the correction, DGC's local gradient
        clipping (default None: off): each rank's gradient of each corrected
        parameter is clipped to norm ``local_clip_norm / sqrt(P)`` before it
        enters the velocity.
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
        "density", "algorithm", "warmup_iters", "tau", "tau_prime", "timeout", "value_dtype", "stochastic_rounding", "density_schedule",
        "measure_xi_every", "adaptive", "process_group", "iter", "last_density", "last_tau_prime", "_reducer", "_layout", "_pending_state",
        "_hook_iters", "_owner", "_adapt_error", "_choice", "_path", "_residual_groups", "_pooled_iter", "_optimizers", "device_path",
        "_device_groups", "_library_groups", "_host_buffers", "dense_compression", "_quantized", "_quantized_bytes", "_quantized_spill",
        "grads_as_bucket_views", "_bucket_grads", "warmup_compression", "momentum_correction", "momentum_masking", "local_clip_norm", "_momentum", "_agreement_steps", "_folds",
        "_communicator_at_load", "_link",
    ]

    def __init__(self, process_group=None, density=DEFAULTS.density, algorithm=DEFAULTS.algorithm, warmup_iters=DEFAULT_WARMUP_ITERS,
                 tau=DEFAULTS.tau, tau_prime=DEFAULTS.tau_prime, timeout=DEFAULTS.timeout, value_dtype=DEFAULTS.value_dtype,
                 stochastic_rounding=DEFAULTS.stochastic_rounding, density_schedule=DEFAULTS.density_schedule,
                 measure_xi_every=DEFAULTS.measure_xi_every, adaptive=DEFAULTS.adaptive, sparse_margin=DEFAULT_MARGIN,
                 recheck_every=DEFAULT_RECHECK_EVERY, device_path=None, dense_compression=BF16, grads_as_bucket_views=True,
                 momentum_correction=True, momentum_masking=False, local_clip_norm=None, warmup_compression=None):
        if device_path is not None and not isinstance(device_path, bool):  # 0 == False, yet 0 is no setting
            raise ValueError(f"device_path must be None, True or False, got {device_path!r}")
        process_group = check_process_group(process_group)
        # Checked whatever the algorithm, though only the measured choice
        # (algorithm None) reads them: a bad value is refused, never ignored.
        sparse_margin, recheck_every = check_choice(sparse_margin, recheck_every)
        dense_compression = check_dense_compression(dense_compression)
        settings = check_settings(density, "auto" if algorithm is None else algorithm, tau, tau_prime, timeout, value_dtype, stochastic_rounding,
                                  density_schedule, measure_xi_every, adaptive)
        self.warmup_iters = check_warmup_iters(warmup_iters)
        self.warmup_compression = check_dense_compression(warmup_compression, "warmup_compression")
        if not isinstance(grads_as_bucket_views, bool):
            raise ValueError(f"grads_as_bucket_views must be True or False, got {grads_as_bucket_views!r}")
        self.grads_as_bucket_views = grads_as_bucket_views
        if not isinstance(momentum_correction, bool):
            raise ValueError(f"momentum_correction must be True or False, got {momentum_correction!r}")
        self.momentum_correction = momentum_correction
        self.momentum_masking, self.local_clip_norm = check_momentum_options(momentum_correction, momentum_masking, local_clip_norm,
                                                                             settings.value_dtype)
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
            self._momentum = MomentumCorrection(lambda p: index.get(id(p)), self.momentum_masking, self.local_clip_norm, process_group)
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
        # The link model "auto" chose by (a dict, or None before one was
        # measured): a communicator made again, or a resumed run, gets this
        # one rather than a new measurement that may choose otherwise.
        self._link = None
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
        # Where a loaded checkpoint's run had its communicator (made at a
        # sparse step, not released since): the path of the step it was
        # saved after, until this run's first step after the warm-up; else
        # None. A native step there makes the communicator again and folds
        # the residuals through it, as that run did. A released
        # communicator (native chosen) stays released: what it held back
        # (parameters unused on this rank) waits for the next sparse step.
        self._communicator_at_load = None

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

    # -- checkpointing (oktopk.checkpoint: what a checkpoint holds, and why) --

    def _check_owner(self):
        """Refuse a checkpoint of another rank or world size
        (``oktopk.checkpoint.check_owner``)."""
        checkpoint.check_owner(self)

    def state_dict(self):
        """Iteration counter, the parameter groups residuals are kept in,
        every group's residual and thresholds, and the rank and world size
        they belong to, so a resumed run continues where this one stopped
        (also into DDP's initial bucket layout), and a checksum of it all.
        Every rank saves its own."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state):
        """Restore a state_dict() saved by this same rank of a run of the same
        world size; another rank's or another size's raises ValueError (here,
        or at the first sparse step when the process group does not exist
        yet), saying what to do; so does one whose checksum fails (a
        field or byte changed since it was saved)."""
        checkpoint.load_state_dict(self, state)

    def __repr__(self):
        """OkTopkState(...) naming only the settings that differ from their
        defaults: what was chosen for this job, at a glance."""
        values = {"process_group": self.process_group, "density": self.density, "algorithm": self.algorithm,
                  "warmup_iters": self.warmup_iters, "tau": self.tau, "tau_prime": self.tau_prime, "timeout": self.timeout,
                  "value_dtype": self.value_dtype, "stochastic_rounding": self.stochastic_rounding,
                  "density_schedule": self.density_schedule, "measure_xi_every": self.measure_xi_every, "adaptive": self.adaptive,
                  "device_path": self.device_path, "dense_compression": self.dense_compression,
                  "grads_as_bucket_views": self.grads_as_bucket_views, "momentum_correction": self.momentum_correction,
                  "momentum_masking": self.momentum_masking, "local_clip_norm": self.local_clip_norm,
                  "warmup_compression": self.warmup_compression}
        if self._choice is not None:  # the measured choice's own settings (algorithm None)
            values["sparse_margin"], values["recheck_every"] = self._choice.margin, self._choice.recheck_every
        defaults = {name: p.default for name, p in inspect.signature(OkTopkState.__init__).parameters.items() if name != "self"}
        return "OkTopkState(" + ", ".join(f"{name}={value!r}" for name, value in values.items() if value != defaults[name]) + ")"

    def __getstate__(self):
        return checkpoint.pickled(self)

    def __setstate__(self, state):
        args, kwargs = checkpoint.constructor_arguments(state)
        OkTopkState.__init__(self, *args, **kwargs)
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


OkTopkState.__module__ = "oktopk.ddp"  # see the module's docstring; oktopk.ddp imports it from here
