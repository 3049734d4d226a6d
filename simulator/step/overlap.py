"""What a layer's FSDP traffic and compute are per micro-batch, before they overlap.

The parts every composition of the step reads (step/compose.py: the step model's
layer_effective_times, the planner's folded_layer_time and layer_floor): the layer's compute per pass
(forward, and recompute + backward, each with its tensor-parallel collectives, which sit on the
critical path: Shoeybi et al. 2019, Sec. 3) runs beside the data-parallel stream's traffic --
FSDP's parameter all-gather and the offloaded parameters' copy in before forward, ZeRO-3's second
all-gather before backward, the gradient reduce-scatter and the copy out after it (Zhao et al.
2023, "PyTorch FSDP", Sec. 3.3) -- and the longer of the two sets the pace.

The functions take numpy arrays (one entry per layer) or plain numbers alike.
"""
from __future__ import annotations

from autopar.simulator.axes.pp_fsdp import traffic_shares
from autopar.simulator.step.term_registry import pass_columns, traffic_terms


def fsdp_traffic(src, zero, offload, pipeline_m: int | None = None):
    """(forward communication, backward gather, backward communication) of a layer per micro-batch:
    the sums of the registered "traffic" terms' parts (term_registry.traffic_terms; built in:
    ``fsdp_parts``, then axes/offload.offload_parts), read from ``src`` by column name (a LayerTable, a
    LayerCost, term_registry.with_term_columns).

    ``zero``: the ZeRO stage that runs; ``offload``: 1 (or True) when the layer's state lives on
    the host.  The backward gather (ZeRO-3 re-gathers the parameters it freed after forward) is
    part of the backward communication and also returned alone: nothing precedes it at the start
    of a model chunk's backward.  (``zero >= k`` and ``offload`` are 0 or 1, so each part's
    product by them is exact: the sums are the same bits as one product of the sums.)
    ``pipeline_m``: the micro-batches of a pipeline schedule, None without one (pipeline_fsdp.py:
    a pipeline gathers and reduce-scatters per step, not per micro-batch).
    """
    fwd = None
    for term in traffic_terms():
        parts = term.traffic(src, zero, offload, pipeline_m)
        if parts is None:
            continue
        if fwd is None:
            fwd, gather, after = parts
        else:
            fwd, gather, after = fwd + parts[0], gather + parts[1], after + parts[2]
    return fwd, gather, gather + after


def fsdp_parts(src, zero, offload, pipeline_m: int | None = None):
    """FSDP's part of a layer's traffic per micro-batch: (the parameter all-gather before forward,
    ZeRO-3's second one before backward, the gradient reduce-scatter after backward); under a
    pipeline the step's gathers spread over its micro-batches and no reduce-scatter
    (pipeline_fsdp.traffic_shares)."""
    ag = src.dp_allgather_s
    if pipeline_m is None:
        zero2 = zero >= 2
        return ag * zero2, ag * (zero >= 3), src.dp_reducescatter_s * zero2
    fwd, bwd, rs = traffic_shares(zero, pipeline_m)
    return ag * fwd, ag * bwd, src.dp_reducescatter_s * rs


def _column_sum(src, cols):
    out = getattr(src, cols[0])
    for c in cols[1:]:
        out = out + getattr(src, c)
    return out


def collectives_per_pass(src):
    """(forward, backward) in-layer collectives of a layer per micro-batch: the sum of the columns
    the registered ``collective`` "compute" terms add to each pass (built in: tp, cp, ep --
    Megatron's f/g, the K/V exchange, the experts' all-to-alls), read from ``src`` by name;
    0.0 where no such term is registered."""
    (_, fwd_cols), (_, bwd_cols) = pass_columns()
    return (_column_sum(src, fwd_cols) if fwd_cols else 0.0, _column_sum(src, bwd_cols) if bwd_cols else 0.0)


def compute_per_pass(src):
    """(forward, backward) compute of a layer per micro-batch: the sum of the columns the
    registered "compute" terms add to each pass (term_registry.py), read from ``src`` by name (a
    LayerTable, a LayerCost, term_registry.with_term_columns): those on the compute stream, plus
    the in-layer collectives (``collectives_per_pass``).  The built-in ones: forward plus its
    tensor-parallel, context-parallel and expert-parallel collectives; recompute (a recomputed
    forward runs inside backward), backward, plus its collectives -- summed in that order."""
    (fwd_own, fwd_coll), (bwd_own, bwd_coll) = pass_columns()
    fwd = _column_sum(src, fwd_own)
    if fwd_coll:
        fwd = fwd + _column_sum(src, fwd_coll)
    bwd = _column_sum(src, bwd_own)
    if bwd_coll:
        bwd = bwd + _column_sum(src, bwd_coll)
    return fwd, bwd
