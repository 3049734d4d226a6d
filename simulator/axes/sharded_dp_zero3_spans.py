"""DeepSpeed ZeRO-3 of April 2021 priced fetch by fetch: every fetch drains the device.

What the code did (deepspeedai/DeepSpeed c4f4ef5d4, ``deepspeed/runtime/zero/stage3.py`` and
``partition_parameters.py``; the version the ZeRO-3 rows of Narayanan et al. 2021, Table 2 ran,
simulator/sharded_dp.py item 4):

* A forward pre-hook on every sub-module (and a pre-backward hook on its outputs) calls
  ``fetch_sub_module``.  Where the sub-module's own parameters are not yet gathered or are still
  in flight, it ends in ``_synchronize_communication``: a wait on every in-flight gather, then
  ``torch.cuda.synchronize()`` -- the device is drained before the sub-module's kernels are
  launched.  A sub-module whose parameters are already gathered (or that has none) drains
  nothing.
* After the fetch, ``prefetch_next_sub_modules`` gathers, if nothing is in flight, the next
  parameters in the recorded trace that are not gathered, up to ``prefetch_bucket_size`` elements
  (default 5e7, less than any weight of a 12288-wide block, so one weight).  So a sub-module's
  compute overlaps the gather of the next gathered sub-module only, and the span from one drain
  to the next takes the longer of the two: ``sum over spans of max(compute, communication)``,
  not the layer's ``max(sum of compute, sum of communication)`` that the step model prices for
  FSDP (compose.layer_effective_times).
* Each gather (``_allgather_param``) first allocates the whole parameter with ``torch.zeros``
  and calls ``torch.cuda.synchronize()`` before it launches the collective, on a drained device
  and before the sub-module's compute is launched: the zero fill (one write of the parameter's
  bytes) is exposed in every span that prefetches.  The gather is a ``torch.distributed.
  all_gather`` into a list of views, which ProcessGroupNCCL runs as one collective into a flat
  buffer and N copies out of it on the NCCL stream: a read and a write of the parameter's bytes
  after the collective, on the communication side of the span.
* Parameters below ``param_persistence_threshold`` elements (default 1e5: the norms and biases
  of such a block) stay gathered (``ds_persist``) and are never fetched.
* ``release_sub_module`` keeps a sub-module's parameters gathered when the trace uses them again
  within ``max_reuse_distance`` elements of other sub-modules' parameters (default 1e9,
  ``_keep_for_later`` / ``_distance_in_numel``).  Under activation recompute the backward of a
  block visits its sub-modules' recomputed forwards, then their backwards in reverse; the last
  one's parameters (0 elements between the two visits) are kept, an earlier one's when the
  elements of the visits between stay under the limit.
* Gradients are reduced on the reduction stream (ZeRO-3's ``overlap_comm`` defaults to true,
  ``ZERO3_OPTIMIZATION_OVERLAP_COMM_DEFAULT``), launched from the gradient hooks when the next
  gradient arrives (``reduce_independent_p_g_buckets_and_remove_grads``: a bucket of 5e8
  elements is reduced when the next gradient would overflow it; a larger one is reduced alone),
  so a sub-module's gradient is reduced in the span after its own, and drained at the next fetch
  with everything else.

Priced per layer from its ops in the captured graph (``layer_units``): the gathered units are the
ops whose parameters reach the persistence threshold, in forward order; a forward span runs from
one unit's op to the next, a backward span from the op after the previous unit to the unit's own
op; each span's share of the layer's forward or backward compute is its share of the layer's
FLOPs (the layer's priced times are split, not re-priced).  The layers around a layer are taken
to be like it (the trace runs the same units in the same order in every block), so the spans are
cyclic within the layer.

Not priced: the host work before each prefetch returns (a ``narrow`` per rank, N copy launches,
host-side but before the sub-module's compute is launched), which no measured figure of that
era's PyTorch on an A100 fixes; and the ring latency per call -- the rows price one (N-1) alpha
per layer and pass (docs/validation.md, "The ZeRO-3 rows priced fetch by fetch").
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: ``ZERO_OPTIMIZATION_PARAM_PERSISTENCE_THRESHOLD_DEFAULT`` at c4f4ef5d4: parameters below it
#: stay gathered
PERSISTENCE_THRESHOLD = 100_000
#: ``ZERO_OPTIMIZATION_MAX_REUSE_DISTANCE_DEFAULT`` at c4f4ef5d4, elements
MAX_REUSE_DISTANCE = 1_000_000_000


@dataclass(frozen=True)
class LayerUnits:
    """A layer's gathered sub-modules in forward order, and how its compute splits between the
    spans they start (module docstring)."""
    numel: np.ndarray          # elements gathered per unit
    fwd_share: np.ndarray      # share of the layer's forward compute from unit j's fetch to unit j+1's
    bwd_share: np.ndarray      # share of its backward compute from unit j's backward fetch to unit j-1's

    @property
    def param_share(self) -> np.ndarray:
        total = float(self.numel.sum())
        return self.numel / total if total > 0 else self.numel


def layer_units(ops, threshold: int = PERSISTENCE_THRESHOLD) -> LayerUnits | None:
    """The gathered units of a layer from its ops in forward order (``OpNode``s: ``param_numel``,
    ``fwd_flops``, ``bwd_flops``), or None when the layer has none or no FLOPs to split.

    Forward span j: unit j's op up to the next unit's; the ops before the first unit run after the
    previous layer's last unit (the layers around are like this one), so they join the last span.
    Backward span j: the ops after unit j-1 up to unit j's op (their backwards run from unit j's
    backward fetch to unit j-1's); the ops after the last unit join the last span."""
    ops = list(ops)
    starts = [i for i, op in enumerate(ops) if op.param_numel >= threshold]
    if not starts:
        return None
    n = len(starts)
    fwd = np.array([op.fwd_flops for op in ops], dtype=float)
    bwd = np.array([op.bwd_flops for op in ops], dtype=float)
    if fwd.sum() <= 0 or bwd.sum() <= 0:
        return None
    fwd_share = np.empty(n)
    bwd_share = np.empty(n)
    for j, s in enumerate(starts):
        end = starts[j + 1] if j + 1 < n else len(ops)
        fwd_share[j] = fwd[s:end].sum()
        lo = starts[j - 1] + 1 if j > 0 else 0
        hi = s + 1 if j + 1 < n else len(ops)
        bwd_share[j] = bwd[lo:hi].sum()
    fwd_share[-1] += fwd[:starts[0]].sum()
    numel = np.array([ops[s].param_numel for s in starts], dtype=float)
    return LayerUnits(numel=numel, fwd_share=fwd_share / fwd.sum(), bwd_share=bwd_share / bwd.sum())


def kept_for_backward(numel: np.ndarray, max_reuse: float = MAX_REUSE_DISTANCE) -> np.ndarray:
    """Which units stay gathered from their recomputed forward to their backward: the elements of
    the visits between (the later units' recomputed forwards and backwards) under ``max_reuse``."""
    later = np.concatenate([np.cumsum(numel[::-1])[::-1][1:], [0.0]])   # elements of units after j
    return 2.0 * later < max_reuse


def drained_spans_s(compute, gather, zero_fill, reduce, slowdown: float) -> float:
    """Seconds for a cyclic sequence of visits (one layer's, its neighbours alike) when every visit
    with ``gather > 0`` drains the device and then prefetches the next such visit's gather.

    Per visit: ``compute``; ``gather``, the visit's own parameters' collective and copy-out (0:
    already gathered, no drain); ``zero_fill``, exposed before the prefetch of this visit's
    parameters; ``reduce``, the visit's gradient reduction, which runs in the span after the one
    the visit ends.  A span runs from one draining visit to the next: its zero fill, then
    max(compute + slowdown * overlapped, communication) with the communication the next
    draining visit's gather and the reductions launched in the span before (sharded_dp item 2's
    overlap slowdown on the overlapped part)."""
    compute, gather = np.asarray(compute, float), np.asarray(gather, float)
    zero_fill, reduce = np.asarray(zero_fill, float), np.asarray(reduce, float)
    drains = np.flatnonzero(gather > 0)
    if len(drains) == 0:
        return float(compute.sum())
    # the sequence is cyclic: start it at the first drain, so that span k runs from drains[k] to
    # drains[k + 1] (the last to the end) and the visits before the first drain close the last span
    first = drains[0]
    compute, gather, zero_fill, reduce = (np.roll(a, -first) for a in (compute, gather, zero_fill, reduce))
    drains = drains - first
    c = np.add.reduceat(compute, drains)
    nxt = np.roll(drains, -1)                                    # the draining visit each span prefetches
    comm = gather[nxt] + np.roll(np.add.reduceat(reduce, drains), 1)   # + the reductions of the span before
    return float((zero_fill[nxt] + np.maximum(c + slowdown * np.minimum(c, comm), comm)).sum())


def layer_pass_times(units: LayerUnits, fwd_s: float, recompute_s: float, bwd_s: float, gather_s: float,
                     reduce_s: float, copy_pass_s: float, slowdown: float, recomputed: bool) -> tuple[float, float, float]:
    """(forward, recompute + backward, communication in recompute + backward) of one layer per
    micro-batch, priced fetch by fetch.

    ``gather_s`` / ``reduce_s``: the layer's whole all-gather and gradient reduction, split between
    units by their elements; ``copy_pass_s``: one pass over the layer's unsharded parameters at
    memory speed (the zero fill is one, the copy-out two).  ``recomputed``: the backward visits
    the units' recomputed forwards first (module docstring)."""
    share = units.param_share
    g = gather_s * share + 2.0 * copy_pass_s * share
    zf = copy_pass_s * share
    fwd = drained_spans_s(fwd_s * units.fwd_share, g, zf, np.zeros_like(g), slowdown)
    back_c = bwd_s * units.bwd_share[::-1]                       # backwards: last unit first
    kept = kept_for_backward(units.numel) if recomputed else np.zeros(len(share), dtype=bool)
    back_g = np.where(kept, 0.0, g)[::-1]
    back_zf = np.where(kept, 0.0, zf)[::-1]
    back_r = (reduce_s * share)[::-1]
    if recomputed:
        c = np.concatenate([recompute_s * units.fwd_share, back_c])
        gg = np.concatenate([g, back_g])
        z = np.concatenate([zf, back_zf])
        r = np.concatenate([np.zeros_like(g), back_r])
    else:
        c, gg, z, r = back_c, back_g, back_zf, back_r
    bwd = drained_spans_s(c, gg, z, r, slowdown)
    return fwd, bwd, float(gg.sum() + r.sum())
