"""Density schedule: start sparse training at a higher density and decay it
to the target, as DGC does (25% -> 6.25% -> 1.5625% -> 0.4% over its first
epochs), shared by the DDP hook and the Horovod optimizer.

``density_schedule=(start_density, decay_steps)`` or ``(start_density,
decay_steps, stage_steps)``: at sparse step ``s`` (0 at the first sparse
step) the density is

    start * (target / start) ** (t / decay_steps),  t = s - s % stage_steps,

rounded to a multiple of 2**-30 and never below the target; from step
``decay_steps`` on it is the target. ``stage_steps`` 1 (the default) decays
every step; the steps of an epoch as ``stage_steps`` hold it for an epoch
(DGC: decay_steps = 3 epochs' steps, stage_steps = one epoch's, start 0.25,
target 0.004).

Every rank must select the same k at each call (a rank that disagrees fails
the call with a mismatch): the density depends only on the step count, and
the rounding to 2**-30 absorbs the last-bit differences one platform's
``**`` may have from another's.
"""

import math
import numbers

_GRID = 2.0**30


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_schedule(schedule, density):
    """The schedule as a tuple (start_density, decay_steps, stage_steps), or
    None; ValueError naming the problem for anything else."""
    if schedule is None:
        return None
    if not isinstance(schedule, (tuple, list)) or len(schedule) not in (2, 3):
        raise ValueError(f"density_schedule must be None, (start_density, decay_steps) or (start_density, decay_steps, stage_steps), got {schedule!r}")
    start, decay_steps = schedule[0], schedule[1]
    stage_steps = schedule[2] if len(schedule) == 3 else 1
    if not isinstance(start, numbers.Real) or isinstance(start, bool) or not density <= start <= 1.0:
        raise ValueError(f"density_schedule's start_density must be a real number in [density, 1] = [{density}, 1], got {start!r}")
    for name, value in (("decay_steps", decay_steps), ("stage_steps", stage_steps)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"density_schedule's {name} must be a positive integer, got {value!r}")
    return (float(start), int(decay_steps), int(stage_steps))


def density_at(schedule, density, step):
    """The density of sparse step ``step`` (0-based) under ``schedule`` (as
    check_schedule returns it) with target ``density``."""
    if schedule is None or step >= schedule[1]:
        return density
    start, decay_steps, stage_steps = schedule
    t = step - step % stage_steps
    d = start * (density / start) ** (t / decay_steps)
    return max(density, min(1.0, math.floor(d * _GRID + 0.5) / _GRID))
