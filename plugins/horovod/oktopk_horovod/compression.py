"""The compression choice that switches Horovod training to Ok-Topk."""

import horovod.torch as hvd
from horovod.torch.compression import Compressor

from oktopk.choice import DEFAULT_MARGIN, DEFAULT_RECHECK_EVERY, check_choice
from oktopk.settings import DEFAULTS, check_settings


class OkTopkCompressor(Compressor):
    """Sparse allreduce settings, carried by ``compression=`` to
    :func:`oktopk_horovod.DistributedOptimizer`.

    It is not a tensor-to-tensor compressor: Horovod would allreduce its
    output densely. Used by ``hvd.DistributedOptimizer`` it raises instead.
    """

    def __init__(self, density=DEFAULTS.density, algorithm=DEFAULTS.algorithm, tau=DEFAULTS.tau, tau_prime=DEFAULTS.tau_prime,
                 timeout=DEFAULTS.timeout, value_dtype=DEFAULTS.value_dtype, stochastic_rounding=DEFAULTS.stochastic_rounding,
                 density_schedule=DEFAULTS.density_schedule, measure_xi_every=DEFAULTS.measure_xi_every, adaptive=DEFAULTS.adaptive,
                 sparse_margin=DEFAULT_MARGIN, recheck_every=DEFAULT_RECHECK_EVERY, device_path=None, momentum_correction=True):
        if device_path not in (None, True, False):
            raise ValueError(f"device_path must be None, True or False, got {device_path!r}")
        if not isinstance(momentum_correction, bool):
            raise ValueError(f"momentum_correction must be True or False, got {momentum_correction!r}")
        self.device_path = device_path
        self.momentum_correction = momentum_correction
        # algorithm None: the measured choice, whose sparse path is "auto".
        (self.density, self.algorithm, self.tau, self.tau_prime, self.timeout, self.value_dtype, self.stochastic_rounding,
         self.density_schedule, self.measure_xi_every, self.adaptive) = check_settings(
            density, "auto" if algorithm is None else algorithm, tau, tau_prime, timeout, value_dtype, stochastic_rounding, density_schedule,
            measure_xi_every, adaptive)
        if algorithm is None:
            self.algorithm = None
        self.sparse_margin, self.recheck_every = check_choice(sparse_margin, recheck_every)

    def compress(self, tensor):
        raise RuntimeError(
            "oktopk: Compression.oktopk() needs oktopk_horovod.DistributedOptimizer "
            "(same arguments as hvd.DistributedOptimizer); hvd.DistributedOptimizer "
            "would allreduce the gradients densely"
        )

    def decompress(self, tensor, ctx):
        raise RuntimeError("oktopk: Compression.oktopk() needs oktopk_horovod.DistributedOptimizer")

    def __repr__(self):
        return f"Compression.oktopk(density={self.density}, algorithm={self.algorithm!r}, value_dtype={self.value_dtype!r})"


class Compression(hvd.Compression):
    """Horovod's compression choices (``none``, ``fp16``) plus ``oktopk``."""

    @staticmethod
    def oktopk(density=DEFAULTS.density, algorithm=DEFAULTS.algorithm, tau=DEFAULTS.tau, tau_prime=DEFAULTS.tau_prime, timeout=DEFAULTS.timeout,
               value_dtype=DEFAULTS.value_dtype, stochastic_rounding=DEFAULTS.stochastic_rounding, density_schedule=DEFAULTS.density_schedule,
               measure_xi_every=DEFAULTS.measure_xi_every, adaptive=DEFAULTS.adaptive, sparse_margin=DEFAULT_MARGIN,
               recheck_every=DEFAULT_RECHECK_EVERY, device_path=None, momentum_correction=True):
        """Sparse allreduce sending about ``density`` of each gradient
        bucket; the rest waits in a residual (error feedback).
        ``algorithm=None`` (the default): each step takes the faster of
        Horovod's own allreduce (the residual folded in first) and the
        library's sparse allreduce (``"auto"`` among its sparse algorithms),
        from measured step times agreed across the ranks, as the DDP hook
        does: sparse only when it saves ``sparse_margin`` (10%) of the step,
        probed again every ``recheck_every`` steps (see ``oktopk.choice``;
        the optimizer's ``choice`` says what it chose and why); an
        Adam-family optimizer keeps Horovod's allreduce on every step
        (``oktopk.optimizers``). Or any of ``oktopk.ALGORITHMS``, used for every step: ``"auto"``
        (the library picks per bucket and call from a cost model and the
        measured link), ``"oktopk"``, dense ones and the sparse baselines.
        ``value_dtype="float16"`` (or ``"bfloat16"``) sends the selected
        values in 16 bits, what Horovod's fp16 compression does for a dense
        allreduce: each pair is 6 bytes instead of 8, and the rounding errors
        stay in the residuals (``stochastic_rounding`` rounds unbiasedly at
        random instead of to nearest); for ``oktopk``, ``topka``,
        ``gaussiank`` and ``auto``.
        ``density_schedule`` (``(start_density, decay_steps)`` or
        ``(start_density, decay_steps, stage_steps)``) starts at
        ``start_density`` and decays exponentially to ``density`` over
        ``decay_steps`` optimizer steps (see ``oktopk.schedule``);
        ``oktopk_state_dict()`` saves the step count with it.
        ``measure_xi_every=n`` measures ξ every n-th step (the optimizer's
        ``last_xi``), as ``OkTopkState`` does.
        ``adaptive=(min_density, max_density[, max_xi[, min_tau_prime]])``
        sets each step's density from the measured ξ and τ′ from the ranks'
        count drift, within these bounds, as ``OkTopkState`` does (see
        ``oktopk.adaptive``); ``oktopk_state_dict()`` saves where it
        stands. ``device_path`` is ``OkTopkState``'s: by default a bucket
        of CUDA gradients is selected on the GPU and only its pairs cross
        to the host (``oktopk.device``); ``True`` forces that on CPU
        gradients too, ``False`` stages every bucket through host memory.
        ``momentum_correction`` is ``OkTopkState``'s: when the wrapped
        optimizer is ``torch.optim.SGD`` with momentum (and ``op`` is
        Average), each rank's velocity is what is reduced, and the optimizer
        gets the gradient on which its own momentum lands on the average
        (``oktopk.momentum``); ``oktopk_state_dict()`` carries it."""
        return OkTopkCompressor(density, algorithm, tau, tau_prime, timeout, value_dtype, stochastic_rounding, density_schedule, measure_xi_every,
                                adaptive, sparse_margin, recheck_every, device_path, momentum_correction)
