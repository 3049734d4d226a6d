"""The waits of CPU ranks that meet: a profile's ``sync_wait`` rows as a lookup (CPU gloo only).

When processes share a node's cores, a rank that reaches a blocking collective straight out of
a stretch of its own work waits for the others to be scheduled; the wait grows with the
stretch, less than in proportion (profiling/cpu_sync_wait.py measures it, docs/profiles.md
holds the rows).  A GPU profile has no such rows, so ``MeetingWaits`` is empty there and
``measured`` is false for every process count.  The cost model holds one (``CostModel.
meeting_waits``); simulator/cpu_node.py prices each plan's meetings from it.

profiling/cpu_sync_wait.py measures, for a few burst lengths g, how much longer a round of
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
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np


def wait_curve(gaps_s, extra_s) -> tuple[np.ndarray, np.ndarray]:
    """(burst lengths, wait per meeting): the extra time after each burst, non-decreasing in the
    burst length (running max), less the extra time after the shortest burst."""
    order = np.argsort(np.asarray(gaps_s, dtype=float))
    gaps = np.asarray(gaps_s, dtype=float)[order]
    extra = np.maximum.accumulate(np.asarray(extra_s, dtype=float)[order])
    return gaps, extra - extra[0]


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
    ``waits`` (``wait_curve``: the extra times, non-decreasing, less the shortest
    burst's): linear between the measured points, ``waits[-1] * (gap_s / gaps[-1]) ** k`` past
    the longest burst (``tail_exponent``), 0 for no work."""
    if gap_s <= 0:
        return 0.0
    if gap_s >= gaps[-1]:
        return float(waits[-1] * (gap_s / gaps[-1]) ** tail_exponent(gaps, waits))
    return float(np.interp(gap_s, gaps, waits))


@dataclass(frozen=True)
class MeetingWaits:
    #: processes busy on a node -> seconds of waiting per second of a rank's own work before
    #: each meeting of the ranks (a row's fitted ``per_compute``)
    per_compute: Mapping[int, float] = field(default_factory=dict)
    #: processes -> (burst lengths, wait per meeting) from the rows' measured points
    curves: Mapping[int, tuple] = field(default_factory=dict)

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any]] | None) -> "MeetingWaits":
        """From a profile's ``sync_wait`` rows (None or empty: no waits)."""
        rows = list(rows or [])
        return cls(per_compute={int(r["processes"]): float(r["per_compute"]) for r in rows},
                   curves={int(r["processes"]): wait_curve(r["gaps_s"], r["extra_s"])
                           for r in rows if len(r.get("gaps_s") or []) >= 2})

    def measured(self, processes: int) -> bool:
        """Whether the rows price meeting waits for ``processes`` busy ranks."""
        return int(processes) in self.curves or self.per_compute.get(int(processes), 0.0) > 0

    def wait(self, processes: int, gap_s: float) -> float:
        """Seconds a rank waits at one meeting of ranks (a blocking collective) after ``gap_s`` of
        its own work, when ``processes`` ranks compute on its node.

        From the measured points (burst length, extra time of the meeting), made non-decreasing
        (running max) and taken relative to the shortest burst -- the collective table's in-step
        rows already hold what a meeting costs straight after a little compute --, interpolated
        linearly; beyond the longest burst the wait follows the power law of the last two
        points, at most proportional (``wait_after``).  A row
        with only a fitted line waits ``per_compute * gap_s``; one process, or a count the
        profile did not measure, waits nothing.
        """
        if processes <= 1 or gap_s <= 0:
            return 0.0
        curve = self.curves.get(int(processes))
        if curve is None:
            return float(self.per_compute.get(int(processes), 0.0)) * gap_s
        return wait_after(*curve, gap_s)
