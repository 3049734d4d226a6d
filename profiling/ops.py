"""Time the op sweep on this machine and turn it into the profile's ``op_table`` rows.

Each case of ``autopar.profiling.op_sweeps`` is built on the device, timed with
``autopar.profiling.timing.time_call`` (forward only, under ``torch.no_grad``) and freed.  On a
CPU a small case is built several times and the calls rotate over the copies, so that every
call finds its operands out of the core's L2 cache, as an op in a training step does (its
weights were last touched a pass ago, its input by another op): at least ``COLD_BYTES`` of
operands between two uses of the same ones, at most ``MAX_COPIES`` copies.  Timed warm, in
place, and rotated in alternation (six pairs each), linears of a small GPT ran 2-5% and adds of
64 KiB 38% faster warm (norms, softmax and GELU within 2%).  (GPU benchmark harnesses flush the
L2 between samples for the same reason: Triton's ``do_bench`` zeroes a 256 MB buffer.)  Rows
are then made non-decreasing in size (``make_monotone``): within one kind, variant and dtype,
sorted by the work the time grows with (FLOPs for compute kinds, bytes for memory-bound ones),
``seconds`` is the isotonic fit of the measured times (``autopar.profiling.isotonic``), so
interpolating the table can never say that more work takes less time.  The raw median stays in ``measured_seconds``.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
from typing import Callable, Iterable

import torch

from autopar.profiling.op_sweeps import COMPUTE_KINDS, OpCase
from autopar.profiling.isotonic import monotone_seconds
from autopar.profiling.timing import RepeatPolicy, thread_clock_valid, time_call


def measure_ops(cases: Iterable[OpCase], device: torch.device, policy: RepeatPolicy,
                on_case: Callable[[OpCase], None] | None = None, clock: str = "auto") -> list[dict]:
    """One row per case: kind, variant, dtype, shape, flops, bytes, seconds (+ sampling details).

    ``clock``: "auto" times by the thread's CPU time where that measures the op whole (a CPU with
    one intra-op thread: an op's cost without the time other processes held the core,
    profiling/timing.py) and by the host clock otherwise; "wall" always by the host clock (the
    speed check, which asks how fast the machine runs now)."""
    if clock == "auto":
        clock = "thread" if thread_clock_valid(device) else "wall"
    rows = []
    for case in cases:
        if on_case is not None:
            on_case(case)
        with torch.no_grad(), _tf32(device, case.dtype == "tf32"):
            fn = _rotating(case, device)
            t = time_call(fn, device, policy, clock=clock)
        del fn
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append({"kind": case.kind, "variant": case.variant, "dtype": case.dtype, "shape": list(case.shape),
                     "flops": case.flops, "bytes": case.bytes, "seconds": t.median_s,
                     "measured_seconds": t.median_s, "num_samples": t.num_samples,
                     "calls_per_sample": t.calls_per_sample, "spread": round(t.spread, 4), "clock": clock})
    return rows


#: bytes of other operands between two calls on the same ones (a CPU core's L2 is 0.5-2 MiB on
#: current x86 server parts: AMD EPYC 1 MiB, Intel Xeon Sapphire Rapids 2 MiB, vendor sheets)
COLD_BYTES = 4 << 20
MAX_COPIES = 16


def _rotating(case: OpCase, device: torch.device) -> Callable[[], object]:
    """The case's closure; on a CPU, calls rotating over enough copies of its operands that each
    call finds them out of L2 (``COLD_BYTES``)."""
    copies = 1 if device.type != "cpu" or case.bytes <= 0 else min(MAX_COPIES, -(-COLD_BYTES // int(case.bytes)))
    if copies <= 1:
        return case.build(device)
    fns = itertools.cycle([case.build(device) for _ in range(copies)])
    return lambda: next(fns)()


def best_of_passes(sweeps: list[list[dict]]) -> list[dict]:
    """Per case, the row of the pass that timed it fastest, with ``passes`` recorded.

    A shared machine has slow spells lasting minutes (here the same sweep ran 7-32% slower per
    kind a quarter of an hour after another); a sweep's rows are timed one after another, so a
    spell lifts a run of them.  The fastest of a few passes is the least disturbed figure, as
    ``timeit`` keeps the best of its repeats (Python docs, ``timeit``: higher values are caused
    by other processes interfering) -- and as the accuracy benchmark keeps the fastest of its
    rounds of runs.
    """
    if len(sweeps) == 1:
        return sweeps[0]
    out = []
    for rows in zip(*sweeps):
        best = min(rows, key=lambda r: r["measured_seconds"])
        out.append({**best, "passes": len(sweeps)})
    return out


def make_monotone(rows: list[dict]) -> list[dict]:
    """Rows sorted within (kind, variant, dtype) by work, ``seconds`` non-decreasing (isotonic fit)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["kind"], r["variant"], r["dtype"]), []).append(dict(r))
    out: list[dict] = []
    for key in sorted(groups):
        grp = groups[key]
        compute = key[0] in COMPUTE_KINDS
        grp.sort(key=lambda r: (r["flops"], r["bytes"]) if compute else (r["bytes"], r["flops"]))
        fitted = monotone_seconds([r.get("measured_seconds", r["seconds"]) for r in grp])
        for r, sec in zip(grp, fitted):
            r["seconds"] = float(sec)
        out.extend(grp)
    return out


@contextlib.contextmanager
def _tf32(device: torch.device, enabled: bool):
    """TF32 is a matmul mode of fp32 tensors on NVIDIA GPUs (Ampere and later), not a dtype."""
    if device.type != "cuda":
        yield
        return
    old_mm, old_cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old_mm, old_cudnn
