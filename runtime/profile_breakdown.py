"""``--profile``: a torch.profiler trace and a forward/backward/communication/optimizer split.

The runtime labels its phases with ``record_function``: ``autopar.forward``,
``autopar.backward``, ``autopar.optimizer`` -- the training loop around each micro-batch's
forward and backward, and under pipelining each stage around its own compute
(``autopar.runtime.apply_pp.LabelledStage``).  The schedules' own labels ("Forward 3" in GPipe,
"PP:0F3" in the interleaved runtime) are not used for compute: they also hold the wait for the
previous stage's activation.  Communication is every profiler event of a collective or
point-to-point call (names starting ``c10d::``, ``nccl:``, ``gloo:``, ``record_param_comms``)
and the interleaved runtime's send/recv actions.

Each figure is the length of the union of its events' time intervals (so nested events are
not counted twice), clipped to the profiled steps (each step runs inside an ``autopar.step``
region, so a checkpoint's collectives between steps, or a barrier at the end, is not counted),
divided by the number of profiled steps: seconds per step, keys
``fwd_s``, ``bwd_s``, ``comm_s``, ``optimizer_s`` (named as in the plan's ``predicted`` block).
Communication overlaps compute, so the four need not add up to the step time.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# Profiler event names by phase: defined with measured.json's schema, since the report reads
# them back from the trace.
from autopar.core.measured import BACKWARD_PATTERN, COMM_PATTERN, FORWARD_PATTERN, OPTIMIZER_PATTERN, STEP_REGION


def start_profiler(device: torch.device) -> profile:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities, record_shapes=False)
    prof.__enter__()
    return prof


def stop_profiler(prof: profile, num_steps: int, trace_path: Path) -> dict:
    prof.__exit__(None, None, None)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))
    spans: dict[str, list[tuple[float, float]]] = {"fwd_s": [], "bwd_s": [], "comm_s": [], "optimizer_s": []}
    step_spans: list[tuple[float, float]] = []
    for ev in prof.events():
        start_us, end_us = ev.time_range.start, ev.time_range.end
        if ev.name == STEP_REGION:
            step_spans.append((start_us, end_us))
        for key, pattern in (("comm_s", COMM_PATTERN), ("fwd_s", FORWARD_PATTERN), ("bwd_s", BACKWARD_PATTERN),
                             ("optimizer_s", OPTIMIZER_PATTERN)):
            if pattern.search(ev.name):
                spans[key].append((start_us, end_us))
    steps = max(1, num_steps)
    window = union(step_spans)
    return ({key: _length_us(intersect(union(iv), window)) * 1e-6 / steps for key, iv in spans.items()}
            | {"profiled_steps": num_steps})


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering the same time as ``intervals``."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The time covered by both of two disjoint, sorted interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length_us(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)
