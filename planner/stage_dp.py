"""Pipeline stages by dynamic programming over layer ranges (Alpa, Zheng et al. 2022, Sec. 5.2).

With ``m`` micro-batches and stages of latency t_1 .. t_S, a synchronous pipeline step takes
(Alpa eq. 2; TeraPipe, Li et al. 2021, eq. 1)::

    T = sum_i t_i + (m - 1) * max_i t_i

Alpa's eq. 3 minimises T by enumerating the bound ``t_max`` on the slowest stage: for each
candidate (every distinct feasible stage latency, ascending), a DP finds the least sum of
stage latencies over partitions whose stages all stay within ``t_max``::

    F(s, j) = min_{i < j, c(s, i, j) <= t_max}  F(s - 1, i) + c(s, i, j),    F(0, 0) = 0

and T(t_max) = F(S, L) + (m - 1) * t_max; the optimum is the least T over all t_max.  The
enumeration stops early once (the least unconstrained stage sum) + (m - 1) * t_max reaches
the best T found, since no larger bound can do better (Alpa's early pruning, Sec. 5.2); and
it starts at the least bound that admits any partition, found by bisection since feasibility
is monotone in the bound.

Stages may be unequal.  ``cost[s, i, j]`` is the latency of layers i..j-1 as the s-th stage
(so costs may depend on the position, e.g. the in-flight micro-batches of 1F1B change a stage's
memory and so its best choice); ``inf`` marks a range that does not fit on a stage's devices.
A 2-D ``cost[i, j]`` applies to every position.  Pure numpy, no I/O.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autopar.core.errors import InfeasibleError


@dataclass(frozen=True)
class StagePartition:
    bounds: tuple[int, ...]        # [0, b_1, ..., L]: stage s holds layers bounds[s]..bounds[s+1]-1
    stage_latency_s: tuple[float, ...]
    step_latency_s: float          # sum_i t_i + (m - 1) * max_i t_i  (eq. 2)
    num_bounds_tried: int

    @property
    def max_stage_s(self) -> float:
        return max(self.stage_latency_s)


def pipeline_latency(stage_latency_s, num_microbatches: int) -> float:
    """Eq. 2: sum of stage latencies + (m - 1) * the slowest stage."""
    t = np.asarray(stage_latency_s, dtype=float)
    return float(t.sum() + (num_microbatches - 1) * t.max())


def partition_stages(cost: np.ndarray, num_stages: int, num_microbatches: int,
                     upper_bound: float = math.inf) -> StagePartition | None:
    """The partition of layers 0..L-1 into ``num_stages`` contiguous stages minimising eq. 2.

    ``cost`` has shape (L, L + 1) or (num_stages, L, L + 1); entries with j <= i are ignored.
    Raises InfeasibleError when no partition has a finite cost.  ``upper_bound``: a caller that
    only wants partitions faster than it (a branch and bound's incumbent) gets None when there
    is none; the search starts its pruning from it.
    """
    cost = np.asarray(cost, dtype=float)
    if cost.ndim == 2:
        cost = np.broadcast_to(cost, (num_stages,) + cost.shape)
    S, L, L1 = cost.shape
    if S != num_stages or L1 != L + 1:
        raise ValueError(f"cost must have shape ({num_stages}, L, L+1); got {cost.shape}")
    if not 1 <= num_stages <= L:
        raise InfeasibleError(f"{num_stages} stages cannot split {L} layers (each stage needs a layer)")
    if num_microbatches < 1:
        raise ValueError("num_microbatches must be >= 1")
    # only ranges i < j are stages
    valid = np.triu(np.ones((L, L + 1), dtype=bool), k=1)
    c = np.where(valid[None], cost, np.inf)                          # (S, L, L+1)
    band = _band(c)

    # least stage sum with no bound: the lower bound used for pruning
    unbounded = _min_sum(band, np.inf)
    if not np.isfinite(unbounded[0]):
        raise InfeasibleError(f"no split of {L} layers into {num_stages} stages fits (every partition "
                              f"has a stage that does not fit)")
    # every partition's stages sum to at least the unbounded least sum, and its slowest stage
    # takes at least their mean
    if unbounded[0] + (num_microbatches - 1) * unbounded[0] / num_stages >= upper_bound:
        return None
    candidates = np.unique(c[np.isfinite(c)])
    sums: dict[float, float] = {}            # F(S, L) by bound: the enumeration's first bound was bisected

    def least_sum(t_max: float) -> float:
        if t_max not in sums:
            sums[t_max] = _min_sum(band, t_max)[0]
        return sums[t_max]

    # bounds below the least achievable bottleneck admit no partition: find it by bisection
    # (feasibility is monotone in t_max), then enumerate upwards from it
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if np.isfinite(least_sum(candidates[mid])):
            hi = mid
        else:
            lo = mid + 1
    best_T, best_bound, tried = upper_bound, None, 0
    for t_max in candidates[lo:]:                                  # ascending
        if unbounded[0] + (num_microbatches - 1) * t_max >= best_T:
            break
        tried += 1
        total = least_sum(t_max)
        if not np.isfinite(total):
            continue
        T = total + (num_microbatches - 1) * t_max
        if T < best_T:
            best_T, best_bound = T, t_max
    if best_bound is None:
        assert math.isfinite(upper_bound)      # with no bound the least feasible t_max gives a partition
        return None
    _, bounds = _min_sum(band, best_bound, want_bounds=True)
    lat = tuple(float(c[s, bounds[s], bounds[s + 1]]) for s in range(num_stages))
    return StagePartition(bounds=tuple(bounds), stage_latency_s=lat,
                          step_latency_s=pipeline_latency(lat, num_microbatches), num_bounds_tried=tried)


def _band(c: np.ndarray) -> np.ndarray:
    """The finite part of ``c`` (S, L, L+1) as a band: ``band[s, j, k] = c[s, j - w + k, j]`` for
    the w layers i = j - w .. j - 1 that may start a range ending at j, where w is the longest
    finite range (``inf`` where i < 0).  Ranges longer than w are all ``inf`` and never chosen,
    so the DP over the band takes the same minima, and since k grows with i, the same first
    (smallest) i among equal ones."""
    S, L, L1 = c.shape
    starts, ends = np.nonzero(np.isfinite(c).any(axis=0))
    w = int((ends - starts).max()) if len(starts) else 1
    i = np.arange(L1)[:, None] - w + np.arange(w)[None, :]           # (L+1, w): the range's first layer
    j = np.broadcast_to(np.arange(L1)[:, None], i.shape)
    return np.where(i >= 0, c[:, np.maximum(i, 0), j], np.inf)


def _min_sum(band: np.ndarray, t_max: float, want_bounds: bool = False):
    """F(S, L): least sum of stage latencies with every stage <= t_max (and the bounds), over
    the cost band (``_band``)."""
    S, L1, w = band.shape
    L = L1 - 1
    allowed = np.where(band <= t_max, band, np.inf)
    F = np.full(L + 1, np.inf)
    F[0] = 0.0
    choice = np.zeros((S, L + 1), dtype=np.int64)
    cols = np.arange(L + 1)
    window = cols[:, None] + np.arange(w)[None, :]                   # (L+1, w): j + k
    padded = np.full(w + L, np.inf)
    for s in range(S):
        # G[j] = min_i F[i] + allowed[s, i, j] over i = j - w + k: F[i] is padded[j + k]
        padded[w:] = F[:L]
        cand = padded[window]                                        # (L+1, w)
        cand += allowed[s]
        if want_bounds:
            k = cand.argmin(axis=1)
            choice[s] = cols - w + k
            G = cand[cols, k]
        else:                                                        # the same minima, no argmin
            G = cand.min(axis=1)
        G[0] = np.inf
        F = G
    if not want_bounds:
        return float(F[L]), None
    bounds = [L]
    for s in range(S - 1, -1, -1):
        bounds.append(int(choice[s, bounds[-1]]))
    bounds.reverse()
    return float(F[L]), bounds
