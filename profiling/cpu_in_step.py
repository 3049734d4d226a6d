"""In-step timings: what a collective or a framework feature costs on CPU ranks in a training
step, where every core is busy computing when the ranks meet (CPU gloo ranks only).

A collective is timed *in step*: in a training step every rank reaches a
collective straight out of a burst of compute, with every core busy, and the threads that
move and reduce gloo's data must first be woken and scheduled.  A loop of back-to-back calls
never pays that (its ranks sit waiting in the collective); on this kind of machine it adds
0.5-3 ms to a 128 KiB all-reduce over 2 processes (measured: 2 gloo ranks, ~7 ms of matmuls
then the all-reduce, against the same matmuls alone).  So a sample is ``inner``
rounds of [``BURST_S`` of matmuls; the call] minus ``inner`` rounds of the matmuls alone,
taken one after the other, each the slowest rank's; the row's ``timing`` says
``"in_step"``, and its figure is the (trimmed) mean of the samples, not their median
(``in_step_mean``), and never less than the same call timed back to back (a difference of two
noisy times can otherwise come out below what the call physically takes).

The collective sweep (profiling/collectives.py) calls ``time_in_step`` and ``make_chain`` for a
CPU device; profiling/cpu_overheads_in_step.py and profiling/cpu_sync_wait.py time their probes
with ``InStepTimer``.  Every clock read goes through profiling/timing.py.
"""
from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.distributed as dist

from autopar.profiling.timing import RepeatPolicy, agreed_seconds, repeat_samples, wall_seconds

#: compute between two collectives of an in-step sample on a CPU: about what a layer of a small
#: model computes between two collectives of a tensor-parallel step (the forward of one block of
#: the accuracy benchmark's GPT takes ~2 ms on one core)
BURST_S = 1e-3
BURST_MATMUL_N = 128     # the burst is a chain of N x N fp32 matmuls
#: collectives a step issues as a chain of asynchronous calls waited together: on a CPU they are
#: also timed as such (``timing: chained``), per call of a chain of CHAIN_CALLS issued straight
#: out of a burst -- ZeroRedundancyOptimizer broadcasts every parameter tensor this way
#: (its ``_sync_params``), and only the chain's first call finds gloo's thread asleep
CHAINED_OPS = ("broadcast",)
CHAIN_CALLS = 16
#: share of in-step samples cut from each end before their mean (``in_step_mean``)
IN_STEP_TRIM = 0.05


def compute_burst(device: torch.device) -> Callable[[], None]:
    """A chain of matmuls lasting about ``BURST_S`` on this machine, the same length on every rank
    (the count is agreed with MAX over the world, so every rank computes the same work)."""
    a = torch.randn(BURST_MATMUL_N, BURST_MATMUL_N, device=device)
    b = torch.randn(BURST_MATMUL_N, BURST_MATMUL_N, device=device)
    # the fastest rank's time: the largest count any rank would take, as every rank must run it
    n = max(1, round(BURST_S / max(agreed_matmul_seconds(a, b, agree=dist.ReduceOp.MIN), 1e-9)))

    def burst() -> None:
        for _ in range(n):
            torch.mm(a, b)
    return burst


def agreed_matmul_seconds(a: torch.Tensor, b: torch.Tensor, warmup: int = 3, reps: int = 20,
                          agree=dist.ReduceOp.MAX) -> float:
    """Seconds of one ``a @ b``, reduced over the ranks of the default group with ``agree`` (the
    slowest rank's by default), so that every rank sizes its bursts of compute alike."""
    for _ in range(warmup):
        torch.mm(a, b)
    return agreed_seconds(lambda: torch.mm(a, b), a.device, reps, None, agree=agree, barrier=False) / reps


class InStepTimer:
    """Times closures in step on a group, ``rounds`` times each, every closure of a set once per
    round so that slow spells fall on all of them: [barrier; ``lead``; t0; ``burst``; closure].
    A closure's figure is the ``in_step_mean`` of its samples, less that of ``burst`` alone
    (when there is one); ``warmup`` untimed calls of each closure come first."""

    def __init__(self, group, rounds: int, lead: Callable[[], None], burst: Callable[[], None] | None = None,
                 warmup: int = 2):
        self.group, self.rounds, self.lead, self.burst, self.warmup = group, rounds, lead, burst, warmup

    def __call__(self, cases: dict) -> dict:
        burst = self.burst
        cases = {**cases, "_burst": lambda: None} if burst is not None else dict(cases)
        for fn in cases.values():                   # warm-up: allocator, lazy init, first collectives
            for _ in range(self.warmup):
                fn()
        timed = {k: fn if burst is None else (lambda fn=fn: (burst(), fn())) for k, fn in cases.items()}
        samples: dict = {k: [] for k in cases}
        for _ in range(self.rounds):
            for k, fn in timed.items():
                dist.barrier(group=self.group)
                self.lead()
                samples[k].append(wall_seconds(fn))
        means = {k: in_step_mean(v) for k, v in samples.items()}
        base = means.pop("_burst", 0.0)
        return {k: v - base for k, v in means.items()}


def time_in_step(fn, device: torch.device, policy: RepeatPolicy, group,
                 burst: Callable[[], None]) -> tuple[float, int]:
    """Seconds per call of a collective in step, and the number of samples.  The stop rule counts
    the wall time the samples took (the bursts too), so a case costs about ``target_total_s``."""
    for _ in range(policy.warmup):
        fn()
    samples, inner = repeat_samples(lambda inner: _agreed_in_step_sample(fn, burst, inner, group), policy)
    # An in-step figure is a difference of two noisy times and can come out below the call's
    # own cost -- even below zero -- when the bursts alone happen to run slower than beside the
    # calls.  No call costs less in step than back to back, with gloo's threads already awake
    # (the in-step excess is their wake-up, see the module docstring), so the figure is held to
    # at least the median of back-to-back samples of the same call, measured now.
    floor = statistics.median([agreed_seconds(fn, device, inner, group) / inner
                               for _ in range(policy.min_samples)])
    return max(in_step_mean(samples), floor), len(samples)


def in_step_mean(samples: list[float]) -> float:
    """The figure of in-step samples: their mean, less the top and bottom ``IN_STEP_TRIM``.

    In step, a collective's cost is skewed: most calls find gloo's thread at once, some wait a
    scheduler time slice for a core (measured in the accuracy benchmark's 2-rank
    tensor-parallel step: 19 waits per step, most 0.2-0.9 ms, a quarter 4-9 ms).  A step is the
    sum of its calls, so its expected time is the sum of their means (linearity of
    expectation); the median of such a distribution sits near its common case and prices the
    step short.  The trim only drops the rare spell of another tenant of the host.
    """
    from scipy.stats import trim_mean

    return float(trim_mean(samples, IN_STEP_TRIM))


def _agreed_in_step_sample(fn, burst: Callable[[], None], inner: int, group) -> tuple[float, float]:
    """(``inner`` rounds of [burst; call] less ``inner`` bursts alone, the wall time of both),
    each figure the slowest rank's."""
    dist.barrier(group=group)
    with_calls = wall_seconds(lambda: (burst(), fn()), inner)
    dist.barrier(group=group)
    alone = wall_seconds(burst, inner)
    elapsed = torch.tensor([with_calls, alone], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed[0] - elapsed[1]), float(elapsed[0] + elapsed[1])


def make_chain(op: str, size_bytes: int, g: int, members: list[int], group, device: torch.device):
    """CHAIN_CALLS asynchronous calls of ``op`` on separate tensors, then a wait on each."""
    if op != "broadcast":
        raise ValueError(f"no chained form of {op!r}; chained ops: {CHAINED_OPS}")
    numel = max(g, size_bytes // 4 // g * g)
    xs = [torch.ones(numel, device=device) for _ in range(CHAIN_CALLS)]

    def chain():
        handles = [dist.broadcast(x, src=members[0], group=group, async_op=True) for x in xs]
        for h in handles:
            h.wait()
    return chain

