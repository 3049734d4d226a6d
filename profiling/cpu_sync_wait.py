"""How much longer CPU ranks take when they must meet after each stretch of compute.

On a CPU "device" (one process per core, gloo) a synchronising collective costs more the
longer the ranks computed before it.  Measured on the 2-core machine of
profiles/local-cpu.json, 2 gloo ranks, a 128 KiB all-reduce straight after a chain of
matmuls, against the same matmuls alone (medians): +0.6 ms after no compute, +1.3 ms after 1.2 ms,
+1.5 ms after 3 ms, +2.2 ms after 9 ms and +4.2 ms after 25 ms (a 4 MiB all-reduce: +4.1,
+4.3, +4.9, +6.9, +7.6 ms).  The per-rank burst times themselves agree to ~1% in their
medians, so it is the meeting that costs: every rank's stretch of compute is interrupted now
and then by the host (other tenants, the kernel, the launcher, gloo's own threads), and a
collective waits for the rank interrupted most -- the longer the stretch, the more it has
collected.  A training step on such a machine meets after every layer (tensor parallelism),
every FSDP unit, every pipeline micro-batch and at the end of the backward (DDP), so its
device work stretches by about the same share.

``measure_sync_wait`` times, for a few burst lengths ``g``, rounds of [g of matmuls; a 128 KiB
all-reduce] and rounds of [g of matmuls] alone, interleaved; the extra time of a round
(trimmed means of each, ``cpu_in_step.in_step_mean``) is
kept per burst length (``gaps_s``, ``extra_s``): the median of ``RUNS`` whole measurements.  The wait does not grow in proportion to the
burst: over bursts of 0.5 to 54 ms a line through the points has a slope of ~0.03 (2
processes) and ~0.2 (4 processes, two per core), over 0.5 to 9 ms ~0.09 and ~0.45 -- a
meeting after a long stretch waits for the rank interrupted most, not for the sum of the
interruptions.  So the simulator reads the points themselves (simulator/cost_model.py,
``meeting_wait``: the wait of one meeting after a given stretch of work) and prices each plan
by how often its ranks meet (simulator/evaluator.py, ``with_meeting_waits``): a
tensor-parallel plan meets every layer, a data-parallel one once a step.  ``fixed`` and
``per_compute``, a least-squares line ``fixed + per_compute * g`` (``fit_line``), are kept
for information and for profiles made before the points were read; ``fixed`` -- the wake-up of
gloo's threads -- is already in the collective table's in-step rows
(profiling/collectives.py).  On a GPU nothing is measured: a GPU's kernels queue behind the
compute and no host thread is woken.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from autopar.profiling.cpu_in_step import InStepTimer, agreed_matmul_seconds
from autopar.profiling.timing import median_of_runs

#: lengths of the compute bursts, seconds: from about a small layer's forward to about a whole
#: step of a small model (the accuracy benchmark's GPT: ~2 ms per block forward, ~35 ms a
#: step on one process, ~35-70 ms between the meetings of a data-parallel step on 2-4
#: processes); the longest keeps such a step inside the measured points instead of extrapolated
BURST_LENGTHS_S = (0.5e-3, 2e-3, 6e-3, 18e-3, 54e-3, 150e-3)
BURST_LENGTHS_S_QUICK = (0.5e-3, 4e-3)
ROUNDS = 100
#: whole measurements per profile, the median kept per point
RUNS = 3
ROUNDS_QUICK = 8
MATMUL_N = 128
#: the meeting: an all-reduce of a tensor-parallel block's activations in the accuracy benchmark's
#: GPT (4 x 64 x 128 fp32)
MEETING_BYTES = 128 * 1024


def fit_line(gaps_s: Sequence[float], extra_s: Sequence[float]) -> tuple[float, float]:
    """(fixed, per_compute): least-squares line ``extra = fixed + per_compute * gap``, with
    ``per_compute`` and ``fixed`` clipped at zero (a meeting never saves time)."""
    if len(gaps_s) != len(extra_s) or len(gaps_s) < 2:
        raise ValueError("fit_line needs at least two (gap, extra) points of equal count")
    slope, intercept = np.polyfit(np.asarray(gaps_s, float), np.asarray(extra_s, float), 1)
    return max(0.0, float(intercept)), max(0.0, float(slope))


def measure_sync_wait(quick: bool = False) -> dict:
    """One row ``{processes, gaps_s, extra_s, fixed_s, per_compute, rounds}``, the same on every
    rank; every rank of the default group takes part (run under torchrun on a CPU)."""
    world = dist.get_world_size()
    lengths = BURST_LENGTHS_S_QUICK if quick else BURST_LENGTHS_S
    rounds = ROUNDS_QUICK if quick else ROUNDS
    a = torch.randn(MATMUL_N, MATMUL_N)
    b = torch.randn(MATMUL_N, MATMUL_N)
    one_mm = agreed_matmul_seconds(a, a, warmup=5, reps=50)
    token = torch.zeros(MEETING_BYTES // 4)

    def burst(n: int) -> None:
        for _ in range(n):
            torch.mm(a, b)

    def meet(n: int) -> None:
        burst(n)
        dist.all_reduce(token)

    counts = [max(1, round(g / one_mm)) for g in lengths]
    cases = {}
    for n in counts:
        cases[("alone", n)] = lambda n=n: burst(n)
        cases[("meet", n)] = lambda n=n: meet(n)

    def once() -> dict[str, float]:
        # every rank out of the barrier and computing (2 matmuls) before the clock starts
        t = InStepTimer(dist.group.WORLD, rounds, lead=lambda: burst(2), warmup=0)(cases)
        # means, not medians: a step is a sum of such stretches (cpu_in_step.in_step_mean)
        gaps = [t[("alone", n)] for n in counts]
        extra = [t[("meet", n)] - t[("alone", n)] for n in counts]
        # the mean over ranks (each rank sees the meeting from its side)
        vals = torch.tensor(gaps + extra, dtype=torch.float64)
        dist.all_reduce(vals)
        vals /= world
        return {f"{i}": float(x) for i, x in enumerate(vals.tolist())}

    # the whole measurement repeated and the median kept per point: the waits are differences
    # of ~1 ms between timings that a slow spell of the shared machine moves by as much
    # (two profiles of the same machine, one measurement each, read 0.66 and 0.02 ms after 5 ms)
    med = median_of_runs(once, 1 if quick else RUNS)
    vals = [med[f"{i}"] for i in range(2 * len(counts))]
    gaps, extra = vals[:len(counts)], vals[len(counts):]
    fixed, per_compute = fit_line(gaps, extra)
    return {"processes": world, "gaps_s": gaps, "extra_s": extra, "fixed_s": fixed, "per_compute": per_compute,
            "rounds": rounds, "runs": 1 if quick else RUNS, "backend": dist.get_backend()}
