"""Time the op sweep on this machine and turn it into the profile's ``op_table`` rows.

Each case of ``autopar.profiling.op_sweeps`` is built on the device, timed with
``autopar.profiling.timing.time_call`` (forward only, under ``torch.no_grad``) and freed.  Rows
are then made non-decreasing in size (``make_monotone``): within one kind, variant and dtype,
sorted by the work the time grows with (FLOPs for compute kinds, bytes for memory-bound ones),
``seconds`` is the isotonic fit of the measured times (``autopar.profiling.isotonic``), so
interpolating the table can never say that more work takes less time.  The raw median stays in ``measured_seconds``.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Callable, Iterable

import torch

from autopar.profiling.op_sweeps import COMPUTE_KINDS, OpCase
from autopar.profiling.isotonic import monotone_seconds
from autopar.profiling.timing import RepeatPolicy, time_call


def measure_ops(cases: Iterable[OpCase], device: torch.device, policy: RepeatPolicy,
                on_case: Callable[[OpCase], None] | None = None) -> list[dict]:
    """One row per case: kind, variant, dtype, shape, flops, bytes, seconds (+ sampling details)."""
    rows = []
    for case in cases:
        if on_case is not None:
            on_case(case)
        with torch.no_grad(), _tf32(device, case.dtype == "tf32"):
            fn = case.build(device)
            t = time_call(fn, device, policy)
        del fn
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append({"kind": case.kind, "variant": case.variant, "dtype": case.dtype, "shape": list(case.shape),
                     "flops": case.flops, "bytes": case.bytes, "seconds": t.median_s,
                     "measured_seconds": t.median_s, "num_samples": t.num_samples,
                     "calls_per_sample": t.calls_per_sample, "spread": round(t.spread, 4)})
    return rows


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
