"""The state of the DDP hook (``oktopk.hook``) and of the FSDP2
registration (``oktopk.fsdp``): what the user sets, and the engine that
runs their steps (``oktopk.engine``). Its checkpoint (``state_dict``, and
pickling) is made and checked in ``oktopk.checkpoint``.

``OkTopkState`` keeps the module name ``oktopk.ddp``, where it was defined
first and from where it is still imported: pickles and ``torch.load``
allow-lists name it so, and a state pickled by this version loads in an
older one.
"""

from . import checkpoint
from .engine import Engine
from .settings import Adaptation, Choice, Faults, Momentum, Settings, Warmup, Wire, check_process_group, default_of


class OkTopkState(Engine):
    """What the DDP hook (:func:`oktopk_hook`) and the FSDP2 registration
    (``oktopk.fsdp.register``) run by, and the engine that runs their steps
    (``oktopk.engine``): the residuals, the measured choice, the momentum
    correction, the communicator.

    ``OkTopkState()`` with no arguments is the one line: the measured
    choice between the process group's allreduce and a compressed path,
    1% density, the defaults below. Four settings sit at the top; the rest
    in named groups, each an immutable :class:`oktopk.Settings` part with its
    defaults::

        OkTopkState(density=0.05, momentum=Momentum(masking="waited"), warmup=Warmup(iters=10))

    Every setting is also accepted by its flat name (``warmup_iters=10``,
    ``momentum_masking="waited"``: ``oktopk.settings.FLAT``), and read back
    by it (``state.warmup_iters``); ``state.settings`` is the whole
    :class:`oktopk.Settings`, which ``OkTopkState.from_settings`` takes.
    ``repr`` shows what differs from the defaults. Settings are checked
    when the state is made (ValueError naming the bad one) and never
    change after.

    :param process_group: the group to reduce over (``None``: the default).
    :param density: fraction of each bucket's entries sent, a real number in
        (0, 1].
    :param algorithm: ``None`` (the default): each step after the warm-up
        takes the faster of two paths, measured: the process group's own
        allreduce (gloo, NCCL, MPI, as ``allreduce_hook``; the residual is
        folded in first, so nothing waits) or the library's sparse
        allreduce with ``"auto"``. The hook times whole steps on every rank,
        agrees on the slowest rank's figures, chooses sparse only when it
        saves ``sparse_margin`` of the step, and probes again
        ``recheck_every`` steps after, backing off while the choice holds (see ``oktopk.choice``; ``"auto"`` there
        chooses among the sparse algorithms only; ``choice`` says what
        it chose and why, and ``OKTOPK_DEBUG_AUTO=1`` logs each decision on
        rank 0). Parameters that an Adam-family optimizer steps stay dense
        on every step: the same choice runs between the process group's
        allreduce and ``dense_compression`` (``oktopk.optimizers``).
        Or one of ``oktopk.ALGORITHMS``, run on every step after the
        warm-up: ``"auto"`` (the library picks per bucket and call from a
        cost model and the measured link), ``"oktopk"``, the dense ones, the
        sparse baselines.
    :param timeout: seconds a call, or the communicator's setup, may wait for
        a peer before it raises :class:`OkTopkError` instead of hanging.

    **warmup=Warmup(iters, compression)**

    :param iters (warmup_iters): iterations reduced densely first; at least 2.
        DDP reduces its first iteration in a provisional bucket layout and
        rebuilds its buckets after it. The hook keeps residuals in the
        rebuilt layout, which it first sees in the second iteration; only
        from the third on is that layout known before every step, so that a
        checkpoint taken at any step holds it (PowerSGD likewise starts after
        DDP's first two iterations).
    :param compression (warmup_compression): how the warm-up's iterations are reduced:
        ``None`` (the default: the process group's allreduce in float32,
        exact), ``"quantized"`` (4 bits per value with error feedback, as
        ``dense_compression``; what the residuals hold joins the first step
        after the warm-up) or ``"bf16"``, on every iteration but DDP's first
        (always bfloat16: no residual can be kept in its provisional layout)
        and second (native: the step the measured choice times). A long
        warm-up then costs a few bits per value a step, not 32: on the
        demo's MLP at 200 Mbit/s (results/sgd.md) 10 warm-up steps with
        ``momentum_masking="waited"`` reached 95% in dense's steps.

    **choice=Choice(sparse_margin, recheck_every, dense_compression, sparse, sparse_after)**

    :param sparse_margin: with ``algorithm=None``, the share of the native
        step a sparse step (or, under an Adam-family optimizer, a bfloat16
        one) must save to be chosen (default 0.10): a native step is exact,
        a sparse one leaves most of the gradient waiting.
    :param recheck_every: with ``algorithm=None``, steps from a decision to
        the next probe of the path not chosen (each probe runs 4 steps;
        default 200); each probe that keeps the choice doubles the wait for
        the next, up to 8 × ``recheck_every``, and a switch starts it over.
    :param dense_compression: with ``algorithm=None``, the path measured
        against the process group's allreduce for parameters an Adam-family
        optimizer steps: ``"quantized"`` (the default: every value every
        step in 4 bits per block of 32 with error feedback, about 0.14 of
        float32's bytes, ``oktopk.quantized``), ``"bf16"`` (that allreduce
        in bfloat16, as ``bf16_compress_hook``: half the bytes, no
        residual), ``"fp16"`` (in float16, as ``fp16_compress_hook``) or
        ``None`` (float32 on every step). Over seeds, each method at its
        best learning rate, the 4-bit path's mean loss stayed within plain
        DDP's spread on the AdamW transformer and the BERT-style example of
        results/text.md.
    :param sparse: with ``algorithm=None``, whether the path measured
        against native under other optimizers (SGD) is the sparse one
        (default True). False: ``dense_compression``'s path there too, so no
        step is sparse: every value every step, no entry waits in a
        residual. Under SGD with momentum at 1%, top-k ended 3.5 points
        below plain DDP on a 100-step MLP and 0.8 below on a 1,200-step CNN
        (3 seeds each); the 4-bit path ended within 0.2 of it on both, for
        about 0.14 of float32's bytes against top-k's 0.02, and at 200
        Mbit/s reached the MLP's 95% 2.9× sooner than plain DDP where top-k
        took 3.5× (results/sgd.md).
    :param sparse_after: with ``algorithm=None`` and ``sparse=True``, the
        steps after the warm-up in which ``dense_compression``'s path
        stands in sparse's place under SGD (default 100; 0: sparse from
        the first): the early steps, where top-k's delays cost the most
        accuracy, go every value every step where that measures faster
        than native, and sparse joins the choice after them
        (``oktopk.choice``).

    **momentum=Momentum(correction, masking, local_clip_norm)**

    :param correction (momentum_correction): for parameters that ``torch.optim.SGD`` steps
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
        a clip that scales every value by one factor (``clip_grad_norm_``,
        the frameworks' default) is followed; anything else that changes
        ``.grad`` before the step (GradScaler's ``unscale_``, a clip by
        value) stops the correction, with a warning
        (``momentum_status`` says why). False: the
        optimizer's momentum acts on the sparse average (measured: the demo's
        MLP swings and ends lower, results/sgd.md).
    :param masking (momentum_masking): with the correction, DGC's momentum factor
        masking: True zeroes this rank's velocity where its entry was sent
        (every entry on a dense step: at density 1 this is SGD without
        momentum); "waited" only where an entry was sent after waiting in
        the residual (at density 1 nothing waits: dense SGD); ``(rule, n)``
        that rule over the first n steps with a sparse call; False none.
        Named rules need float32 values (``oktopk.momentum``,
        results/sgd.md). The default, "auto", is ``("waited", 100)``
        (``oktopk.settings.AUTO_MASKING_STEPS``) where masking can act (the
        DDP hook with float32 values), else none.
    :param local_clip_norm: with the correction, DGC's local gradient
        clipping (default None: off): each rank's gradient of each corrected
        parameter is clipped to norm ``local_clip_norm / sqrt(P)`` before it
        enters the velocity.

    **wire=Wire(value_dtype, stochastic_rounding, tau, tau_prime, device_path, grads_as_bucket_views)**

    :param value_dtype: the precision selected values travel in:
        ``"float32"`` (default), ``"float16"`` or ``"bfloat16"`` (or the torch
        dtype), or ``"int8"``/``"int4"`` (8- or 4-bit codes with a scale per
        block of 32 values), for the algorithms ``oktopk``, ``topka``,
        ``gaussiank`` and ``auto``. The rounding errors stay in the
        residuals, so nothing is lost.
    :param stochastic_rounding: round 16-bit values up or down at random,
        unbiasedly, instead of to nearest (reproducible: the random bits are
        a hash of the bucket, step, rank and index).
    :param tau: Ok-Topk's space repartition period (iterations).
    :param tau_prime: threshold refresh period (iterations).
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

    **adaptation=Adaptation(density_schedule, adaptive, measure_xi_every)**

    :param density_schedule: ``None`` (``density`` from the first sparse
        step), or ``(start_density, decay_steps)`` or ``(start_density,
        decay_steps, stage_steps)``: the density starts at
        ``start_density`` and decays exponentially to ``density`` over
        ``decay_steps`` sparse steps, changing every ``stage_steps`` steps
        (see ``oktopk.schedule``). It follows ``iter``, which
        :meth:`state_dict` saves with the schedule, so a resumed run
        continues it exactly.
    :param adaptive: ``None``, or ``(min_density, max_density[, max_xi[,
        min_tau_prime]])``: each step's density and τ′ are set from the
        measured ξ and the ranks' count drift, within these bounds (see
        ``oktopk.adaptive``; ``max_xi`` 1.0 and ``min_tau_prime``
        ``tau_prime // 8`` by default), starting from ``density`` and
        ``tau_prime``; ``measure_xi_every`` is then 50 unless given.
        ``last_density`` and ``last_tau_prime`` say what the latest step
        used. Not with ``density_schedule``.
    :param measure_xi_every: ``None`` (never), or n: every n-th sparse step
        (the first included) also measures ξ, the distance of the result from
        the exact top-k of the accumulated gradients' sum relative to the
        gradients' sum (Assumption 1 of the Ok-Topk paper), over all buckets:
        ``last_xi`` then holds it and ``last_xi_step`` the step (``iter``
        before it), the same on every rank. A measured step costs a dense
        allreduce of twice the gradients more, and its result is bitwise
        what it is unmeasured. Dense algorithms measure nothing.

    **faults=Faults(on_rank_loss)**

    :param on_rank_loss: ``"stop"`` (the default): a lost rank (dead,
        stopped, unreachable) fails the step on every survivor within the
        timeout, naming it, for a restart from a checkpoint (torchrun's
        ``--max-restarts``, docs/failures.md). ``"continue"``: the step it
        was lost in is void on every survivor (its optimizer step steps
        nothing, ``iter`` does not count it), and from the next step the
        survivors go on without it, each step averaged over those who
        contributed (``oktopk.continuing``). The lost rank's residual is
        gone with it; ``rank_losses`` records each loss, with an estimate of
        that mass. Needs a named ``algorithm`` (every step after the warm-up
        the library's), the DDP hook (not FSDP2, not Horovod's optimizer,
        whose collectives are the framework's), and a model whose forward
        issues no collective (``DistributedDataParallel(...,
        broadcast_buffers=False)``, or no buffers). A loss during the
        warm-up, or of the rank that hosts the job's store, still ends the
        run.

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
    take the device path, or are staged through pinned host memory. A step whose gradient holds NaN or
    Inf on any rank comes back as NaN on every rank (the library skips it and
    keeps its state), so ``torch.amp.GradScaler`` or the script's own check
    skips the optimizer step, as with ``allreduce_hook``.
    """

    __slots__ = ()

    def __init__(self, process_group=None, density=default_of("density"), algorithm=default_of("algorithm"), *,
                 timeout=default_of("timeout"), warmup=Warmup(), choice=Choice(), momentum=Momentum(), wire=Wire(),
                 adaptation=Adaptation(), faults=Faults(), **flat):
        settings = Settings(density, algorithm, timeout, warmup, choice, momentum, wire, adaptation, faults)
        if flat:
            settings = settings.with_flat(**_known(flat))
        Engine.__init__(self, settings, check_process_group(process_group))

    @classmethod
    def from_settings(cls, settings, process_group=None):
        """A state that runs by ``settings`` (an :class:`oktopk.Settings`),
        over ``process_group``."""
        if not isinstance(settings, Settings):
            raise TypeError(f"settings must be an oktopk.Settings, got {type(settings).__name__}")
        state = cls.__new__(cls)
        Engine.__init__(state, settings, check_process_group(process_group))
        return state

    @property
    def quantized_bytes_sent(self):
        """Bytes this rank sent on the quantized path (``oktopk.quantized``),
        apart from ``bytes_sent`` (the library's sparse calls)."""
        return self._quantized_bytes

    @property
    def sparse_margin(self):
        return None if self._choice is None else self._choice.margin

    @property
    def recheck_every(self):
        return None if self._choice is None else self._choice.recheck_every

    def __repr__(self):
        """OkTopkState(...) naming only what differs from the defaults: what
        was chosen for this job, at a glance."""
        changed = self._settings.changed()
        if self._choice is None:  # the measured choice's own settings mean nothing then
            changed.pop("choice", None)
        if self.process_group is not None:
            changed = {"process_group": self.process_group, **changed}
        return "OkTopkState(" + ", ".join(f"{name}={value!r}" for name, value in changed.items()) + ")"

    def __getstate__(self):
        return checkpoint.pickled(self)

    def __setstate__(self, state):
        OkTopkState.__init__(self, **checkpoint.constructor_arguments(state))
        self.load_state_dict(state)


def _known(flat):
    """The flat-named settings passed as keywords; TypeError naming an
    unknown keyword as Python would, with the settings there are."""
    from .settings import FLAT

    unknown = sorted(set(flat) - set(FLAT))
    if unknown:
        raise TypeError(f"OkTopkState() got an unexpected keyword argument {unknown[0]!r}; its settings are process_group, density, "
                        f"algorithm, timeout and the groups warmup, choice, momentum, wire, adaptation (or any of "
                        f"{', '.join(n for n in FLAT if n not in ('density', 'algorithm', 'timeout'))} by name)")
    return flat


OkTopkState.__module__ = "oktopk.ddp"  # see the module's docstring; oktopk.ddp imports it from here
