"""The adaptive controller's rules (oktopk.adaptive), without ranks: what
every rank computes from the same ξ and agreed drift."""

import math

import pytest

from oktopk.adaptive import DRIFT_HIGH, DRIFT_LOW, AdaptiveControl, check_adaptive


def test_bounds_are_checked_and_defaulted():
    assert check_adaptive(None, 32) is None
    assert check_adaptive((0.001, 0.1), 32) == (0.001, 0.1, 1.0, 4)
    assert check_adaptive([0.001, 0.1, 0.5, 2], 32) == (0.001, 0.1, 0.5, 2)
    assert check_adaptive((0.5, 0.5), 3) == (0.5, 0.5, 1.0, 1)
    for bad, what in [((0.1,), "adaptive must be"), ((0.2, 0.1), "densities"), ((0, 0.1), "densities"),
                      ((0.1, 1.5), "densities"), ((0.01, 0.1, 0), "max_xi"), ((0.01, 0.1, math.nan), "max_xi"),
                      ((0.01, 0.1, 1.0, 64), "min_tau_prime"), ((0.01, 0.1, 1.0, 0), "min_tau_prime"),
                      ((0.01, 0.1, 1.0, 2.5), "min_tau_prime"), ("0.01,0.1", "adaptive must be")]:
        with pytest.raises(ValueError, match=what):
            check_adaptive(bad, 32)


def test_density_doubles_above_max_xi_halves_well_below_and_stays_in_its_bounds():
    # Powers of two, so that doubling and halving stay exact on the 2**-30 grid.
    lo, hi = 2.0**-7, 2.0**-4
    c = AdaptiveControl((lo, hi, 0.5, 4), density=2 * lo, tau_prime=32)
    seen = []
    for xi in [0.6, 0.6, 0.6, 0.6, 0.3, 0.124, 0.01, 0.01, 0.01, 0.01, None, math.nan]:
        c.adapt(xi, 0.0)
        seen.append(c.density)
    # 0.3 and 0.125 are inside [max_xi/4, max_xi]: unchanged; None and NaN
    # (nothing sparse measured) change nothing either.
    assert seen == [4 * lo, hi, hi, hi, hi, hi / 2, hi / 4, lo, lo, lo, lo, lo]
    # A start outside the bounds is clipped into them, on the 2**-30 grid
    # and never outside the user's bounds.
    assert AdaptiveControl((0.01, 0.08, 0.5, 4), density=0.5, tau_prime=32).density == math.floor(0.08 * 2**30) / 2**30
    assert AdaptiveControl((0.1, 0.2, 0.5, 4), density=0.01, tau_prime=32).density == math.ceil(0.1 * 2**30) / 2**30


def test_tau_prime_halves_when_counts_drift_doubles_when_they_hold():
    c = AdaptiveControl((0.01, 0.01, 1.0, 4), density=0.01, tau_prime=32)
    assert c.tau_prime == 32
    seen = []
    for drift in [DRIFT_HIGH * 1.01, DRIFT_HIGH * 1.01, DRIFT_HIGH * 1.01, DRIFT_HIGH * 1.01, (DRIFT_LOW + DRIFT_HIGH) / 2,
                  DRIFT_LOW * 0.99, DRIFT_LOW * 0.99, DRIFT_LOW * 0.99, DRIFT_LOW * 0.99]:
        c.adapt(0.5, drift)
        seen.append(c.tau_prime)
    assert seen == [16, 8, 4, 4, 4, 8, 16, 32, 32]


def test_drift_is_the_largest_since_the_last_adaptation_and_survives_a_checkpoint():
    c = AdaptiveControl((2.0**-7, 2.0**-4, 1.0, 4), density=2.0**-7, tau_prime=32)
    c.record(100, 100)  # an exact selection: no drift
    assert c.drift == 0.0
    c.record(100, 160)
    c.record(100, 80)
    assert c.drift == pytest.approx(math.log(161 / 101))
    saved = c.state_dict()
    twin = AdaptiveControl((2.0**-7, 2.0**-4, 1.0, 4), density=2.0**-7, tau_prime=32)
    twin.load_state_dict(saved)
    assert twin.state_dict() == saved
    c.adapt(2.0, c.drift)  # what the ranks' mean would be with one rank
    assert c.drift == 0.0 and c.density == 2.0**-6 and c.tau_prime == 16 and c.last_inputs == (2.0, math.log(161 / 101))
