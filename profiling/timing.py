"""How one measurement is taken: warm-up, repeats until the figure is stable, the median.

On CUDA a sample is bracketed by ``torch.cuda.Event(enable_timing=True)`` records and read
after ``torch.cuda.synchronize()`` (kernel time, not launch time); on CPU by
``time.perf_counter``.  A sample runs the function ``inner`` times, with ``inner`` chosen from
the warm-up so that one sample lasts at least ``min_sample_s`` (a 5 us op timed one call at a
time would measure the timer).  Samples are taken until their total reaches ``target_total_s``
and there are at least ``min_samples`` of them, or ``max_samples`` were taken; the figure is
the median sample divided by ``inner`` -- the median, not the mean, because a shared machine
adds one-sided outliers (a preempted sample is slower, never faster).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class RepeatPolicy:
    warmup: int = 2                 # calls before timing (allocator, caches, lazy init)
    min_samples: int = 5
    max_samples: int = 100
    target_total_s: float = 0.05    # keep sampling until this much time was measured
    min_sample_s: float = 2e-4      # one sample lasts at least this long (calls batched)

    @classmethod
    def quick(cls) -> "RepeatPolicy":
        return cls(warmup=1, min_samples=3, max_samples=20, target_total_s=0.01, min_sample_s=1e-4)


@dataclass(frozen=True)
class Timing:
    median_s: float                 # seconds per call
    num_samples: int
    calls_per_sample: int
    spread: float                   # (p75 - p25) / median of the samples: the noise of the figure


def time_call(fn: Callable[[], object], device: torch.device, policy: RepeatPolicy) -> Timing:
    """Seconds one call of ``fn`` takes on ``device`` (median over samples)."""
    for _ in range(policy.warmup):
        fn()
    _sync(device)
    first_s = _sample(fn, device, 1)
    inner = 1
    if first_s < policy.min_sample_s:
        inner = max(1, int(policy.min_sample_s / max(first_s, 1e-9)) + 1)
    samples: list[float] = []
    total_s = 0.0
    while len(samples) < policy.max_samples:
        s = _sample(fn, device, inner)
        samples.append(s / inner)
        total_s += s
        if len(samples) >= policy.min_samples and total_s >= policy.target_total_s:
            break
    med = statistics.median(samples)
    if len(samples) >= 4:
        q = statistics.quantiles(samples, n=4)
        spread = (q[2] - q[0]) / med if med > 0 else 0.0
    else:
        spread = (max(samples) - min(samples)) / med if med > 0 else 0.0
    return Timing(median_s=med, num_samples=len(samples), calls_per_sample=inner, spread=spread)


def _sample(fn: Callable[[], object], device: torch.device, inner: int) -> float:
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3   # elapsed_time is in milliseconds
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return time.perf_counter() - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_of_runs(measure: Callable[[], dict[str, float]], runs: int) -> dict[str, float]:
    """Per key, the median over ``runs`` whole calls of ``measure`` (a figure that is itself a
    difference of timings can swing by several times between calls on a shared machine)."""
    results = [measure() for _ in range(max(1, runs))]
    return {k: float(statistics.median(r[k] for r in results)) for k in results[0]}
