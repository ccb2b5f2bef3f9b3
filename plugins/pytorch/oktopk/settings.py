"""The sparse-allreduce settings shared by the DDP hook's OkTopkState and
Horovod's Compression.oktopk: their defaults and their checks, in one place,
so that both accept and refuse the same values with the same messages (and
the DDP hook's own warm-up length, beside them)."""

import numbers
from collections import namedtuple

from . import _lib
from .adaptive import DEFAULT_EVERY, check_adaptive
from .comm import value_dtype_name
from .schedule import check_schedule

MAX_INT32 = 2**31 - 1

Settings = namedtuple(
    "Settings",
    "density algorithm tau tau_prime timeout value_dtype stochastic_rounding density_schedule measure_xi_every adaptive",
)


# Every setting's default, the one copy: the DDP state's and the Horovod
# compressor's signatures take theirs from here (algorithm None: the
# measured choice between the framework's allreduce and sparse "auto", see
# oktopk.choice, whose settings are there; measure_xi_every None: never, or
# DEFAULT_EVERY with adaptive).
DEFAULTS = Settings(density=0.01, algorithm=None, tau=64, tau_prime=32, timeout=60.0, value_dtype="float32", stochastic_rounding=False,
                    density_schedule=None, measure_xi_every=None, adaptive=None)


def is_real(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_settings(density=DEFAULTS.density, algorithm=DEFAULTS.algorithm, tau=DEFAULTS.tau, tau_prime=DEFAULTS.tau_prime,
                   timeout=DEFAULTS.timeout, value_dtype=DEFAULTS.value_dtype, stochastic_rounding=DEFAULTS.stochastic_rounding,
                   density_schedule=DEFAULTS.density_schedule, measure_xi_every=DEFAULTS.measure_xi_every, adaptive=DEFAULTS.adaptive):
    """The settings, checked and normalized (algorithm None: the library's
    default; measure_xi_every None with adaptive: its default); ValueError
    naming the first bad one."""
    if not is_real(density) or not 0.0 < density <= 1.0:
        raise ValueError(f"density must be a real number in (0, 1], got {density!r}")
    if algorithm is None:
        algorithm = _lib.default_algorithm()
    _lib.algorithm_code(algorithm)  # ValueError naming the choices
    for name, value in (("tau", tau), ("tau_prime", tau_prime)):
        if not is_int(value) or not 1 <= value <= MAX_INT32:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not is_real(timeout) or not 0.0 < timeout <= MAX_INT32 / 1000:
        raise ValueError(f"timeout must be a positive number of seconds (at most {MAX_INT32 // 1000}), got {timeout!r}")
    value_dtype = value_dtype_name(value_dtype)
    if value_dtype != "float32" and algorithm not in (takers := _lib.reduced_value_algorithms()):
        raise ValueError(
            f"value_dtype {value_dtype} needs algorithm {', '.join(takers[:-1])} or {takers[-1]}; {algorithm!r} keeps no residual or "
            f"sends partial sums, whose rounding errors no rank's residual could take back"
        )
    if not isinstance(stochastic_rounding, bool) or stochastic_rounding and value_dtype == "float32":
        raise ValueError(f"stochastic_rounding must be a bool, and True only with float16 or bfloat16 values, got {stochastic_rounding!r}")
    density_schedule = check_schedule(density_schedule, float(density))
    if measure_xi_every is not None and (not is_int(measure_xi_every) or measure_xi_every < 1):
        raise ValueError(f"measure_xi_every must be None or a positive integer, got {measure_xi_every!r}")
    adaptive = check_adaptive(adaptive, int(tau_prime))
    if adaptive is not None and density_schedule is not None:
        raise ValueError("adaptive and density_schedule both set the density of each step: pass one of them")
    if adaptive is not None and measure_xi_every is None:
        measure_xi_every = DEFAULT_EVERY
    return Settings(float(density), algorithm, int(tau), int(tau_prime), float(timeout), value_dtype, stochastic_rounding, density_schedule,
                    measure_xi_every, adaptive)


DEFAULT_WARMUP_ITERS = 2


def check_warmup_iters(warmup_iters):
    """The DDP hook's dense warm-up length, checked; ValueError saying why
    it must be at least 2."""
    if not is_int(warmup_iters) or warmup_iters < 2:
        raise ValueError(
            f"warmup_iters must be an integer >= 2 (DDP rebuilds its buckets after the first iteration, and the "
            f"hook learns the rebuilt layout in the second), got {warmup_iters!r}"
        )
    return int(warmup_iters)
