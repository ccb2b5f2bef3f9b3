"""The compression choice that switches Horovod training to Ok-Topk."""

import horovod.torch as hvd
from horovod.torch.compression import Compressor

from oktopk import _lib


class OkTopkCompressor(Compressor):
    """Sparse allreduce settings, carried by ``compression=`` to
    :func:`oktopk_horovod.DistributedOptimizer`.

    It is not a tensor-to-tensor compressor: Horovod would allreduce its
    output densely. Used by ``hvd.DistributedOptimizer`` it raises instead.
    """

    def __init__(self, density=0.01, algorithm=None, tau=64, tau_prime=32, timeout=60.0):
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
        self.density = float(density)
        self.algorithm = algorithm
        self.tau = tau
        self.tau_prime = tau_prime
        self.timeout = float(timeout)

    def compress(self, tensor):
        raise RuntimeError(
            "oktopk: Compression.oktopk() needs oktopk_horovod.DistributedOptimizer "
            "(same arguments as hvd.DistributedOptimizer); hvd.DistributedOptimizer "
            "would allreduce the gradients densely"
        )

    def decompress(self, tensor, ctx):
        raise RuntimeError("oktopk: Compression.oktopk() needs oktopk_horovod.DistributedOptimizer")

    def __repr__(self):
        return f"Compression.oktopk(density={self.density}, algorithm={self.algorithm!r})"


class Compression(hvd.Compression):
    """Horovod's compression choices (``none``, ``fp16``) plus ``oktopk``."""

    @staticmethod
    def oktopk(density=0.01, algorithm=None, tau=64, tau_prime=32, timeout=60.0):
        """Ok-Topk sparse allreduce sending about ``density`` of each
        gradient bucket; the rest waits in a residual (error feedback).
        ``algorithm`` picks any of ``oktopk.ALGORITHMS``: ``"auto"`` (the
        library picks per bucket and call from a cost model and the measured
        link), dense ones and the sparse baselines too; ``None``, the
        library's default (``"oktopk"`` in this version)."""
        return OkTopkCompressor(density, algorithm, tau, tau_prime, timeout)
