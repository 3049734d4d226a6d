"""The wait of CPU ranks at one meeting after a stretch of work, from a profile's measured points.

profiling/sync_wait.py measures, for a few burst lengths g, how much longer a round of
[g of compute; a small all-reduce] takes than the compute alone, with 2 or 4 gloo processes on
the machine's cores.  The wait comes from interruptions: the host (other tenants, the kernel,
the launcher, gloo's threads) takes each rank's core now and then, at random moments, and the
meeting waits for the rank that was held up most.  Inside the measured bursts the points are
read directly.  Past the longest one a rank's lateness is the sum of the many interruptions of
its stretch, whose spread grows as the square root of their number -- of the length of the
stretch -- (central limit theorem: the standard deviation of a sum of n independent delays is
sqrt(n) times theirs), and the expected latest of a fixed number of ranks is a fixed multiple
of that spread; so the wait grows as sqrt(g), not in proportion to g.
"""
from __future__ import annotations

import math

import numpy as np


def wait_after(gaps: np.ndarray, waits: np.ndarray, gap_s: float) -> float:
    """Seconds of waiting at one meeting after ``gap_s`` of work, on the measured curve ``gaps``,
    ``waits`` (cost_model._wait_curve: the extra times, non-decreasing, less the shortest
    burst's): linear between the measured points, ``waits[-1] * sqrt(gap_s / gaps[-1])`` past the
    longest burst (the square-root growth of the module docstring), 0 for no work."""
    if gap_s <= 0:
        return 0.0
    if gap_s >= gaps[-1]:
        return float(waits[-1] * math.sqrt(gap_s / gaps[-1]))
    return float(np.interp(gap_s, gaps, waits))
