"""The waits of CPU ranks that meet: a profile's ``sync_wait`` rows as a lookup (CPU gloo only).

When processes share a node's cores, a rank that reaches a blocking collective straight out of
a stretch of its own work waits for the others to be scheduled; the wait grows with the
stretch, less than in proportion (profiling/cpu_sync_wait.py measures it, docs/profiles.md
holds the rows).  A GPU profile has no such rows, so ``MeetingWaits`` is empty there and
``measured`` is false for every process count.  The cost model holds one (``CostModel.
meeting_waits``); simulator/cpu_node.py prices each plan's meetings from it.
"""
from __future__ import annotations

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
        linearly; beyond the longest burst the wait keeps that burst's share of the work.  A row
        with only a fitted line waits ``per_compute * gap_s``; one process, or a count the
        profile did not measure, waits nothing.
        """
        if processes <= 1 or gap_s <= 0:
            return 0.0
        curve = self.curves.get(int(processes))
        if curve is None:
            return float(self.per_compute.get(int(processes), 0.0)) * gap_s
        gaps, waits = curve
        if gap_s >= gaps[-1]:
            return float(waits[-1] * gap_s / gaps[-1])
        return float(np.interp(gap_s, gaps, waits))
