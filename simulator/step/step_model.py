"""The step model: one training step of a plan in closed form, from its per-layer table.

This is the one description of the step that the search, ``autopar simulate``, ``autopar
report`` and the plan's ``predicted`` block all read (evaluator.closed_form_step):

* per micro-batch and model chunk, forward = sum over layers of max(compute + tp collectives,
  the next layer's FSDP all-gather [+ offload copy]) -- prefetch hides the shorter of the two
  (overlap.py); the chunk's first layer waits for its own gather; backward likewise with
  recompute and the reduce-scatter (``layer_effective_times``);
* pipeline (rank r busy T_r = forward + backward of all its chunks, one micro-batch):
  GPipe and 1F1B: sum_r T_r + (m - 1) max_r T_r (the fill/drain of Huang et al. 2019 and
  Narayanan et al. 2021 Sec. 2.2.1; for equal stages (m + p - 1) T, bubble (p-1)/(m+p-1));
  interleaved with v chunks: m max_r T_r + (sum_r T_r - max_r T_r) / v (bubble divided by v,
  Narayanan et al. 2021 Sec. 2.2.2); plus the activation sends of the fill and the drain: the
  first micro-batch crosses every stage boundary forward and its gradient every one back,
  2 (p - 1) sends, and 2 (p v - 1) when it runs through the p v model chunks of an interleaved
  pipeline (Sec. 2.2.2: v times as many stage boundaries) (``pipeline_time``); the schedules
  that split the backward into input and weight gradients (interleaved-zb, zbv, dualpipev) from
  each chunk's forward, input-gradient and weight-gradient times (pipeline_zero_bubble.py);
* data parallel after the last backward: DDP all-reduces each layer's gradients as soon as
  its last backward ends, one after another on the communication stream, so the step ends
  at max_k(ready_k + sum of the all-reduces launched from k on) (Li et al. 2020, "PyTorch
  Distributed", Sec. 3.2); FSDP's last reduce-scatter is exposed -- under a pipeline every
  reduce-scatter of the rank's first chunk, which torch's schedules issue once, after the last
  backward (pipeline_fsdp.py, ``fsdp_tails``); then the optimizer step
  (and ZeRO-1's parameter all-gather) (``after_backward``).

``ctx`` is the evaluator's context of the plan (step/context.Context: mesh, stages, micro-batches,
the pipeline send time); step_trace.py lays the same terms out as the trace's events.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from autopar.core.rules import SPLIT_BACKWARD_SCHEDULES
from autopar.simulator.axes import pp_p2p as pipeline_p2p
from autopar.simulator.axes.pp_zero_bubble import split_backward_time
from autopar.simulator.step.layer_table import COLUMN_INDEX, LayerTable
from autopar.simulator.step.overlap import compute_per_pass, fsdp_traffic
from autopar.simulator.axes.pp_fsdp import pipelined_tail


#: columns overlapped_step reads from the first layers' rows
_RS, _D2H, _OFFLOAD, _ZERO = (COLUMN_INDEX[c] for c in ("dp_reducescatter_s", "d2h_s", "offload", "zero"))


def chunk_masks(starts: np.ndarray, num_layers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(head, tail, not_tail): the first layer of each model chunk, its last, and the others."""
    head = np.zeros(num_layers, dtype=bool)
    head[starts] = True
    tail = np.zeros(num_layers, dtype=bool)
    tail[np.asarray(starts)[1:] - 1] = True
    tail[num_layers - 1] = True
    return head, tail, ~tail


def layer_effective_times(rows: LayerTable, head: np.ndarray, tail: np.ndarray,
                          not_tail: np.ndarray, pipeline_m: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per layer and micro-batch: forward and backward time with FSDP traffic overlapped.

    FSDP prefetches one layer ahead: while layer k computes, layer k+1's all-gather (and
    offload copy) runs, so a layer takes max(its compute, the next layer's gather) -- and the
    first layer of each model chunk (``head``) waits for its own gather, which nothing
    precedes (Zhao et al. 2023, "PyTorch FSDP", Sec. 3.3).  In backward the communication
    stream carries the next gather and this layer's reduce-scatter; the chunk's first backward
    layer (its last layer) waits for its gather.  ``head``, ``tail``, ``not_tail``: chunk_masks.
    Layer k's times read rows k and k+1 (of k+1 its forward communication: the "traffic" terms'
    columns before forward, built in dp_allgather_s, h2d_s, zero, offload) and k's masks only
    (the evaluator's memo relies on it).  ``pipeline_m``: a pipeline's micro-batches, None without
    one (pipeline_fsdp.py: its gathers are per step, spread over the micro-batches, and its
    reduce-scatters end the step, ``fsdp_tails``).
    """
    fwd_comm, bwd_gather, bwd_comm = fsdp_traffic(rows, rows.zero, rows.offload, pipeline_m)
    fwd_c, bwd_c = compute_per_pass(rows)
    next_comm = np.empty_like(fwd_comm)                          # the gather prefetched while k runs
    np.multiply(fwd_comm[1:], not_tail[:-1], out=next_comm[:-1])
    next_comm[-1] = 0.0
    fwd = np.maximum(fwd_c, next_comm) + fwd_comm * head
    bwd = np.maximum(bwd_c, bwd_comm) + bwd_gather * tail
    return fwd, bwd


def pipeline_time(t_r: np.ndarray, m: int, p: int, v: int, send_s: float) -> tuple[float, float]:
    """(time from the first forward to the last backward, bubble fraction) for ranks busy ``t_r``
    per micro-batch (module docstring); ``send_s``: one activation send between stages.

    The sends are charged where the first micro-batch waits for them, in the fill and the
    drain: 2 (G - 1) of them over the G = p v model chunks in a row.  In the steady state the
    schedule hides them behind other micro-batches' work; for equal chunks an interleaved
    pipeline does so while a send is no longer than a chunk's forward or backward (its warm-up runs
    2 (p - r - 1) + (v - 1) p forwards on rank r, one micro-batch's worth of slack per
    boundary), so the formula is then the schedule's exact length
    (tests/simulator/test_simulator_trace.py, test_hand_schedules)."""
    t_max = float(t_r.max())
    fill_drain_sends = 2 * (p * v - 1) * send_s
    if v == 1:
        pipe = float(t_r.sum()) + (m - 1) * t_max + fill_drain_sends
    else:
        pipe = interleaved_time(float(t_r.sum()), t_max, m, v) + fill_drain_sends
    bubble = 1.0 - m * t_max / pipe if pipe > 0 else 0.0
    return pipe, bubble


def interleaved_time(total: float, t_max: float, m: int, v: int, bubble_share: float = 1.0) -> float:
    """The interleaved schedule's length without sends, ``m max_r T_r + (sum_r T_r - max_r T_r) / v``
    (Narayanan et al. 2021, Sec. 2.2.2: the bubble divided by the v chunks per rank), from
    ``total`` = sum_r T_r and ``t_max`` = max_r T_r; v = 1 is one rank's (or equal stages')
    ``m T``.  The one copy of the formula: ``pipeline_time``, the planner's screen
    (planner/search.py) and its bound (planner/screen_bound.py) read it; ``bubble_share``: the
    part of that bubble a split-backward schedule keeps, where only whole backward passes are
    known (pipeline_zero_bubble.screen_bubble_share)."""
    return m * t_max + bubble_share * (total - t_max) / v


def pipeline_and_ends(ctx, f_g: np.ndarray, b_g: np.ndarray, send_s: float,
                      w_g: np.ndarray | None = None) -> tuple[float, float, np.ndarray]:
    """(pipeline length, bubble fraction, when each rank's last backward ends) from the model
    chunks' task lengths ``f_g``, ``b_g`` and the send ``send_s`` charged in the fill and drain;
    ``w_g``: of ``b_g``, the weight gradients (``weight_gradient_times``), which a split-backward
    schedule runs apart (none: nothing to defer)."""
    p, v = ctx.p, ctx.v
    if ctx.schedule in SPLIT_BACKWARD_SCHEDULES and p > 1:
        w = np.zeros_like(b_g) if w_g is None else np.minimum(w_g, b_g)
        grid, m = ctx.grid, ctx.num_microbatches
        pipe = split_backward_time(ctx.schedule, f_g[grid], (b_g - w)[grid], w[grid], m) + 2 * (p * v - 1) * send_s
        t_max = float((f_g + b_g)[grid].sum(axis=0).max())
        return pipe, (1.0 - m * t_max / pipe if pipe > 0 else 0.0), rank_ends(pipe, b_g[:p], send_s)
    t_r = f_g + b_g if v == 1 else (f_g + b_g)[ctx.grid].sum(axis=0)   # per rank, over its chunks
    pipe, bubble = pipeline_time(t_r, ctx.num_microbatches, p, v, send_s)
    return pipe, bubble, rank_ends(pipe, b_g[:p], send_s)


def weight_gradient_times(ctx, rows: LayerTable) -> np.ndarray | None:
    """Per model chunk and micro-batch: its layers' weight-gradient compute (``bwd_weight_s``), for
    a split-backward schedule; None for the others."""
    if ctx.schedule not in SPLIT_BACKWARD_SCHEDULES:
        return None
    return np.add.reduceat(rows.bwd_weight_s, ctx.starts)


def rank_ends(pipe: float, b_first_chunk: np.ndarray, send_s: float) -> np.ndarray:
    """When each pipeline rank ends its last backward: rank 0 last, each later rank one backward
    of its first chunk (and a send) earlier."""
    before = np.empty(len(b_first_chunk))
    before[0] = 0.0
    (b_first_chunk[:-1] + send_s).cumsum(out=before[1:])
    return pipe - before


def after_backward(sync: np.ndarray, rows: LayerTable, layer_rank: np.ndarray, p: int,
                   any_zero1: bool | None = None, grad_norm_s: np.ndarray | None = None) -> np.ndarray:
    """When each pipeline rank ends the step: after the gradient sync ``sync``, the gradient norm's
    all-reduce of a clipped step (``grad_norm_s``, per rank, or None: optimizer_step.py; the clip's
    passes are in the optimizer column), the optimizer step and ZeRO-1's parameter all-gather;
    ``any_zero1``: does some layer run ZeRO-1, where the caller knows."""
    if grad_norm_s is not None:
        sync = sync + grad_norm_s
    opt = np.bincount(layer_rank, weights=rows.optimizer_s, minlength=p)
    if any_zero1 is False:
        return sync + opt
    zero1 = rows.zero == 1
    if not np.count_nonzero(zero1):
        return sync + opt
    return sync + opt + np.bincount(layer_rank, weights=rows.dp_allgather_s * zero1, minlength=p)


def gradient_ready_offsets(ctx, bwd: np.ndarray, b_g: np.ndarray) -> np.ndarray:
    """Per layer: when its gradient is ready, relative to the end of its rank's last backward
    (negative: earlier).  The layer's own backward ends the backward slots of its chunk's
    earlier layers before the chunk's last; with v chunks per rank the cool-down runs p
    backward passes of each later chunk before the next one's, so a chunk's last backward ends
    that much before the rank's.  ``bwd``: per-layer backward slots; ``b_g``: per-chunk backward."""
    p, v = ctx.p, ctx.v
    cum = np.cumsum(bwd)
    before = cum - bwd - (cum[ctx.starts] - bwd[ctx.starts])[ctx.layer_stage]
    chunk_off = np.zeros(len(ctx.starts))
    if v > 1:
        b_vp = b_g[ctx.grid]
        chunk_off = np.empty(len(ctx.starts))
        chunk_off[ctx.grid] = (np.cumsum(b_vp, axis=0) - b_vp) * p
    return -(before + chunk_off[ctx.layer_stage])


def overlapped_step(ctx, rows: LayerTable) -> tuple[np.ndarray, float]:
    """(time at which each pipeline rank finishes the step, bubble fraction), communication
    overlapping compute (a GPU's streams)."""
    fwd, bwd = layer_effective_times(rows, ctx.head, ctx.tail, ctx.not_tail, ctx.pipeline_m)
    return step_from_chunk_times(ctx, rows, bwd, np.add.reduceat(fwd, ctx.starts), np.add.reduceat(bwd, ctx.starts))


def overlapped_chunk_times(ctx, rows: LayerTable):
    """(per-layer forward and backward slots, per-chunk forward and backward task lengths, the
    send charged in the fill and drain) of the overlapped form: what ``overlapped_step`` composes
    and the trace draws (step_trace.py)."""
    fwd, bwd = layer_effective_times(rows, ctx.head, ctx.tail, ctx.not_tail, ctx.pipeline_m)
    f_g, b_g, c = pipeline_p2p.task_lengths(np.add.reduceat(fwd, ctx.starts), np.add.reduceat(bwd, ctx.starts),
                                            ctx.p2p_s, ctx.p2p_blocking)
    return fwd, bwd, f_g, b_g, c


@dataclass(frozen=True)
class StepForm:
    """How a context's step is composed, chosen once when the evaluator builds the context
    (step/context.build_context): ``step(ctx, rows)`` -> (per-rank ends, bubble); ``chunk_times(ctx,
    rows)`` -> overlapped_chunk_times's five terms, which the trace draws; ``serial``: the
    communication takes turns with compute; ``memo_ok``: the per-layer terms of the form are local
    (step/layer_memo.LayerMemo may serve)."""
    name: str
    step: Callable
    chunk_times: Callable
    serial: bool
    memo_ok: bool


#: a GPU's: communication on its own streams, overlapping compute
OVERLAPPED = StepForm("overlapped", overlapped_step, overlapped_chunk_times, serial=False, memo_ok=True)


def ddp_all_reduces(rows: LayerTable) -> np.ndarray:
    """Per layer: its DDP gradient all-reduce, where the layer runs ZeRO-0 or 1 (a sharded layer
    reduce-scatters instead: ``last_reduce_scatter``)."""
    return rows.dp_allreduce_s * (rows.zero <= 1)


def last_reduce_scatter(rs, d2h, offload, zero):
    """Per layer: what is left of the step after its backward when it is the last layer to finish
    (the first layer of a rank's chunk 0): a sharded layer's reduce-scatter and its copy out to
    the host, exposed (Zhao et al. 2023, "PyTorch FSDP", Sec. 3.3).  Arrays or plain numbers."""
    if not np.count_nonzero(offload):
        return rs * (zero >= 2)           # no copy out to the host (a zero term left out)
    return (rs + d2h * offload) * (zero >= 2)


def fsdp_tails(ctx, rows: LayerTable) -> np.ndarray:
    """Per pipeline rank: what its sharded layers' reduce-scatters (and copies out) leave of the
    step after its last backward -- without a pipeline the last layer to finish's
    (``last_reduce_scatter`` of each rank's first layer), under one the reduce-scatters of its
    first model chunk, which the schedule issues after its last backward (pipeline_fsdp.py)."""
    if ctx.pipeline_m is None:
        first = rows.data[ctx.starts[:ctx.p]].T
        return last_reduce_scatter(first[_RS], first[_D2H], first[_OFFLOAD], first[_ZERO])
    per_layer = last_reduce_scatter(rows.dp_reducescatter_s, rows.d2h_s, rows.offload, rows.zero)
    return pipelined_tail(per_layer, ctx.layer_stage, ctx.layer_rank, ctx.p)


def step_from_chunk_times(ctx, rows: LayerTable, bwd: np.ndarray, f_g: np.ndarray, b_g: np.ndarray,
                          fsdp_tail: np.ndarray | None = None, any_ddp: bool | None = None,
                          any_zero1: bool | None = None) -> tuple[np.ndarray, float]:
    """``overlapped_step`` from the layers' effective backward times ``bwd`` and their sums per
    model chunk ``f_g``, ``b_g`` (layer_effective_times of ``rows``): the pipeline, the gradient
    sync and the optimizer step.  ``fsdp_tail`` (last_reduce_scatter of each rank's first layer),
    ``any_ddp`` (does some layer run ZeRO 0 or 1) and ``any_zero1`` (after_backward): where the
    caller has them.  The evaluator's fast path
    hands in terms it kept from earlier plans (step/layer_memo.LayerMemo)."""
    p = ctx.p
    f_g, b_g, c = pipeline_p2p.task_lengths(f_g, b_g, ctx.p2p_s, ctx.p2p_blocking)   # a blocking exchange ends its task
    pipe, bubble, end_r = pipeline_and_ends(ctx, f_g, b_g, c, weight_gradient_times(ctx, rows))  # chunk 0 ends last
    # ---- DDP: gradients all-reduced as each layer's last backward ends
    layer_rank = ctx.layer_rank
    excess = None                         # no DDP all-reduce past the last backward
    ar = rows.dp_allreduce_s
    if any_ddp is False:                  # every layer sharded: the mask below leaves nothing
        ar = None
    elif np.count_nonzero(ar):            # (none without DDP / ZeRO-1 layers: nothing to mask)
        ar = ddp_all_reduces(rows)
    if ar is not None and np.count_nonzero(ar):
        rel = gradient_ready_offsets(ctx, bwd, b_g)
        order = np.lexsort((rel, layer_rank))
        rel_s, ar_s, rank_s = rel[order], ar[order], layer_rank[order]
        total = np.bincount(rank_s, weights=ar_s, minlength=p)
        cum_ar = np.cumsum(ar_s)
        first_idx = np.searchsorted(rank_s, np.arange(p))
        before_in_rank = cum_ar - ar_s - (cum_ar - ar_s)[np.minimum(first_idx, len(ar_s) - 1)][rank_s]
        suffix = total[rank_s] - before_in_rank
        val = np.where(ar_s > 0, rel_s + suffix, -np.inf)
        excess = np.maximum(0.0, np.maximum.reduceat(val, np.minimum(first_idx, len(val) - 1)))
    # ---- FSDP: the reduce-scatter of the last layer to finish (first layer of chunk 0)
    if fsdp_tail is None:
        fsdp_tail = fsdp_tails(ctx, rows)
    # (times are never negative: without DDP the larger of nothing and the tail is the tail)
    sync = end_r + (fsdp_tail if excess is None else np.maximum(excess, fsdp_tail))
    return after_backward(sync, rows, layer_rank, p, any_zero1, ctx.grad_norm_s), bubble
