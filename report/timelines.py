"""Timelines for the report: the simulator's events and the runtime's torch.profiler trace.

Both become *lanes* for ``autopar.report.figures`` and, for the simulated side, the
per-step forward / backward / communication / optimizer figures that measured.json holds.

The measured figures (runtime/profile_breakdown.py) are unions of the time intervals of
labelled regions on rank 0: ``autopar.forward`` / ``autopar.backward`` / ``autopar.optimizer``
(and the pipeline schedule's actions), and every communication call.  The simulated side is
built the same way from rank 0's events, so the two are comparable:

* forward: per micro-batch, the window from its first to its last forward task on the
  compute and tensor-parallel streams (a forward region in the runtime also waits for the
  tensor-parallel and prefetched FSDP collectives inside it);
* backward: the same with backward and recompute tasks; the last micro-batch's window also
  covers the data-parallel gradient collectives issued during it, since DDP and FSDP wait
  for them before ``backward()`` returns (Li et al. 2020, Sec. 3.2.3; Zhao et al. 2023, Sec. 3.3);
* communication: the union of the tp, cp, ep, dp, fsdp and pp stream events (cp and ep: the
  in-layer collectives of context and expert parallelism, on streams of their own);
* optimizer: the union of the optimizer events (device and host).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from autopar.core.errors import UserError
from autopar.core.jsonfile import parse_json_text, read_text_bounded

# The runtime's own phase regions (only those count as compute: the pipelining schedules'
# labels such as "Forward 3" or "PP:0F3" also hold the wait for the neighbouring stage).
from autopar.core.measured import BACKWARD_PATTERN as _M_BWD
from autopar.core.measured import COMM_PATTERN as _M_COMM
from autopar.core.measured import FORWARD_PATTERN as _M_FWD
from autopar.core.measured import OPTIMIZER_PATTERN as _M_OPT
from autopar.report.figures import Lanes, Span

COMM_STREAMS = ("tp", "cp", "ep", "dp", "fsdp", "pp")


def _category(name: str, stream: str) -> str:
    if stream in COMM_STREAMS:
        return "comm"
    if name.startswith("recompute"):
        return "recompute"
    if name.startswith("optimizer"):
        return "optimizer"
    if name.startswith("bwd"):
        return "bwd"
    if name.startswith("fwd"):
        return "fwd"
    return "other"


def simulated_lanes(events: list[dict[str, Any]]) -> Lanes:
    """One lane per (device, stream) that has events, devices in order."""
    lanes: Lanes = {}
    for e in sorted(events, key=lambda e: (e["device"], _STREAM_ORDER.get(e["stream"], 9), e["start_s"])):
        lanes.setdefault(f"rank {e['device']} {e['stream']}", []).append(
            Span(e["start_s"], e["dur_s"], _category(e["name"], e["stream"]), e["name"]))
    return lanes


_STREAM_ORDER = {"compute": 0, "tp": 1, "cp": 2, "ep": 3, "dp": 4, "fsdp": 5, "pp": 6, "host": 7}


def simulated_breakdown(events: list[dict[str, Any]], device: int = 0) -> dict[str, float]:
    """fwd_s, bwd_s, comm_s, optimizer_s of one device's step (see the module docstring)."""
    ev = [e for e in events if e["device"] == device]
    fwd_win: dict[Any, list[float]] = {}
    bwd_win: dict[Any, list[float]] = {}
    for e in ev:
        if e["stream"] not in ("compute", "tp"):
            continue
        cat = _category(e["name"], "compute")
        mb = (e.get("args") or {}).get("micro_batch")
        win = fwd_win if cat == "fwd" else bwd_win if cat in ("bwd", "recompute") else None
        if win is None:
            continue
        lo_hi = win.setdefault(mb, [e["start_s"], e["start_s"] + e["dur_s"]])
        lo_hi[0] = min(lo_hi[0], e["start_s"])
        lo_hi[1] = max(lo_hi[1], e["start_s"] + e["dur_s"])
    bwd_intervals = [tuple(v) for v in bwd_win.values()]
    if bwd_intervals:
        last_start, last_end = max(bwd_intervals, key=lambda iv: iv[1])
        grad_sync_end = max((e["start_s"] + e["dur_s"] for e in ev if e["stream"] in ("dp", "fsdp")
                             and ("all_reduce" in e["name"] or "reduce_scatter" in e["name"])
                             and last_start <= e["start_s"] <= last_end), default=last_end)
        bwd_intervals.append((last_start, max(last_end, grad_sync_end)))
    comm = [(e["start_s"], e["start_s"] + e["dur_s"]) for e in ev if e["stream"] in COMM_STREAMS]
    opt = [(e["start_s"], e["start_s"] + e["dur_s"]) for e in ev if e["name"].startswith("optimizer")]
    return {"fwd_s": union_length([tuple(v) for v in fwd_win.values()]), "bwd_s": union_length(bwd_intervals),
            "comm_s": union_length(comm), "optimizer_s": union_length(opt)}


def measured_lanes(trace_path: str | Path, max_steps: int = 1) -> Lanes | None:
    """Lanes from a torch.profiler Chrome trace: forward/backward/optimizer and communication.

    Only the first ``max_steps`` steps are drawn (a step starts at each top-level forward
    after an optimizer region), with time 0 at the first forward.
    """
    p = Path(trace_path)
    if not p.is_file():
        return None
    try:
        data = parse_json_text(read_text_bounded(p, what="trace file"), source=f"trace file {p}")
    except UserError:
        return None
    raw = data.get("traceEvents", data) if isinstance(data, dict) else data
    if not isinstance(raw, list):
        return None
    spans: list[tuple[str, float, float, str, str]] = []      # lane, start_us, dur_us, category, name
    for e in raw:
        if not isinstance(e, dict) or e.get("ph") != "X" or not isinstance(e.get("ts"), (int, float)) \
                or not isinstance(e.get("dur", 0.0), (int, float)):
            continue
        name = str(e.get("name", ""))
        cat = ("comm" if _M_COMM.search(name) else "fwd" if _M_FWD.search(name) else
               "bwd" if _M_BWD.search(name) else "optimizer" if _M_OPT.search(name) else None)
        if cat is None:
            continue
        lane = "rank comm" if cat == "comm" else "rank compute"
        spans.append((lane, float(e["ts"]), float(e.get("dur", 0.0)), cat, name))
    if not spans:
        return None
    spans.sort(key=lambda s: s[1])
    t0 = next((s[1] for s in spans if s[3] == "fwd"), spans[0][1])
    # end of the drawn window: the end of the max_steps-th optimizer region after t0
    opt_ends = sorted(s[1] + s[2] for s in spans if s[3] == "optimizer" and s[1] >= t0)
    t_end = opt_ends[max_steps - 1] if len(opt_ends) >= max_steps else max(s[1] + s[2] for s in spans)
    trace_name = p.stem.rsplit(".", 1)[-1] if ".rank" in p.stem else "rank 0"
    lanes: Lanes = {}
    for lane, ts, dur, cat, name in spans:
        if ts < t0 or ts >= t_end:
            continue
        lanes.setdefault(lane.replace("rank", trace_name.replace("rank", "rank ")), []).append(
            Span((ts - t0) * 1e-6, dur * 1e-6, cat, name))
    return lanes


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, cur_lo, cur_hi = 0.0, None, None
    for lo, hi in sorted(intervals):
        if cur_hi is None or lo > cur_hi:
            if cur_hi is not None:
                total += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    if cur_hi is not None:
        total += cur_hi - cur_lo
    return total
