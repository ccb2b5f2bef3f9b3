"""The compression choice that switches Horovod training to Ok-Topk."""

import horovod.torch as hvd
from horovod.torch.compression import Compressor

from oktopk import _lib
from oktopk.comm import value_dtype_name
from oktopk.adaptive import DEFAULT_EVERY, check_adaptive
from oktopk.schedule import check_schedule

# The algorithms that send float16 or bfloat16 values (each rounding has one
# rank whose residual takes its error; the others forward partial sums).
_REDUCED_VALUE_ALGORITHMS = ("oktopk", "topka", "gaussiank", "auto")


class OkTopkCompressor(Compressor):
    """Sparse allreduce settings, carried by ``compression=`` to
    :func:`oktopk_horovod.DistributedOptimizer`.

    It is not a tensor-to-tensor compressor: Horovod would allreduce its
    output densely. Used by ``hvd.DistributedOptimizer`` it raises instead.
    """

    def __init__(self, density=0.01, algorithm=None, tau=64, tau_prime=32, timeout=60.0, value_dtype="float32", stochastic_rounding=False,
                 density_schedule=None, measure_xi_every=None, adaptive=None):
        if not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        if algorithm is None:
            algorithm = _lib.default_algorithm()
        _lib.algorithm_code(algorithm)  # ValueError naming the choices
        for name, value in (("tau", tau), ("tau_prime", tau_prime)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        value_dtype = value_dtype_name(value_dtype)
        if value_dtype != "float32" and algorithm not in _REDUCED_VALUE_ALGORITHMS:
            raise ValueError(f"value_dtype {value_dtype} needs algorithm oktopk, topka, gaussiank or auto, not {algorithm!r}")
        if not isinstance(stochastic_rounding, bool) or stochastic_rounding and value_dtype == "float32":
            raise ValueError(f"stochastic_rounding must be a bool, and True only with float16 or bfloat16 values, got {stochastic_rounding!r}")
        density_schedule = check_schedule(density_schedule, float(density))
        if measure_xi_every is not None and (not isinstance(measure_xi_every, int) or isinstance(measure_xi_every, bool) or measure_xi_every < 1):
            raise ValueError(f"measure_xi_every must be None or a positive integer, got {measure_xi_every!r}")
        adaptive = check_adaptive(adaptive, tau_prime)
        if adaptive is not None and density_schedule is not None:
            raise ValueError("adaptive and density_schedule both set the density of each step: pass one of them")
        if adaptive is not None and measure_xi_every is None:
            measure_xi_every = DEFAULT_EVERY
        self.adaptive = adaptive
        self.density = float(density)
        self.density_schedule = density_schedule
        self.measure_xi_every = measure_xi_every
        self.algorithm = algorithm
        self.tau = tau
        self.tau_prime = tau_prime
        self.timeout = float(timeout)
        self.value_dtype = value_dtype
        self.stochastic_rounding = stochastic_rounding

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
    def oktopk(density=0.01, algorithm=None, tau=64, tau_prime=32, timeout=60.0, value_dtype="float32", stochastic_rounding=False,
               density_schedule=None, measure_xi_every=None, adaptive=None):
        """Ok-Topk sparse allreduce sending about ``density`` of each
        gradient bucket; the rest waits in a residual (error feedback).
        ``algorithm`` picks any of ``oktopk.ALGORITHMS``: ``"auto"`` (the
        library picks per bucket and call from a cost model and the measured
        link), dense ones and the sparse baselines too; ``None``, the
        library's default (``"oktopk"`` in this version).
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
        stands."""
        return OkTopkCompressor(density, algorithm, tau, tau_prime, timeout, value_dtype, stochastic_rounding, density_schedule, measure_xi_every,
                                adaptive)
