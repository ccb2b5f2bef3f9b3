"""Adaptive density and τ′: each step's k and threshold refresh period set
from what the library observes, within bounds the user sets; shared by the
DDP hook and the Horovod optimizer.

``adaptive=(min_density, max_density)``, or with more of
``(min_density, max_density, max_xi, min_tau_prime)``. Training starts at
``density`` (clipped into the bounds) and ``tau_prime``; every
``measure_xi_every`` sparse steps (50 by default with ``adaptive``) a step
measures ξ, and its end agrees on the count drift. After it:

- **Density from ξ** (Assumption 1 of the Ok-Topk paper:
  ‖Topk(Σ acc) − result‖ / ‖Σ grad‖, how far the sparse result is from the
  exact top-k of the summed accumulators). ξ above ``max_xi``: the density
  doubles, up to ``max_density``. ξ below ``max_xi / 4``: it halves, down
  to ``min_density``. In between it stays (the gap keeps it from
  oscillating).
- **τ′ from count drift.** Between its exact selections Ok-Topk reuses a
  local threshold; each rank records the largest ``|ln((selected + 1) /
  (k + 1))|`` of its reuse calls since the last adaptation, and the ranks
  average it (one allreduce of one number). Above ln 1.5 (counts off by more
  than half): τ′ halves, down to ``min_tau_prime`` (``tau_prime // 8`` by
  default), so the threshold is refreshed sooner. Below ln 1.1: τ′ doubles,
  up to ``tau_prime``.

Every input is the same on every rank (ξ is computed from an allreduced sum,
the drift is allreduced), and so is every decision: every rank selects the
same k with the same τ′ at every call. The density is kept on the 2**-30
grid of ``oktopk.schedule``. A measured step costs a dense allreduce of
twice the gradients more (see ``measure_xi_every``), which sets the default
interval: at 50 it adds about 4% of a dense step to each step.
"""

import math
import numbers

_GRID = 2.0**30
DEFAULT_EVERY = 50
DRIFT_HIGH = math.log(1.5)
DRIFT_LOW = math.log(1.1)
DEFAULT_MAX_XI = 1.0


def _is_real(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _grid(d):
    return math.floor(d * _GRID + 0.5) / _GRID


def check_adaptive(adaptive, tau_prime):
    """The bounds as a tuple (min_density, max_density, max_xi,
    min_tau_prime), or None; ValueError naming the problem for anything
    else."""
    if adaptive is None:
        return None
    if not isinstance(adaptive, (tuple, list)) or not 2 <= len(adaptive) <= 4:
        raise ValueError(
            f"adaptive must be None or (min_density, max_density[, max_xi[, min_tau_prime]]), got {adaptive!r}"
        )
    lo, hi = adaptive[0], adaptive[1]
    max_xi = adaptive[2] if len(adaptive) > 2 else DEFAULT_MAX_XI
    min_tau_prime = adaptive[3] if len(adaptive) > 3 else max(1, tau_prime // 8)
    if not (_is_real(lo) and _is_real(hi) and 0.0 < lo <= hi <= 1.0):
        raise ValueError(f"adaptive's densities must satisfy 0 < min_density <= max_density <= 1, got {lo!r} and {hi!r}")
    if not _is_real(max_xi) or not 0.0 < max_xi < math.inf:
        raise ValueError(f"adaptive's max_xi must be a positive number, got {max_xi!r}")
    if not _is_int(min_tau_prime) or not 1 <= min_tau_prime <= tau_prime:
        raise ValueError(f"adaptive's min_tau_prime must be an integer in [1, tau_prime] = [1, {tau_prime}], got {min_tau_prime!r}")
    return (float(lo), float(hi), float(max_xi), int(min_tau_prime))


class AdaptiveControl:
    """The current density and τ′ under ``bounds`` (check_adaptive's
    tuple), starting from ``density`` and ``tau_prime`` (the upper bound of
    τ′), and the largest count drift this rank has seen since the last
    adaptation."""

    def __init__(self, bounds, density, tau_prime):
        self.bounds = bounds
        self.max_tau_prime = int(tau_prime)
        # The density bounds on the grid, inside the user's.
        self._lo = math.ceil(bounds[0] * _GRID) / _GRID
        self._hi = max(self._lo, math.floor(bounds[1] * _GRID) / _GRID)
        self.density = min(max(_grid(density), self._lo), self._hi)
        self.tau_prime = self.max_tau_prime
        self.drift = 0.0
        self.adaptations = 0
        self.last_inputs = None  # (ξ, mean drift) of the latest adaptation

    def record(self, k, selected):
        """One Ok-Topk call's k and this rank's selected count (an exact
        selection takes exactly k, so its drift is 0)."""
        if k > 0:
            self.drift = max(self.drift, abs(math.log((selected + 1) / (k + 1))))

    def adapt(self, xi, mean_drift):
        """Apply one measurement: ξ of the measured step (None when nothing
        sparse measured it) and the drift averaged over the ranks."""
        _, _, max_xi, min_tau_prime = self.bounds
        if xi is not None and not math.isnan(xi):
            if xi > max_xi:
                self.density = min(self._hi, _grid(2.0 * self.density))
            elif xi < max_xi / 4:
                self.density = max(self._lo, _grid(self.density / 2.0))
        if mean_drift > DRIFT_HIGH:
            self.tau_prime = max(min_tau_prime, self.tau_prime // 2)
        elif mean_drift < DRIFT_LOW:
            self.tau_prime = min(self.max_tau_prime, 2 * self.tau_prime)
        self.drift = 0.0
        self.adaptations += 1
        self.last_inputs = (xi, mean_drift)

    def state_dict(self):
        return {"bounds": self.bounds, "density": self.density, "tau_prime": self.tau_prime,
                "drift": self.drift, "adaptations": self.adaptations, "last_inputs": self.last_inputs}

    def load_state_dict(self, state):
        """Continue from a state_dict() (this rank's: the drift is its own)."""
        self.density = float(state["density"])
        self.tau_prime = int(state["tau_prime"])
        self.drift = float(state["drift"])
        self.adaptations = int(state["adaptations"])
        self.last_inputs = None if state["last_inputs"] is None else tuple(state["last_inputs"])
