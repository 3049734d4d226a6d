"""The Chrome trace of a step, laid out from the step model's own terms.

The step model (compose.py: its overlapped step, or serial_step where communication takes turns with
compute) prices a step in closed form; this module draws that same step as events, one
representative device per pipeline rank, from the same quantities:

* each task (forward or backward of one micro-batch on one model chunk) is a run of layer
  slots, each as long as the layer's effective time (the context's step form's chunk_times:
  compose.layer_effective_times; in the serial form compute plus traffic).  Inside a slot
  the registered "compute" terms (term_registry.py) run one after another, each on its stream:
  the layer's forward, or recompute then backward, on the compute stream, with its in-layer
  collectives after it on the ``tp``, ``cp`` and ``ep`` streams (they sit on the critical path).  The ``fsdp`` stream carries the traffic the
  step model prices beside the layer: in forward, the next layer's prefetched all-gather (and
  host-to-device copy), the chunk's first layer having waited for its own; in backward, a
  gather and a reduce-scatter (and device-to-host copy) of the layer's own size, marked
  "(priced)" -- they stand for the next layer's prefetch and the previous layer's
  reduce-scatter, which the step model prices at this layer's size (equal in a run of equal
  layers) -- the chunk's first backward layer having waited for its own gather.  A slot whose
  traffic outlasts its compute shows the compute stream idle: the layer waits for it;
* the tasks run in the schedule's order on each rank (``schedule_tasks``); a task starts when
  its rank is free and its input has arrived: a forward after the previous stage's forward of
  the same micro-batch and its activation send on the ``pp`` stream, a backward after the
  next stage's backward and its gradient send (the last stage's after its own forward); where
  the exchange blocks its rank (a CPU node; Megatron-LM 2021's, pipeline_p2p.py) the send is
  drawn as the last part of the sender's task;
* each rank's last backward ends where the step model puts it (``pp.rank_ends`` of
  the pipeline formula, ``pp.pipeline_time``): where the formula charges more than
  the schedule needs (unequal stages), the rank waits before that last backward; every
  earlier task starts as soon as it can;
* after backward, the events compose.after_backward_spans lays out from where the drawn
  pipeline ends: on the ``dp`` stream, DDP's all-reduces one after another, each launched
  when the step model says its gradient is ready (never before the drawn backward of that
  layer ends), and FSDP's exposed last reduce-scatter on ``fsdp``; then the optimizer (on
  ``compute``; the offloaded layers' host Adam on ``host``) and ZeRO-1's parameter all-gather
  (``dp``): dp_sync.after_backward's terms.

So every rank's last event ends at the time the step model gives for that rank, and the
trace's last event at the step time (tests/simulator/test_simulator_trace.py checks both to 1e-9, with
the invariants: no two events overlap on a stream, no task starts before its input arrives).

The pipeline formula idealises the schedule: it charges the sends between stages only in the
fill and the drain (2 (p v - 1) of them), and fills an interleaved pipeline as if its model
chunks were equal.  Interleaved with equal chunks and sends no longer than a chunk's forward
or backward, the warm-up hides the steady-state sends and the formula is the schedule's length.
Where the schedule, played with every send, cannot finish within the formula (1F1B with a send
that is not small against a stage's work, as the steady state then waits for sends; longer
sends; interleaved chunks of unequal length, as when a rank's layers do not divide by v), the
drawn pipeline keeps every dependency and ends later than the step model's:
``StepTrace.late_s`` says by how much for each rank (zero wherever the formula is met), and
the trace is that much longer than the step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.simulator.step.layer_table import LayerTable
from autopar.simulator.step.compose import after_backward_spans, pipeline_with_ends
from autopar.core.rules import SPLIT_BACKWARD_SCHEDULES
from autopar.simulator.axes.pp_zero_bubble import stage_grid
from autopar.simulator.axes.pp_torch_order import torch_action_order
from autopar.simulator.axes.pp import weight_gradient_times
from autopar.simulator.step.term_registry import pass_events, traffic_terms
from autopar.simulator.step.timeline import Timeline


def schedule_tasks(schedule: str, p: int, r: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """Ordered (pass, micro-batch, chunk) tasks of pipeline rank ``r``.

    GPipe: all forwards, then all backwards (Huang et al. 2019); 1F1B: p - r - 1 warm-up
    forwards, then one forward one backward (Narayanan et al. 2021 Sec. 2.2.1); interleaved
    1F1B: v model chunks per rank, 2(p - r - 1) + (v - 1)p warm-up steps, micro-batches in
    groups of p per chunk (Sec. 2.2.2).  A single rank runs each micro-batch's forward then
    its backward.  The split-backward schedules (interleaved-zb, zbv, dualpipev): the order
    torch's own classes give each rank (torch_pipeline_order.py), with "I" (input gradient) and
    "W" (weight gradient) tasks, or "B" where the backward runs whole.
    """
    if schedule in SPLIT_BACKWARD_SCHEDULES and p > 1:
        # torch's own order (torch_pipeline_order.py); the stage as the rank's chunk index
        chunk_of = {int(g): c for c, g in enumerate(stage_grid(schedule, p, v)[:, r])}
        return [(kind, mb, chunk_of[stage]) for kind, mb, stage in torch_action_order(schedule, p, m, v)[r]]
    if schedule == "gpipe" or (p == 1 and v == 1):
        if schedule == "gpipe" and p > 1:
            return [("F", i, c) for i in range(m) for c in range(v)] + \
                   [("B", i, c) for i in range(m) for c in reversed(range(v))]
        return [t for i in range(m) for t in ([("F", i, c) for c in range(v)] + [("B", i, c) for c in reversed(range(v))])]
    if v == 1:
        warm = min(p - r - 1, m)
        tasks = [("F", i, 0) for i in range(warm)]
        for i in range(m - warm):
            tasks += [("F", warm + i, 0), ("B", i, 0)]
        tasks += [("B", i, 0) for i in range(m - warm, m)]
        return tasks
    total = m * v

    def fwd(k: int) -> tuple[str, int, int]:
        return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k: int) -> tuple[str, int, int]:
        return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    warm = min(2 * (p - r - 1) + (v - 1) * p, total)
    tasks = [fwd(k) for k in range(warm)]
    for i in range(total - warm):
        tasks += [fwd(warm + i), bwd(i)]
    tasks += [bwd(k) for k in range(total - warm, total)]
    return tasks


@dataclass
class StepTrace:
    """The drawn step: its events and, per pipeline rank, when its last event ends."""
    events: list[dict[str, Any]]
    rank_end_s: np.ndarray
    late_s: np.ndarray       # per rank: how much later the drawn pipeline ends than the model's (0 where met)


@dataclass(frozen=True)
class _Terms:
    """The step model's per-layer and per-chunk terms of one plan (overlapped or serial form)."""
    serial: bool
    fwd: np.ndarray          # effective forward time of each layer per micro-batch (its slot)
    bwd: np.ndarray          # effective backward time of each layer per micro-batch
    f_g: np.ndarray          # per model chunk: forward task length (serial: with its send)
    b_g: np.ndarray
    pipe: float
    end_r: np.ndarray        # when each rank's last backward ends (pp.rank_ends)
    send_s: float            # the activation send drawn between stages
    sends_in_task: bool = False   # a blocking exchange (P2PRuntime.blocking) is the last part of its task
    pipeline_m: int | None = None  # a pipeline's micro-batches (its FSDP traffic per step: pipeline_fsdp.py)
    w: np.ndarray | None = None    # split-backward schedules: each layer's weight-gradient slot (of bwd)
    w_g: np.ndarray | None = None  # ... and per model chunk


def _terms(ctx, rows: LayerTable) -> _Terms:
    """The quantities the context's step form composes (ctx.step_form: step_model.OVERLAPPED or
    cpu_node.SERIAL), from its own ``chunk_times`` and compose.pipeline_with_ends."""
    fwd, bwd, f_g, b_g, c_pipe = ctx.step_form.chunk_times(ctx, rows)
    pipe, _, end_r = pipeline_with_ends(ctx, rows, f_g, b_g, c_pipe)
    w_g = weight_gradient_times(ctx, rows)
    serial = ctx.step_form.serial
    w = None
    if w_g is not None:
        w = np.minimum(rows.bwd_weight_s, bwd)
        w_g = np.add.reduceat(w, ctx.starts)
    return _Terms(serial=serial, fwd=fwd, bwd=bwd, f_g=f_g, b_g=b_g, pipe=pipe, end_r=end_r, send_s=ctx.p2p_s,
                  sends_in_task=serial or ctx.p2p_blocking, pipeline_m=ctx.pipeline_m, w=w, w_g=w_g)


def _pipeline_starts(ctx, terms: _Terms) -> tuple[list[list[tuple[str, int, int, float, float | None]]], np.ndarray]:
    """Per rank, in schedule order: (pass, micro-batch, chunk, start, start of its send or None)
    of every task, and when each rank's last task ends.

    A task starts when its rank is free and its input has arrived: the neighbouring task's
    send, queued on the sender's ``pp`` stream (in the serial form the send is the last part
    of the sender's task).  Each rank's last task (the backward of micro-batch m - 1 on chunk
    0) starts no earlier than the step model's end for that rank minus its length, and ends
    then exactly when it can start there."""
    p, v, m = ctx.p, ctx.v, ctx.num_microbatches
    G = p * v
    serial = terms.serial or terms.sends_in_task       # each send is the last part of its task
    c = terms.send_s
    f_g, b_g = terms.f_g.tolist(), terms.b_g.tolist()
    w_g = terms.w_g.tolist() if terms.w_g is not None else [0.0] * G
    length = {"F": f_g, "B": b_g, "I": [b - w for b, w in zip(b_g, w_g)], "W": w_g}
    grid = stage_grid(ctx.schedule, p, v).tolist()
    rank_of = {g: r for row in grid for r, g in enumerate(row)}
    end_r = terms.end_r.tolist()
    tasks = [schedule_tasks(ctx.schedule, p, r, m, v) for r in range(p)]
    ptr = [0] * p
    free = [0.0] * p
    pp_free = [0.0] * p
    arrive: dict[tuple[str, int, int], float] = {}
    out: list[list[tuple[str, int, int, float, float | None]]] = [[] for _ in range(p)]
    remaining = sum(len(t) for t in tasks)
    while remaining:
        progressed = False
        for r in range(p):
            my = tasks[r]
            while ptr[r] < len(my):
                kind, mb, chunk = my[ptr[r]]
                g = grid[chunk][r]
                if kind == "F":
                    dep = ("F", mb, g - 1) if g > 0 else None
                elif kind == "W":
                    dep = None                  # after its own input gradient, earlier on this rank
                else:                           # "B", or "I": the gradient of the next stage's input
                    dep = ("B", mb, g + 1) if g < G - 1 else ("F", mb, g)
                if dep is not None and dep not in arrive:
                    break
                t = max(free[r], arrive[dep] if dep is not None else 0.0)
                end = t + length[kind][g]
                # (a relative 1e-12 absorbs the rounding of the two sums that reach the same end)
                if ptr[r] == len(my) - 1 and end <= end_r[r] * (1.0 + 1e-12):
                    t, end = end_r[r] - length[kind][g], end_r[r]
                free[r] = end
                send = None
                # a send where the neighbouring stage is on another rank (the V's turn is not)
                to = g + 1 if kind == "F" else g - 1
                if kind != "W" and 0 <= to < G and rank_of[to] != r:
                    send = end - c if serial else max(pp_free[r], end)
                    pp_free[r] = send + c
                out[r].append((kind, mb, chunk, t, send))
                if kind != "W":
                    arrive[("F" if kind == "F" else "B", mb, g)] = end if send is None or serial else send + c
                ptr[r] += 1
                remaining -= 1
                progressed = True
        assert progressed, "pipeline schedule deadlocked: a task waits for one that never runs"
    return out, np.array(free)


def _draw_task(tl: Timeline, dev: int, kind: str, mb: int, g: int, a: int, b: int, t: float, rows: LayerTable,
               terms: _Terms, head: np.ndarray, tail: np.ndarray) -> float:
    """Draw the layer slots of one task (layers a..b-1 of virtual stage g) from ``t``; returns
    when the last slot ends."""
    args = {"micro_batch": mb, "stage": g}
    # the registered "traffic" terms' parts (term_registry.traffic_terms: FSDP's gathers and
    # reduce-scatter, the offload copies), in the order overlap.fsdp_traffic sums them
    traffic = [(t, parts) for t in traffic_terms()
               for parts in (t.traffic(rows, rows.zero, rows.offload, terms.pipeline_m),) if parts is not None]

    def gather(k: int, s: float, backward: bool, label: str = "") -> float:
        """Layer k's traffic before a pass from ``s`` (overlap.fsdp_traffic's forward
        communication, or its backward gather); returns its end."""
        for t, parts in traffic:
            d = parts[1 if backward else 0][k]
            tl.add(dev, t.stream, f"{t.gather_label} L{k}{label}", s, d, **args)
            s += d
        return s

    def scatter(k: int, s: float, label: str = "") -> float:
        """Layer k's traffic after backward from ``s``; returns its end."""
        for t, parts in traffic:
            d = parts[2][k]
            tl.add(dev, t.stream, f"{t.scatter_label} L{k}{label}", s, d, **args)
            s += d
        return s

    # the registered "compute" terms of this pass, in order (term_registry.pass_events): the
    # built-in ones draw forward then its tp collectives, recompute then backward then its collectives
    events = [(rows.column(col), label, stream) for col, label, stream in pass_events()[kind in ("B", "I")]]

    def compute(k: int, s: float) -> float:
        for values, label, stream in events:
            tl.add(dev, stream, f"{label} L{k}", s, values[k], **args)
            s += values[k]
        return s

    order = range(a, b) if kind == "F" else range(b - 1, a - 1, -1)
    slots = terms.fwd if kind == "F" else terms.bwd
    if kind == "W":                 # the weight gradients a split backward ran apart
        for k in order:
            tl.add(dev, "compute", f"bwd weights L{k}", t, terms.w[k], **args)
            t += terms.w[k]
        return t
    if kind == "I":                 # the input gradient: the backward less its weight gradients
        events = [(v - terms.w if label == "bwd" else v, label, stream) for v, label, stream in events]
        slots = terms.bwd - terms.w
    for k in order:
        if terms.serial:
            # communication takes turns with compute: gather, compute, (backward) reduce-scatter
            end = compute(k, gather(k, t, kind == "B"))
            if kind == "B":
                scatter(k, end)
        elif kind == "F":
            c0 = gather(k, t, False) if head[k] else t      # the chunk's first layer waits for its gather
            compute(k, c0)
            if k + 1 < b:
                gather(k + 1, c0, False)                     # prefetched while layer k runs
        else:
            c0 = gather(k, t, True) if tail[k] else t       # the chunk's first backward layer waits
            compute(k, c0)
            # the traffic the step model prices beside layer k's backward: in a run of equal layers,
            # the next layer's prefetched gather and the previous one's reduce-scatter
            scatter(k, gather(k, c0, True, " (priced)"), " (priced)")
        t += slots[k]
    return t


def draw_step(ctx, rows: LayerTable, device_of_rank: list[int]) -> StepTrace:
    """The step of the plan (evaluator context ``ctx``, per-layer table ``rows``) as timeline
    events; ``device_of_rank``: the device drawn for each pipeline rank."""
    p = ctx.p
    terms = _terms(ctx, rows)
    starts, ends = ctx.starts.tolist(), ctx.ends.tolist()
    tl = Timeline(True)
    task_starts, drawn_end = _pipeline_starts(ctx, terms)
    for r in range(p):
        dev = device_of_rank[r]
        grid = stage_grid(ctx.schedule, p, ctx.v)
        for kind, mb, chunk, t, send in task_starts[r]:
            g = int(grid[chunk, r])
            _draw_task(tl, dev, kind, mb, g, starts[g], ends[g], t, rows, terms, ctx.head, ctx.tail)
            if send is not None:
                tl.add(dev, "pp", f"send {'act' if kind == 'F' else 'grad'} mb{mb}", send, terms.send_s,
                       micro_batch=mb, stage=g, to_stage=g + 1 if kind == "F" else g - 1)
    # ---- after the last backward: compose.after_backward_spans lays it out, from where the
    # drawn pipeline ends
    late = drawn_end - terms.end_r               # 0.0 where the pipeline formula is met
    spans, finish = after_backward_spans(ctx, rows, drawn_end, terms.bwd, terms.b_g, terms.serial)
    for r in range(p):
        for stream, name, s0, d in spans[r]:
            tl.add(device_of_rank[r], stream, name, s0, d)
    return StepTrace(events=tl.events, rank_end_s=finish, late_s=late)
