"""The step composed in one place: per layer, per model chunk, per pipeline rank.

Every reader of a step -- the step model's two forms (step_model.OVERLAPPED, cpu_node.SERIAL),
the fast path's derived table (layer_memo.derived_table, evaluator.evaluate), the trace
(trace.py), the planner's per-layer tables (planner/layer_tables.py) and its screening bound
(planner/screen_bound.py, through simulator/api.py) -- calls these functions instead of
stating the composition itself.  The parts they compose live in their rooms: a layer's
compute per pass and its traffic (overlap.compute_per_pass, overlap.fsdp_traffic: the
registered terms' columns), the pipeline (axes/pp.py, axes/pp_p2p.py) and the gradient sync
(axes/dp_sync.py).

* per micro-batch and model chunk, forward = sum over layers of max(compute + tp collectives,
  the next layer's FSDP all-gather [+ offload copy]) -- prefetch hides the shorter of the two
  (overlap.py); the chunk's first layer waits for its own gather; backward likewise with
  recompute and the reduce-scatter (``layer_effective_times``); where communication takes turns
  with compute (a CPU node, cpu_node.serial_communication) compute plus traffic
  (``serial_layer_times``);
* pipeline (rank r busy T_r = forward + backward of all its chunks, one micro-batch):
  GPipe and 1F1B: sum_r T_r + (m - 1) max_r T_r (the fill/drain of Huang et al. 2019 and
  Narayanan et al. 2021 Sec. 2.2.1; for equal stages (m + p - 1) T, bubble (p-1)/(m+p-1));
  interleaved with v chunks: m max_r T_r + (sum_r T_r - max_r T_r) / v (bubble divided by v,
  Narayanan et al. 2021 Sec. 2.2.2); plus the activation sends of the fill and the drain: the
  first micro-batch crosses every stage boundary forward and its gradient every one back,
  2 (p - 1) sends, and 2 (p v - 1) when it runs through the p v model chunks of an interleaved
  pipeline (Sec. 2.2.2: v times as many stage boundaries) (axes/pp.pipeline_and_ends,
  ``pipeline_with_ends``); the schedules that split the backward into input and weight gradients
  (interleaved-zb, zbv, dualpipev) from each chunk's forward, input-gradient and weight-gradient
  times (axes/pp_zero_bubble.py);
* data parallel after the last backward: DDP all-reduces each layer's gradients as soon as
  its last backward ends, one after another on the communication stream, so the step ends
  at max_k(ready_k + sum of the all-reduces launched from k on) (Li et al. 2020, "PyTorch
  Distributed", Sec. 3.2); FSDP's last reduce-scatter is exposed -- under a pipeline every
  reduce-scatter of the rank's first chunk, which torch's schedules issue once, after the last
  backward (axes/pp_fsdp.py, dp_sync.fsdp_tails); then the optimizer step (and ZeRO-1's
  parameter all-gather) (dp_sync.after_backward) (``step_from_chunk_times``, ``serial_step``);
  the same, event by event, for the trace (``after_backward_spans``);
* the planner's views of one layer alone (no neighbours, no pipeline order): its own traffic
  beside its compute (``folded_layer_time``) and a floor under every strategy of a ZeRO family
  (``layer_floor``).

``ctx`` is the evaluator's context of the plan (step/context.Context: mesh, stages, micro-batches,
the pipeline send time).
"""
from __future__ import annotations

import numpy as np

from autopar.simulator.axes import pp_p2p as pipeline_p2p
from autopar.simulator.axes.dp_sync import (after_backward, ddp_all_reduces, ddp_excess, fsdp_tails,
                                             gradient_ready_offsets, last_reduce_scatter)
from autopar.simulator.axes.pp import expert_all_to_all_times, pipeline_and_ends, weight_gradient_times
from autopar.simulator.step.layer_table import LayerTable
from autopar.simulator.step.overlap import compute_per_pass, fsdp_traffic


# ---------------------------------------------------------------- per layer
def layer_parts(src, zero, offload, pipeline_m: int | None = None):
    """(forward compute, backward compute, forward traffic, backward gather, backward traffic) of
    a layer per micro-batch, before they overlap: overlap.compute_per_pass and
    overlap.fsdp_traffic of ``src`` (a LayerTable, a LayerCost, term_registry.with_term_columns)."""
    fwd_comm, bwd_gather, bwd_comm = fsdp_traffic(src, zero, offload, pipeline_m)
    fwd_c, bwd_c = compute_per_pass(src)
    return fwd_c, bwd_c, fwd_comm, bwd_gather, bwd_comm


def layer_effective_times(rows: LayerTable, head: np.ndarray, tail: np.ndarray,
                          not_tail: np.ndarray, pipeline_m: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per layer and micro-batch: forward and backward time with FSDP traffic overlapped.

    FSDP prefetches one layer ahead: while layer k computes, layer k+1's all-gather (and
    offload copy) runs, so a layer takes max(its compute, the next layer's gather) -- and the
    first layer of each model chunk (``head``) waits for its own gather, which nothing
    precedes (Zhao et al. 2023, "PyTorch FSDP", Sec. 3.3).  In backward the communication
    stream carries the next gather and this layer's reduce-scatter; the chunk's first backward
    layer (its last layer) waits for its gather.  ``head``, ``tail``, ``not_tail``:
    step_model.chunk_masks.  Layer k's times read rows k and k+1 (of k+1 its forward
    communication: the "traffic" terms' columns before forward, built in dp_allgather_s, h2d_s,
    zero, offload) and k's masks only (the evaluator's memo relies on it).  ``pipeline_m``: a
    pipeline's micro-batches, None without one (axes/pp_fsdp.py: its gathers are per step, spread
    over the micro-batches, and its reduce-scatters end the step, dp_sync.fsdp_tails).
    """
    fwd_c, bwd_c, fwd_comm, bwd_gather, bwd_comm = layer_parts(rows, rows.zero, rows.offload, pipeline_m)
    next_comm = np.empty_like(fwd_comm)                          # the gather prefetched while k runs
    np.multiply(fwd_comm[1:], not_tail[:-1], out=next_comm[:-1])
    next_comm[-1] = 0.0
    fwd = np.maximum(fwd_c, next_comm) + fwd_comm * head
    bwd = np.maximum(bwd_c, bwd_comm) + bwd_gather * tail
    return fwd, bwd


def serial_layer_times(rows: LayerTable, pipeline_m: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per layer and micro-batch: forward and backward time when communication and compute take
    turns (cpu_node.serial_communication): every layer's traffic adds to its compute."""
    fwd_c, bwd_c, fwd_comm, _, bwd_comm = layer_parts(rows, rows.zero, rows.offload, pipeline_m)
    return fwd_c + fwd_comm, bwd_c + bwd_comm


def folded_layer_time(src, zero: int, offload: bool, pipeline_m: int | None = None) -> tuple[float, float]:
    """(time per micro-batch, exposed time per step) of one layer alone, the planner's fold of a
    LayerCost (planner/layer_tables.py): per micro-batch its own FSDP traffic hides behind its
    compute and shows only where longer (the rule of ``layer_effective_times``, without the
    neighbour's prefetch); per step the data-parallel all-reduce (DDP, ZeRO-1) beyond this
    layer's own backward (the step model queues them over the whole backward:
    dp_sync.ddp_excess) and ZeRO-1's parameter all-gather, or under a pipeline the
    reduce-scatter issued once after the last backward (axes/pp_fsdp.py), plus the optimizer.
    ``zero``: the stage that runs (axes/sharded_dp.effective_zero)."""
    fwd_c, bwd_c, fwd_comm, _, bwd_comm = layer_parts(src, zero, offload, pipeline_m)
    fwd = max(fwd_c, fwd_comm)
    bwd = max(bwd_c, bwd_comm)
    exposed = 0.0
    if zero <= 1:
        # once per step, behind the last micro-batch's backward; ZeRO-1 gathers parameters after
        exposed = max(0.0, src.dp_allreduce_s - bwd) + (src.dp_allgather_s if zero == 1 else 0.0)
    elif pipeline_m is not None:
        exposed = src.dp_reducescatter_s
    return fwd + bwd, exposed + src.optimizer_s


def layer_floor(src, zero: int, traffic: bool) -> float:
    """A layer's seconds per micro-batch below ``folded_layer_time`` of every strategy that shares
    its compute (planner/screen_bound.py): the compute of both passes, and with ``traffic`` at
    least the traffic before forward plus after backward of ZeRO stage ``zero`` without offload
    (no pipeline)."""
    fwd, bwd = compute_per_pass(src)
    compute = fwd + bwd
    if traffic:
        fwd_comm, _, bwd_comm = fsdp_traffic(src, zero, False)
        compute = max(compute, fwd_comm + bwd_comm)
    return compute


# ---------------------------------------------------------------- per model chunk and rank
def pipeline_with_ends(ctx, rows: LayerTable, f_g: np.ndarray, b_g: np.ndarray, c) -> tuple[float, float, np.ndarray]:
    """(pipeline time, bubble, when each rank's last backward ends) of the chunks' task lengths
    ``f_g``, ``b_g`` and the send ``c`` charged in the fill and drain (axes/pp.pipeline_and_ends,
    with the split-backward schedules' weight-gradient times and DualPipeV's hidden all-to-alls)."""
    return pipeline_and_ends(ctx, f_g, b_g, c, weight_gradient_times(ctx, rows), expert_all_to_all_times(ctx, rows))


def overlapped_chunk_times(ctx, rows: LayerTable):
    """(per-layer forward and backward slots, per-chunk forward and backward task lengths, the
    send charged in the fill and drain) of the overlapped form: what ``overlapped_step`` composes
    and the trace draws (trace.py)."""
    fwd, bwd = layer_effective_times(rows, ctx.head, ctx.tail, ctx.not_tail, ctx.pipeline_m)
    f_g, b_g, c = pipeline_p2p.task_lengths(np.add.reduceat(fwd, ctx.starts), np.add.reduceat(bwd, ctx.starts),
                                            ctx.p2p_s, ctx.p2p_blocking)
    return fwd, bwd, f_g, b_g, c


def overlapped_step(ctx, rows: LayerTable) -> tuple[np.ndarray, float]:
    """(time at which each pipeline rank finishes the step, bubble fraction), communication
    overlapping compute (a GPU's streams)."""
    fwd, bwd = layer_effective_times(rows, ctx.head, ctx.tail, ctx.not_tail, ctx.pipeline_m)
    return step_from_chunk_times(ctx, rows, bwd, np.add.reduceat(fwd, ctx.starts), np.add.reduceat(bwd, ctx.starts))


def step_from_chunk_times(ctx, rows: LayerTable, bwd: np.ndarray, f_g: np.ndarray, b_g: np.ndarray,
                          fsdp_tail: np.ndarray | None = None, any_ddp: bool | None = None,
                          any_zero1: bool | None = None) -> tuple[np.ndarray, float]:
    """``overlapped_step`` from the layers' effective backward times ``bwd`` and their sums per
    model chunk ``f_g``, ``b_g`` (layer_effective_times of ``rows``): the pipeline, the gradient
    sync and the optimizer step.  ``fsdp_tail`` (last_reduce_scatter of each rank's first layer),
    ``any_ddp`` (does some layer run ZeRO 0 or 1) and ``any_zero1`` (after_backward): where the
    caller has them.  The evaluator's fast path hands in terms it kept from earlier plans
    (step/layer_memo.LayerMemo)."""
    p = ctx.p
    f_g, b_g, c = pipeline_p2p.task_lengths(f_g, b_g, ctx.p2p_s, ctx.p2p_blocking)   # a blocking exchange ends its task
    pipe, bubble, end_r = pipeline_with_ends(ctx, rows, f_g, b_g, c)  # chunk 0 ends last
    sync = overlapped_sync(ctx, rows, end_r, bwd, b_g, fsdp_tail, any_ddp)
    return after_backward(sync, rows, ctx.layer_rank, p, any_zero1, ctx.grad_norm_s), bubble


def overlapped_sync(ctx, rows: LayerTable, end_r: np.ndarray, bwd: np.ndarray, b_g: np.ndarray,
                    fsdp_tail: np.ndarray | None = None, any_ddp: bool | None = None) -> np.ndarray:
    """Per pipeline rank, when its gradient sync ends, its last backward ending at ``end_r``
    (``step_from_chunk_times`` says what the other arguments are): DDP's all-reduces queued as
    each layer's gradient is ready (dp_sync.ddp_excess) beside FSDP's exposed reduce-scatter of
    the last layer to finish (dp_sync.fsdp_tails)."""
    excess = ddp_excess(ctx, rows, bwd, b_g, any_ddp)
    if fsdp_tail is None:
        fsdp_tail = fsdp_tails(ctx, rows)
    # (times are never negative: without DDP the larger of nothing and the tail is the tail)
    return end_r + (fsdp_tail if excess is None else np.maximum(excess, fsdp_tail))


def serial_chunk_times(ctx, rows: LayerTable):
    """(per-layer forward and backward slots, per-chunk forward and backward task lengths, the
    send charged in the fill and drain: none) when communication and compute take turns
    (cpu_node.serial_communication): every layer's FSDP traffic and every pipeline send adds to
    its rank's compute instead of hiding under it (``overlapped_chunk_times``'s serial twin)."""
    fwd, bwd = serial_layer_times(rows, ctx.pipeline_m)
    f_g = np.add.reduceat(fwd, ctx.starts)
    b_g = np.add.reduceat(bwd, ctx.starts)
    if len(ctx.starts) > 1:
        # each chunk's send (activation forward, gradient backward) blocks its compute
        f_g[:-1] += ctx.p2p_s
        b_g[1:] += ctx.p2p_s
    return fwd, bwd, f_g, b_g, 0.0


def serial_fsdp_tail(ctx, rows: LayerTable) -> np.ndarray:
    """Per pipeline rank: under a pipeline schedule its sharded layers' reduce-scatters, issued
    once after their chunk's last backward (axes/pp_fsdp.py), taking turns with compute: all of
    them add up; zeros without a pipeline (each micro-batch's backward holds them,
    ``serial_chunk_times``)."""
    if ctx.pipeline_m is None:
        return np.zeros(ctx.p)
    per_layer = last_reduce_scatter(rows.dp_reducescatter_s, rows.d2h_s, rows.offload, rows.zero)
    return np.bincount(ctx.layer_rank, weights=per_layer, minlength=ctx.p)


def serial_step(ctx, rows: LayerTable) -> tuple[np.ndarray, float]:
    """(time at which each pipeline rank finishes the step, bubble fraction) when communication
    and compute take turns (cpu_node.serial_communication): the chunk times of
    ``serial_chunk_times``; the pipeline schedule is the overlapped form's with the sends inside
    the chunk times; every gradient all-reduce adds to its rank's last backward."""
    p = ctx.p
    _, _, f_g, b_g, _ = serial_chunk_times(ctx, rows)
    _, bubble, end_r = pipeline_with_ends(ctx, rows, f_g, b_g, 0.0)
    return after_backward(serial_sync(ctx, rows, end_r), rows, ctx.layer_rank, p, grad_norm_s=ctx.grad_norm_s), bubble


def serial_sync(ctx, rows: LayerTable, end_r: np.ndarray) -> np.ndarray:
    """Per pipeline rank, when its gradient sync ends in the serial form, its last backward
    ending at ``end_r``: the all-reduces take turns with the last backward, all of them add up,
    and so do the pipeline's reduce-scatters (``serial_fsdp_tail``)."""
    p = ctx.p
    ar = ddp_all_reduces(rows)
    excess = np.bincount(ctx.layer_rank, weights=ar, minlength=p) if ar.any() else np.zeros(p)
    return end_r + np.maximum(excess, np.zeros(p)) + serial_fsdp_tail(ctx, rows)


def after_backward_spans(ctx, rows: LayerTable, base: np.ndarray, bwd: np.ndarray, b_g: np.ndarray,
                         serial: bool) -> tuple[list[list[tuple[str, str, float, float]]], np.ndarray]:
    """The step after each pipeline rank's last backward, event by event: per rank its events as
    (stream, name, start, length), and when each rank ends the step.  ``base``: when each rank's
    last backward ends (``pipeline_with_ends``, or a drawn pipeline's later end); ``bwd``,
    ``b_g``: the layers' backward slots and the chunks' backward task lengths of the step form;
    ``serial``: the serial form (``serial_step``), else the overlapped one
    (``step_from_chunk_times``).

    The figures are the step model's own: the sync ends where ``serial_sync`` or
    ``overlapped_sync`` puts it and the step where dp_sync.after_backward does.  The events lay
    them out: DDP's all-reduces on ``dp``, each launched when its gradient is ready
    (dp_sync.gradient_ready_offsets) and never before the previous one ends (serial: one after
    another from the last backward), FSDP's exposed reduce-scatter on ``fsdp``; from the sync on,
    the gradient norm's all-reduce of a clipped step (``dp``), the optimizer (``compute``; the
    offloaded layers' host Adam on ``host``) and ZeRO-1's parameter all-gather (``dp``).  The
    trace draws them (trace.py)."""
    p = ctx.p
    starts = ctx.starts.tolist()
    ar = ddp_all_reduces(rows)
    if serial:
        sync, fsdp_tail = serial_sync(ctx, rows, base), serial_fsdp_tail(ctx, rows)
    else:
        fsdp_tail = fsdp_tails(ctx, rows)
        sync, rel = overlapped_sync(ctx, rows, base, bwd, b_g, fsdp_tail), gradient_ready_offsets(ctx, bwd, b_g)
    finish = after_backward(sync, rows, ctx.layer_rank, p, grad_norm_s=ctx.grad_norm_s)
    spans: list[list[tuple[str, str, float, float]]] = []
    for r in range(p):
        out = []
        layers = np.flatnonzero(ctx.layer_rank == r)
        mine = layers[ar[layers] > 0]
        t_ar = float(base[r])
        if serial:                           # the all-reduces take turns with compute: one after another
            for k in mine[::-1]:
                out.append(("dp", f"all_reduce L{k}", t_ar, ar[k]))
                t_ar += ar[k]
            out.append(("fsdp", "reduce_scatter (pipeline, once a step)", t_ar, fsdp_tail[r]))
        else:
            queue = -np.inf
            for k in mine[np.argsort(rel[mine], kind="stable")]:
                s0 = max(queue, base[r] + rel[k])
                out.append(("dp", f"all_reduce L{k}", s0, ar[k]))
                queue = s0 + ar[k]
            out.append(("fsdp", f"reduce_scatter L{starts[r]} (exposed)" if ctx.pipeline_m is None
                        else "reduce_scatter (pipeline, once a step)", base[r], fsdp_tail[r]))
        t = float(sync[r])
        if ctx.grad_norm_s is not None:      # a clipped step: the norm's all-reduce before the step
            out.append(("dp", "all_reduce grad norm", t, float(ctx.grad_norm_s[r])))
            t += float(ctx.grad_norm_s[r])
        opt, offl = rows.optimizer_s[layers], rows.offload[layers] > 0
        dev_opt, host_opt = float(opt[~offl].sum()), float(opt[offl].sum())
        out.append(("compute", "optimizer", t, dev_opt))
        out.append(("host", "optimizer (host)", t + dev_opt, host_opt))
        ag1 = float((rows.dp_allgather_s[layers] * (rows.zero[layers] == 1)).sum())
        out.append(("dp", "all_gather params (ZeRO-1)", t + dev_opt + host_opt, ag1))
        spans.append(out)
    return spans, finish
