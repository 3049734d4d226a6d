"""Non-decreasing fit of a measured sweep: isotonic regression in log time, then a running max.

A sweep sorted by size should take non-decreasing time.  A plain running maximum of the
medians lets one slow outlier at a small size raise every larger size to it; the
pool-adjacent-violators algorithm (Ayer et al. 1955; Barlow et al. 1972, ch. 1) instead
finds the non-decreasing sequence closest to the measurements in least squares, replacing a
violating run by its mean.  It runs on log(seconds), so a 10% deviation weighs the same at
1 us and at 1 s.  The final running max only removes floating-point wobble.
"""
from __future__ import annotations

import numpy as np


def isotonic_non_decreasing(values: "np.ndarray | list[float]") -> np.ndarray:
    """The non-decreasing least-squares fit of ``values`` (pool adjacent violators)."""
    y = np.asarray(values, dtype=float)
    means: list[float] = []
    counts: list[int] = []
    for v in y:
        means.append(float(v))
        counts.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            m2, c2 = means.pop(), counts.pop()
            m1, c1 = means.pop(), counts.pop()
            means.append((m1 * c1 + m2 * c2) / (c1 + c2))
            counts.append(c1 + c2)
    return np.repeat(means, counts)


def monotone_seconds(seconds: "np.ndarray | list[float]") -> np.ndarray:
    """Positive times sorted by size -> non-decreasing times (isotonic fit in log space)."""
    s = np.asarray(seconds, dtype=float)
    if s.size == 0:
        return s
    fit = np.exp(isotonic_non_decreasing(np.log(np.maximum(s, 1e-12))))
    return np.maximum.accumulate(fit)
