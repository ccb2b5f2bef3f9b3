"""The compression choice that switches Horovod training to Ok-Topk: it
carries an :class:`oktopk.Settings`, the settings object the DDP hook and
FSDP2 run by, checked in the same place with the same messages."""

import horovod.torch as hvd
from horovod.torch.compression import Compressor

from oktopk import Settings

# Compression.oktopk's flat keywords, in its signature's order: the
# settings a Horovod job runs by.
FLAT_KEYWORDS = ("density", "algorithm", "tau", "tau_prime", "timeout", "value_dtype", "stochastic_rounding", "density_schedule",
                 "measure_xi_every", "adaptive", "sparse_margin", "recheck_every", "device_path", "momentum_correction")

# The settings Horovod's optimizer cannot honour, and why: a Settings that
# sets one otherwise than its default is refused rather than ignored.
NOT_UNDER_HOROVOD = {
    "warmup_iters": "Horovod's buckets are fixed by name before the first step, so there is no dense warm-up: every step takes "
                    "the path (or the measured choice) from the first",
    "warmup_compression": "there is no dense warm-up under Horovod",
    "dense_compression": "Horovod's optimizer has no compressed dense path: under an Adam-family optimizer the measured choice "
                         "keeps Horovod's own allreduce",
    "sparse": "Horovod's optimizer has no compressed dense path to measure in sparse's place",
    "sparse_after": "Horovod's optimizer has no compressed dense path for the early steps",
    "momentum_masking": "Horovod's momentum correction does not read which entries were sent",
    "local_clip_norm": "Horovod's momentum correction does not clip locally",
    "grads_as_bucket_views": "it points .grad at a DDP bucket; Horovod's buckets are the gradients themselves",
}


def horovod_settings(settings):
    """``settings`` as Horovod's optimizer runs them: ValueError naming each
    setting it cannot honour (NOT_UNDER_HOROVOD); ``dense_compression``
    None and ``momentum_masking`` False, what Horovod does (their defaults
    are accepted as meaning that)."""
    flat = settings.flat()
    refused = [f"{name}={flat[name]!r} ({why})" for name, why in NOT_UNDER_HOROVOD.items()
               if flat[name] != Settings.default(name) and not (name == "dense_compression" and flat[name] is None)]
    if refused:
        raise ValueError("oktopk_horovod: settings Horovod's optimizer cannot honour: " + "; ".join(refused))
    return settings.with_flat(dense_compression=None, momentum_masking=False)


def _flat_property(name):
    return property(lambda self: self.settings.flat()[name], doc=f"The ``{name}`` setting (read-only).")


class OkTopkCompressor(Compressor):
    """Sparse allreduce settings (:attr:`settings`, an
    :class:`oktopk.Settings`), carried by ``compression=`` to
    :func:`oktopk_horovod.DistributedOptimizer`; each setting is also read
    by its flat name (``compressor.density``).

    It is not a tensor-to-tensor compressor: Horovod would allreduce its
    output densely. Used by ``hvd.DistributedOptimizer`` it raises instead.
    """

    def __init__(self, settings):
        if not isinstance(settings, Settings):
            raise TypeError(f"settings must be an oktopk.Settings, got {type(settings).__name__}")
        self.settings = horovod_settings(settings)

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


for _name in FLAT_KEYWORDS:
    setattr(OkTopkCompressor, _name, _flat_property(_name))
del _name


class Compression(hvd.Compression):
    """Horovod's compression choices (``none``, ``fp16``) plus ``oktopk``."""

    @staticmethod
    def oktopk(density=Settings.default("density"), algorithm=Settings.default("algorithm"), tau=Settings.default("tau"),
               tau_prime=Settings.default("tau_prime"), timeout=Settings.default("timeout"), value_dtype=Settings.default("value_dtype"),
               stochastic_rounding=Settings.default("stochastic_rounding"), density_schedule=Settings.default("density_schedule"),
               measure_xi_every=Settings.default("measure_xi_every"), adaptive=Settings.default("adaptive"),
               sparse_margin=Settings.default("sparse_margin"), recheck_every=Settings.default("recheck_every"),
               device_path=Settings.default("device_path"), momentum_correction=Settings.default("momentum_correction"), *,
               settings=None):
        """Sparse allreduce sending about ``density`` of each gradient
        bucket; the rest waits in a residual (error feedback).
        ``algorithm=None`` (the default): each step takes the faster of
        Horovod's own allreduce (the residual folded in first) and the
        library's sparse allreduce (``"auto"`` among its sparse algorithms),
        from measured step times agreed across the ranks, as the DDP hook
        does: sparse only when it saves ``sparse_margin`` (10%) of the step,
        probed again ``recheck_every`` steps after, backing off while the
        choice holds (see ``oktopk.choice``;
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
        (``oktopk.momentum``); ``oktopk_state_dict()`` carries it.
        Or ``settings=``, a whole :class:`oktopk.Settings` (the DDP hook's
        and FSDP2's settings object), in place of the flat keywords; a
        setting Horovod's optimizer cannot honour (a warm-up, a compressed
        dense path, momentum masking or local clipping) is refused with a
        ValueError saying why."""
        flat = {"density": density, "algorithm": algorithm, "tau": tau, "tau_prime": tau_prime, "timeout": timeout, "value_dtype": value_dtype,
                "stochastic_rounding": stochastic_rounding, "density_schedule": density_schedule, "measure_xi_every": measure_xi_every,
                "adaptive": adaptive, "sparse_margin": sparse_margin, "recheck_every": recheck_every, "device_path": device_path,
                "momentum_correction": momentum_correction}
        if settings is None:
            return OkTopkCompressor(Settings.from_flat(**flat))
        changed = sorted(name for name, value in flat.items() if value != Settings.default(name))
        if changed:
            raise ValueError(f"Compression.oktopk: pass either settings= or the flat keywords, not both (got settings= and "
                             f"{', '.join(changed)})")
        return OkTopkCompressor(settings)
