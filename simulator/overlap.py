"""What a layer's FSDP traffic and compute are per micro-batch, before they overlap.

One place for the rule both the step model (evaluator.layer_effective_times) and the planner's
per-layer tables (planner/layer_tables.fold_layer_cost) apply: the layer's compute per pass
(forward, and recompute + backward, each with its tensor-parallel collectives, which sit on the
critical path: Shoeybi et al. 2019, Sec. 3) runs beside the data-parallel stream's traffic --
FSDP's parameter all-gather and the offloaded parameters' copy in before forward, ZeRO-3's second
all-gather before backward, the gradient reduce-scatter and the copy out after it (Zhao et al.
2023, "PyTorch FSDP", Sec. 3.3) -- and the longer of the two sets the pace.

The functions take numpy arrays (one entry per layer) or plain numbers alike.
"""
from __future__ import annotations

import numpy as np

from autopar.simulator.term_registry import pass_columns


def fsdp_traffic(allgather_s, reducescatter_s, h2d_s, d2h_s, zero, offload):
    """(forward communication, backward gather, backward communication) of a layer per micro-batch.

    ``zero``: the ZeRO stage that runs; ``offload``: 1 (or True) when the layer's state lives on
    the host.  The backward gather (ZeRO-3 re-gathers the parameters it freed after forward) is
    part of the backward communication and also returned alone: nothing precedes it at the start
    of a model chunk's backward.
    """
    zero2 = zero >= 2
    if not np.count_nonzero(offload):
        # nothing on the host: the same terms without the (zero) copies, in fewer operations
        bwd_gather = allgather_s * (zero >= 3)
        return allgather_s * zero2, bwd_gather, bwd_gather + reducescatter_s * zero2
    h2d = h2d_s * offload
    fwd_comm = allgather_s * zero2 + h2d
    bwd_gather = (allgather_s + h2d) * (zero >= 3)
    bwd_comm = bwd_gather + (reducescatter_s + d2h_s * offload) * zero2
    return fwd_comm, bwd_gather, bwd_comm


def compute_per_pass(src):
    """(forward, backward) compute of a layer per micro-batch: the sum of the columns the
    registered "compute" terms add to each pass (term_registry.py), read from ``src`` by name (a
    LayerTable, a LayerCost, term_registry.with_term_columns).  The built-in ones: forward plus
    its tensor-parallel collectives; recompute (a recomputed forward runs inside backward),
    backward and its collectives -- summed in that order."""
    fwd_cols, bwd_cols = pass_columns()
    fwd = getattr(src, fwd_cols[0])
    for c in fwd_cols[1:]:
        fwd = fwd + getattr(src, c)
    bwd = getattr(src, bwd_cols[0])
    for c in bwd_cols[1:]:
        bwd = bwd + getattr(src, c)
    return fwd, bwd
