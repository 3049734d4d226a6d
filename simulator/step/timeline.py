"""Timeline events of a simulated step and their Chrome trace form (opens in Perfetto).

One event per task on one stream of one device: ``compute`` (forward, backward, recompute,
optimizer), ``tp`` (tensor-parallel collectives, on the compute critical path), ``dp``
(DDP's gradient all-reduces, ZeRO-1's parameter all-gather), ``fsdp`` (FSDP's all-gathers and
reduce-scatters with the offloaded layers' host <-> device copies, which the step model runs
beside DDP's all-reduces), ``pp`` (pipeline sends) and ``host`` (the offloaded layers'
optimizer step), and the stream a registered cost term names (simulator/term_registry.py), after
these.  step_trace.py lays a step out on them.  Chrome's trace format: "X" complete events
with microsecond ``ts``/``dur``, ``pid`` = device, ``tid`` = stream, plus "M" metadata events
naming them (Trace Event Format, Google, 2016).
"""
from __future__ import annotations

import json
import os
from typing import Any

STREAMS = ("compute", "tp", "dp", "fsdp", "pp", "host")
STREAM_ID = {s: i for i, s in enumerate(STREAMS)}


class Timeline:
    """Collects events when enabled; a disabled one costs one attribute test per call."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.events: list[dict[str, Any]] = []
        self.devices: dict[int, str] = {}

    def add(self, device: int, stream: str, name: str, start_s: float, dur_s: float, **args: Any) -> None:
        if self.enabled and dur_s > 0:
            self.events.append({"device": device, "stream": stream, "name": name,
                                "start_s": start_s, "dur_s": dur_s, "args": args})


def to_chrome_trace(events: list[dict[str, Any]], device_names: dict[int, str] | None = None) -> dict[str, Any]:
    trace: list[dict[str, Any]] = []
    devices = sorted({e["device"] for e in events})
    stream_id = dict(STREAM_ID)                 # then the streams registered terms name, as they come
    for e in events:
        stream_id.setdefault(e["stream"], len(stream_id))
    for d in devices:
        label = (device_names or {}).get(d, f"rank {d}")
        trace.append({"ph": "M", "name": "process_name", "pid": d, "tid": 0, "args": {"name": label}})
        for s, i in stream_id.items():
            trace.append({"ph": "M", "name": "thread_name", "pid": d, "tid": i, "args": {"name": s}})
    for e in events:
        trace.append({"ph": "X", "name": e["name"], "cat": e["stream"], "pid": e["device"],
                      "tid": stream_id[e["stream"]], "ts": e["start_s"] * 1e6, "dur": e["dur_s"] * 1e6,
                      "args": e.get("args", {})})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike, events: list[dict[str, Any]],
                       device_names: dict[int, str] | None = None) -> None:
    from autopar.core.plan import write_text_atomic

    write_text_atomic(path, json.dumps(to_chrome_trace(events, device_names)))
