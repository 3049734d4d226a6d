"""The pipeline's step formulas: the schedule's length and bubble over the model chunks' task
lengths, and when each rank's last backward ends (apply_pp.py's twin in the step).

GPipe and 1F1B: sum_r T_r + (m - 1) max_r T_r (the fill/drain of Huang et al. 2019 and Narayanan
et al. 2021 Sec. 2.2.1; for equal stages (m + p - 1) T, bubble (p-1)/(m+p-1)); interleaved with v
chunks: m max_r T_r + (sum_r T_r - max_r T_r) / v (bubble divided by v, Narayanan et al. 2021
Sec. 2.2.2); plus the activation sends of the fill and the drain, 2 (p v - 1) of them
(``pipeline_time``); the schedules that split the backward into input and weight gradients
(interleaved-zb, zbv, dualpipev) from each chunk's forward, input-gradient and weight-gradient
times (pp_zero_bubble.py).  step/compose.py composes the step from these.
"""
from __future__ import annotations

import numpy as np

from autopar.core.rules import SPLIT_BACKWARD_SCHEDULES
from autopar.simulator.axes.pp_zero_bubble import split_backward_time
from autopar.simulator.step.layer_table import LayerTable


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
                      w_g: np.ndarray | None = None,
                      a2a_g: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[float, float, np.ndarray]:
    """(pipeline length, bubble fraction, when each rank's last backward ends) from the model
    chunks' task lengths ``f_g``, ``b_g`` and the send ``send_s`` charged in the fill and drain;
    ``w_g``: of ``b_g``, the weight gradients (``weight_gradient_times``), which a split-backward
    schedule runs apart (none: nothing to defer); ``a2a_g``: of ``f_g`` and of ``b_g``, the expert
    all-to-alls that DualPipeV's pairs hide behind compute (``expert_all_to_all_times``; none:
    the pairs run their two passes one after the other)."""
    p, v = ctx.p, ctx.v
    if ctx.schedule in SPLIT_BACKWARD_SCHEDULES and p > 1:
        w = np.zeros_like(b_g) if w_g is None else np.minimum(w_g, b_g)
        grid, m = ctx.grid, ctx.num_microbatches
        a2a_f, a2a_b = (None, None) if a2a_g is None else (a2a_g[0][grid], a2a_g[1][grid])
        pipe = split_backward_time(ctx.schedule, f_g[grid], (b_g - w)[grid], w[grid], m, overlap_a2a=a2a_g is not None,
                                   a2a_f_vp=a2a_f, a2a_b_vp=a2a_b) + 2 * (p * v - 1) * send_s
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


def expert_all_to_all_times(ctx, rows: LayerTable) -> tuple[np.ndarray, np.ndarray] | None:
    """Per model chunk and micro-batch: the expert all-to-alls inside its forward and inside its
    backward (``ep_comm_fwd_s``, ``ep_a2a_bwd_s``), where DualPipeV's pairs hide them behind the
    other pass's compute -- the runtime runs each pair's passes in turns, handing over while an
    exchange is in flight (runtime/dualpipe_overlap.py) -- and communication overlaps compute
    (not where they take turns: cpu_node.serial_communication); None elsewhere and without ep."""
    if ctx.schedule != "dualpipev" or ctx.step_form.serial:
        return None
    f = np.add.reduceat(rows.ep_comm_fwd_s, ctx.starts)
    b = np.add.reduceat(rows.ep_a2a_bwd_s, ctx.starts)
    if not (f.any() or b.any()):
        return None
    return f, b


def rank_ends(pipe: float, b_first_chunk: np.ndarray, send_s: float) -> np.ndarray:
    """When each pipeline rank ends its last backward: rank 0 last, each later rank one backward
    of its first chunk (and a send) earlier."""
    before = np.empty(len(b_first_chunk))
    before[0] = 0.0
    (b_first_chunk[:-1] + send_s).cumsum(out=before[1:])
    return pipe - before
