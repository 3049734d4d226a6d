"""How one measurement is taken: warm-up, repeats until the figure is stable, the median.

On CUDA a sample is bracketed by ``torch.cuda.Event(enable_timing=True)`` records and read
after ``torch.cuda.synchronize()`` (kernel time, not launch time); on CPU by
``time.perf_counter``.  A sample runs the function ``inner`` times, with ``inner`` chosen from
the warm-up so that one sample lasts at least ``min_sample_s`` (a 5 us op timed one call at a
time would measure the timer).  Samples are taken until their total reaches ``target_total_s``
and there are at least ``min_samples`` of them, or ``max_samples`` were taken; the figure is
the median sample divided by ``inner`` -- the median, not the mean, because a shared machine
adds one-sided outliers (a preempted sample is slower, never faster).

``clock="thread"`` times a CPU sample by the calling thread's CPU time
(``time.thread_time``, Linux ``CLOCK_THREAD_CPUTIME_ID``) instead of the host clock: the time
the op's thread ran, without the time it waited for a core while other processes of the machine
ran.  This is what an op costs on an idle machine, which is what a profile describes (the
simulator adds the waits of a plan's own processes itself: compute slots, meeting waits).  On this
2-core machine under a load average of 10, a 512x256x1024 fp32 linear took 14.4 ms by the host
clock (median of 60 samples) and 2.33 ms of thread time; the profile's row, timed by the host
clock with other jobs on both cores, read 3.66 ms.  Only valid for a single-threaded op (one
intra-op thread), since torch's other threads do not count; the host's own tenants outside this
VM are not seen by it either (no steal time is reported here).

Every timed stretch of ``autopar profile`` is read here: ``wall_seconds`` (the host clock),
``agreed_seconds`` (the slowest rank's host time, for calls that communicate),
``repeat_samples`` (the stop rule above, over any sampler) and ``lockstep_median`` (fixed
counts on every rank).  The CPU-only in-step timings (profiling/cpu_in_step.py) build on them.
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


#: the clocks ``time_call`` reads (module docstring)
CLOCKS = ("wall", "thread")


def thread_clock_valid(device: torch.device) -> bool:
    """True where ``clock="thread"`` measures an op whole: a CPU device with one intra-op thread."""
    return device.type == "cpu" and torch.get_num_threads() == 1


def time_call(fn: Callable[[], object], device: torch.device, policy: RepeatPolicy, clock: str = "wall") -> Timing:
    """Seconds one call of ``fn`` takes on ``device`` (median over samples), by the host clock or
    (``clock="thread"``, CPU only) by the thread's CPU time; the stop rule counts host seconds."""
    if clock not in CLOCKS:
        raise ValueError(f"clock {clock!r} is not one of {CLOCKS}")
    if clock == "thread" and not thread_clock_valid(device):
        raise ValueError("the thread clock times only a CPU op on one intra-op thread (torch.set_num_threads(1))")
    for _ in range(policy.warmup):
        fn()
    _sync(device)

    def sample(inner: int) -> tuple[float, float]:
        if clock == "thread":
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(inner):
                fn()
            return time.thread_time() - c0, time.perf_counter() - t0
        s = _sample(fn, device, inner)
        return s, s
    samples, inner = repeat_samples(sample, policy)
    med = statistics.median(samples)
    if len(samples) >= 4:
        q = statistics.quantiles(samples, n=4)
        spread = (q[2] - q[0]) / med if med > 0 else 0.0
    else:
        spread = (max(samples) - min(samples)) / med if med > 0 else 0.0
    return Timing(median_s=med, num_samples=len(samples), calls_per_sample=inner, spread=spread)


def repeat_samples(sample: Callable[[int], tuple[float, float]], policy: RepeatPolicy) -> tuple[list[float], int]:
    """(seconds per call of each sample, calls per sample): the stop rule of ``RepeatPolicy``.

    ``sample(inner)`` times ``inner`` calls and returns (their seconds, the wall seconds the
    sample took -- more than the first when it also timed something taken out).  One untimed
    sample of one call sets ``inner`` so a sample lasts at least ``min_sample_s``; the stop
    rule counts wall seconds.  When every rank's ``sample`` returns the same agreed figures,
    every rank takes the same number of samples (calls that communicate stay in step)."""
    _, first_wall = sample(1)
    inner = 1 if first_wall >= policy.min_sample_s else int(policy.min_sample_s / max(first_wall, 1e-9)) + 1
    samples: list[float] = []
    wall = 0.0
    while len(samples) < policy.max_samples:
        s, s_wall = sample(inner)
        samples.append(s / inner)
        wall += s_wall
        if len(samples) >= policy.min_samples and wall >= policy.target_total_s:
            break
    return samples, inner


def wall_seconds(fn: Callable[[], object], inner: int = 1) -> float:
    """Host seconds of ``inner`` calls of ``fn`` (``time.perf_counter``)."""
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return time.perf_counter() - t0


def agreed_seconds(fn: Callable[[], object], device: torch.device, inner: int, group, agree=None,
                   barrier: bool = True) -> float:
    """Host seconds of ``inner`` calls of ``fn`` after a barrier, the device synchronized on both
    sides, reduced over ``group`` with ``agree`` (MAX, the slowest rank's, by default: a
    collective ends when its last rank does).  Every rank of ``group`` must call it."""
    import torch.distributed as dist

    if barrier:
        dist.barrier(group=group)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    _sync(device)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX if agree is None else agree, group=group)
    return float(elapsed.item())


def lockstep_median(fn: Callable[[], object], device: torch.device, group, warmup: int = 3, samples: int = 9,
                    inner: int = 20) -> float:
    """Seconds per call: the median of ``samples`` agreed samples of ``inner`` calls, the same
    counts on every rank (closures that communicate must be called in step)."""
    for _ in range(warmup):
        fn()
    return statistics.median([agreed_seconds(fn, device, inner, group) / inner for _ in range(samples)])


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
    return wall_seconds(fn, inner)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_of_runs(measure: Callable[[], dict[str, float]], runs: int) -> dict[str, float]:
    """Per key, the median over ``runs`` whole calls of ``measure`` (a figure that is itself a
    difference of timings can swing by several times between calls on a shared machine)."""
    results = [measure() for _ in range(max(1, runs))]
    return {k: float(statistics.median(r[k] for r in results)) for k in results[0]}
