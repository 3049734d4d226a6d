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

The pipeline's formulas live in axes/pp.py, the gradient sync's in axes/dp_sync.py; this module
composes them with the per-layer overlap.

``ctx`` is the evaluator's context of the plan (step/context.Context: mesh, stages, micro-batches,
the pipeline send time); step/trace.py lays the same terms out as the trace's events.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from autopar.simulator.axes import pp_p2p as pipeline_p2p
from autopar.simulator.axes.dp_sync import after_backward, ddp_excess, fsdp_tails
from autopar.simulator.axes.pp import pipeline_and_ends, weight_gradient_times
from autopar.simulator.step.layer_table import LayerTable
from autopar.simulator.step.overlap import compute_per_pass, fsdp_traffic


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
    excess = ddp_excess(ctx, rows, bwd, b_g, any_ddp)
    # ---- FSDP: the reduce-scatter of the last layer to finish (first layer of chunk 0)
    if fsdp_tail is None:
        fsdp_tail = fsdp_tails(ctx, rows)
    # (times are never negative: without DDP the larger of nothing and the tail is the tail)
    sync = end_r + (fsdp_tail if excess is None else np.maximum(excess, fsdp_tail))
    return after_backward(sync, rows, ctx.layer_rank, p, any_zero1, ctx.grad_norm_s), bubble
