"""Data parallelism's gradient sync at the end of the step: DDP's all-reduces queued behind the
last backward, FSDP's exposed reduce-scatters, then the optimizer step and ZeRO-1's parameter
all-gather (``after_backward``).  step/compose.py composes the step from these.

DDP all-reduces each layer's gradients as soon as its last backward ends, one after another on the
communication stream (Li et al. 2020, "PyTorch Distributed", Sec. 3.2: ``ddp_excess``); FSDP's
last reduce-scatter is exposed -- under a pipeline every reduce-scatter of the rank's first chunk,
which torch's schedules issue once, after the last backward (pp_fsdp.py, ``fsdp_tails``).
"""
from __future__ import annotations

import numpy as np

from autopar.simulator.axes.pp_fsdp import pipelined_tail
from autopar.simulator.step.layer_table import COLUMN_INDEX, LayerTable

#: columns fsdp_tails reads from the first layers' rows
_RS, _D2H, _OFFLOAD, _ZERO = (COLUMN_INDEX[c] for c in ("dp_reducescatter_s", "d2h_s", "offload", "zero"))


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


def ddp_excess(ctx, rows: LayerTable, bwd: np.ndarray, b_g: np.ndarray,
               any_ddp: bool | None = None) -> np.ndarray | None:
    """Per pipeline rank: how far its DDP all-reduces run past its last backward, or None where
    none does.  DDP all-reduces each layer's gradients as soon as its last backward ends, one
    after another on the communication stream, so the rank's sync ends at max_k(ready_k + sum of
    the all-reduces launched from k on) (Li et al. 2020, "PyTorch Distributed", Sec. 3.2).
    ``bwd``: per-layer backward slots, ``b_g``: per-chunk backward (gradient_ready_offsets);
    ``any_ddp``: does some layer run ZeRO 0 or 1, where the caller knows."""
    p = ctx.p
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
    return excess
