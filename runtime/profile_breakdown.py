"""``--profile``: a torch.profiler trace and a forward/backward/communication/optimizer split.

The training loop labels its phases with ``record_function``: ``autopar.forward``,
``autopar.backward``, ``autopar.optimizer``.  Under pipelining the schedule labels its own
actions ("Forward 3", "Backward 3" for GPipe/1F1B; "PP:0F3", "PP:1B2", "PP:0SEND_F1" ... for the
interleaved runtime), which are counted as forward, backward and communication.
Communication is every profiler event of a collective or point-to-point call (names starting
``c10d::``, ``nccl:``, ``gloo:``, ``record_param_comms``) and the pipeline send/recv actions.

Each figure is the length of the union of its events' time intervals (so nested events are
not counted twice), divided by the number of profiled steps: seconds per step, keys
``fwd_s``, ``bwd_s``, ``comm_s``, ``optimizer_s`` (named as in the plan's ``predicted`` block).
Communication overlaps compute, so the four need not add up to the step time.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

_COMM = re.compile(r"^(c10d::|nccl:|gloo:|record_param_comms)|^PP:\d+(SEND|RECV)")
_FWD = re.compile(r"^(autopar\.forward|Forward \d+)$|^PP:\d+F\d+$")
_BWD = re.compile(r"^(autopar\.backward|Backward \d+)$|^PP:\d+(B|I|W)\d+$")
_OPT = re.compile(r"^autopar\.optimizer$")


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
    for ev in prof.events():
        start_us, end_us = ev.time_range.start, ev.time_range.end
        for key, pattern in (("comm_s", _COMM), ("fwd_s", _FWD), ("bwd_s", _BWD), ("optimizer_s", _OPT)):
            if pattern.search(ev.name):
                spans[key].append((start_us, end_us))
    steps = max(1, num_steps)
    return {key: _union_us(iv) * 1e-6 / steps for key, iv in spans.items()} | {"profiled_steps": num_steps}


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        total += cur_end - cur_start
    return total
