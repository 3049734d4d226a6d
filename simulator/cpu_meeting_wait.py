"""The wait of CPU ranks at one meeting after a stretch of work, from a profile's measured points.

profiling/sync_wait.py measures, for a few burst lengths g, how much longer a round of
[g of compute; a small all-reduce] takes than the compute alone, with 2 or 4 gloo processes on
the machine's cores.  The wait comes from interruptions: something takes a rank's core now and
then, and the meeting waits for the rank that was held up most.  Inside the measured bursts the
points are read directly.  Past the longest one (a data-parallel step of a larger model meets
once every few hundred milliseconds) the wait goes on growing as the profile's last two points
grow: the power law through them, ``w = w_last * (g / g_last) ** k``, with k between 0 and 1.

Why not one law for every process count: how the wait grows depends on what interrupts the
ranks.  Random interruptions that each rank collects independently make its lateness a sum whose
spread grows as the square root of the work (central limit theorem: the standard deviation of a
sum of n independent delays is sqrt(n) times theirs), k = 1/2; interruptions that hold one rank
for a share of the whole stretch grow in proportion, k = 1.  On this machine 4 processes on 2
cores (time-sliced among themselves) grew sublinearly past 100 ms and 2 processes (one per core,
held up by the host's other work) about in proportion: probes with bursts of up to 1.2 s
(benchmarks/results/cpu_meeting_wait_tail.txt) read log-log slopes of 0.60 and 0.86, and the
committed profile's last segments 0.35 and 0.96.  So the slope is the measured one, per process
count; a last segment that falls (noise; the curve is made non-decreasing, so it is flat) stops
the growth, one that starts at zero wait grows in proportion.
"""
from __future__ import annotations

import math

import numpy as np


def tail_exponent(gaps: np.ndarray, waits: np.ndarray) -> float:
    """k of the power law through the curve's last two points, clipped to [0, 1]; 1 when the
    curve has one point or the next-to-last wait is zero."""
    if len(gaps) < 2 or waits[-2] <= 0 or gaps[-1] <= gaps[-2]:
        return 1.0
    if waits[-1] <= waits[-2]:
        return 0.0
    k = math.log(waits[-1] / waits[-2]) / math.log(gaps[-1] / gaps[-2])
    return min(1.0, max(0.0, k))


def wait_after(gaps: np.ndarray, waits: np.ndarray, gap_s: float) -> float:
    """Seconds of waiting at one meeting after ``gap_s`` of work, on the measured curve ``gaps``,
    ``waits`` (cost_model._wait_curve: the extra times, non-decreasing, less the shortest
    burst's): linear between the measured points, ``waits[-1] * (gap_s / gaps[-1]) ** k`` past
    the longest burst (``tail_exponent``), 0 for no work."""
    if gap_s <= 0:
        return 0.0
    if gap_s >= gaps[-1]:
        return float(waits[-1] * (gap_s / gaps[-1]) ** tail_exponent(gaps, waits))
    return float(np.interp(gap_s, gaps, waits))
