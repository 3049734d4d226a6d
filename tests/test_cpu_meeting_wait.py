"""The meeting wait of CPU ranks past the longest measured burst (simulator/cpu_meeting_wait.py):
the closed form, and the mechanism it stands on checked by a Monte Carlo of interrupted ranks."""
import math

import numpy as np
import pytest

from autopar.simulator.cpu_meeting_wait import wait_after

GAPS = np.array([1e-3, 1e-2, 1e-1])
WAITS = np.array([0.0, 2e-3, 6e-3])


def test_inside_the_points_linear_past_them_square_root():
    assert wait_after(GAPS, WAITS, 0.0) == 0.0
    assert wait_after(GAPS, WAITS, 5.5e-3) == pytest.approx(1e-3)          # halfway from 0 to 2 ms
    assert wait_after(GAPS, WAITS, 1e-1) == pytest.approx(6e-3)            # the last point itself
    assert wait_after(GAPS, WAITS, 4e-1) == pytest.approx(6e-3 * 2)        # sqrt(4)
    assert wait_after(GAPS, WAITS, 9e-1) == pytest.approx(6e-3 * 3)        # sqrt(9)
    # never more than the last point's share of the work (what the proportional rule gave)
    for g in (0.2, 0.5, 3.0):
        assert wait_after(GAPS, WAITS, g) < 6e-3 * g / 1e-1


def _mean_wait(gap_s: float, ranks: int, rng: np.random.Generator, trials: int = 4000) -> float:
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


@pytest.mark.parametrize("ranks", [2, 4])
def test_square_root_growth_matches_randomly_interrupted_ranks(ranks):
    """Ranks interrupted at random moments: past many interruptions, quadrupling the work doubles
    the wait (the spread of a sum of independent delays, central limit theorem), as wait_after
    extrapolates; the proportional rule would quadruple it."""
    rng = np.random.default_rng(0)
    g0 = 0.1                                    # ~20 interruptions per rank: many
    w0 = _mean_wait(g0, ranks, rng)
    for k in (4.0, 9.0):
        simulated = _mean_wait(g0 * k, ranks, rng)
        extrapolated = wait_after(np.array([1e-3, g0]), np.array([0.0, w0]), g0 * k)
        assert extrapolated == pytest.approx(w0 * math.sqrt(k))
        assert simulated == pytest.approx(extrapolated, rel=0.08)
        assert abs(simulated - w0 * k) > 0.3 * w0 * k
