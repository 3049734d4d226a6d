"""The meeting wait of CPU ranks past the longest measured burst (simulator/cpu_meeting_waits.py):
the closed form, and the continuation checked against Monte Carlo ranks interrupted in the two
ways its docstring names (independent random interruptions: square root; one rank held for a
share of the stretch: proportional)."""
import math

import numpy as np
import pytest

from autopar.simulator.device.cpu_meeting_waits import tail_exponent, wait_after

GAPS = np.array([1e-3, 1e-2, 1e-1])


def test_inside_the_points_linear_past_them_the_last_segments_power_law():
    waits = np.array([0.0, 2e-3, 6e-3])                     # last segment: x10 work, x3 wait
    k = math.log(3) / math.log(10)
    assert tail_exponent(GAPS, waits) == pytest.approx(k)
    assert wait_after(GAPS, waits, 0.0) == 0.0
    assert wait_after(GAPS, waits, 5.5e-3) == pytest.approx(1e-3)          # halfway from 0 to 2 ms
    assert wait_after(GAPS, waits, 1e-1) == pytest.approx(6e-3)            # the last point itself
    assert wait_after(GAPS, waits, 1.0) == pytest.approx(18e-3)            # x10 work again: x3
    assert wait_after(GAPS, waits, 4e-1) == pytest.approx(6e-3 * 4 ** k)


def test_tail_exponent_stays_between_flat_and_proportional():
    assert tail_exponent(GAPS, np.array([0.0, 1e-3, 5e-2])) == 1.0          # steeper: proportional
    assert wait_after(GAPS, np.array([0.0, 1e-3, 5e-2]), 0.3) == pytest.approx(0.15)
    assert tail_exponent(GAPS, np.array([0.0, 2e-3, 2e-3])) == 0.0          # flat: stays flat
    assert wait_after(GAPS, np.array([0.0, 2e-3, 2e-3]), 0.5) == pytest.approx(2e-3)
    assert tail_exponent(GAPS, np.array([0.0, 0.0, 1e-3])) == 1.0           # from zero: proportional
    assert tail_exponent(GAPS[-1:], np.array([1e-3])) == 1.0                # one point


def _random_interruptions(gap_s: float, ranks: int, rng: np.random.Generator, trials: int = 4000) -> float:
    """Mean wait of a rank at a meeting after ``gap_s`` of work when the host interrupts every
    rank at random (Poisson, 200 per second, 0.2-1 ms each, uniform): the latest rank's
    interruptions less its own, over ``trials`` meetings."""
    rate, lo, hi = 200.0, 2e-4, 1e-3
    counts = rng.poisson(rate * gap_s, size=(trials, ranks))
    late = np.zeros((trials, ranks))
    for n in np.unique(counts):
        mask = counts == n
        late[mask] = rng.uniform(lo, hi, size=(int(mask.sum()), int(n))).sum(axis=1) if n else 0.0
    return float((late.max(axis=1, keepdims=True) - late).mean())


def _one_rank_held(gap_s: float, ranks: int, rng: np.random.Generator, trials: int = 4000) -> float:
    """Mean wait when at each meeting one rank, chosen at random, lost a random 0-20% share of the
    stretch to other work (the others none)."""
    share = rng.uniform(0.0, 0.2, size=trials) * gap_s
    return float(share.mean() * (ranks - 1) / ranks)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("mechanism,k", [(_random_interruptions, 0.5), (_one_rank_held, 1.0)])
def test_continuation_matches_interrupted_ranks(ranks, mechanism, k):
    """Two simulated points inside the table (g0 / 4 and g0) give the law; the waits simulated at
    4 g0 and 9 g0 are what wait_after continues to, within 8%."""
    rng = np.random.default_rng(0)
    g0 = 0.1                                   # ~20 interruptions per rank: many
    gaps = np.array([1e-4, g0 / 4, g0])
    waits = np.array([0.0, mechanism(g0 / 4, ranks, rng), mechanism(g0, ranks, rng)])
    assert tail_exponent(gaps, waits) == pytest.approx(k, abs=0.08)
    for mult in (4.0, 9.0):
        simulated = mechanism(g0 * mult, ranks, rng)
        assert wait_after(gaps, waits, g0 * mult) == pytest.approx(simulated, rel=0.08)
