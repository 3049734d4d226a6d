"""FSDP2 under a pipeline schedule: how often each sharded collective runs in a step.

torch.distributed.pipelining runs every backward of a stage but the last with gradient sync and
reshard-after-backward off (``_PipelineStageBase.backward_maybe_with_nosync``:
``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``), and reduces the
stage's gradients once, after its last backward (``perform_reduce_grad``, the schedule's
``REDUCE_GRAD`` action: ``post_backward`` of every parameter group, then a wait for the
reduce-scatters).  So per FSDP unit and step:

* ZeRO-2 (``reshard_after_forward=False``): one all-gather (the first forward; the parameters stay
  unsharded until the last backward) and one reduce-scatter;
* ZeRO-3: a forward reshards, a backward does not, so a pass gathers where a forward came before
  it on that unit (or nothing did): the first pass and every pass after a forward, m + 1 all-gathers
  in all -- in GPipe the m forwards and the first backward, in 1F1B the forwards and backwards
  that follow a forward -- and one reduce-scatter.

Counted on autopar's runtime (dp 2 x pp 2, 4 gloo ranks, per step on pipeline rank 0's three
units; tests/integration/test_collective_counts.py checks it on every schedule): ZeRO-2 3
all-gathers and 3 reduce-scatters for m = 2 and 4; ZeRO-3 with m = 4: GPipe 12 + 3 (forward +
backward), 1F1B 6 + 9, interleaved (v 2) 11 + 4 -- 15 = 3 (m + 1) each.

Without a pipeline, autopar's runtime accumulates over micro-batches with sharded gradients:
each micro-batch gathers and reduce-scatters (runtime/train.py ``_grad_sync``), what the layer
rows price (layer_cost.py).

The step model keeps its per-micro-batch form (overlap.py, compose.py): under a pipeline a
layer's gathers are spread over its m micro-batches as shares of the per-gather time
(``traffic_shares``), and its reduce-scatter leaves the micro-batches for the step's tail: the
first model chunk's reduce-scatters of each rank run after its last backward with nothing to hide
them (``tail_layers``; a later chunk's run during the first chunk's cool-down backwards, taken as
hidden).  Pure functions over numpy arrays or numbers.
"""
from __future__ import annotations

import numpy as np

from autopar.core.rules import zero_family_of


def collectives_per_step(zero: int, num_microbatches: int, pipelined: bool) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of one sharded unit per step (module docstring); a ZeRO
    stage below 2 has none (DDP's all-reduce is priced elsewhere)."""
    m = num_microbatches
    if zero_family_of(zero) != "fsdp":
        return 0, 0
    if not pipelined:
        return (2 if zero >= 3 else 1) * m, m
    return (m + 1 if zero >= 3 else 1), 1


def traffic_shares(zero, pipeline_m: int | None):
    """(forward gather, backward gather, reduce-scatter) per micro-batch, in units of one
    collective, for layers at ZeRO stage ``zero`` (an array or a number): without a pipeline
    (``pipeline_m`` None) one gather before forward (ZeRO-2, 3), one before backward (ZeRO-3) and
    one reduce-scatter; under a pipeline of ``pipeline_m`` micro-batches the step's gathers
    (``collectives_per_step``) spread over the micro-batches -- ZeRO-2 1/m before forward, ZeRO-3
    one before each forward and 1/m before backward -- and no reduce-scatter (the step's tail)."""
    zero2, zero3 = zero >= 2, zero >= 3
    if pipeline_m is None:
        return zero2 * 1.0, zero3 * 1.0, zero2 * 1.0
    once = 1.0 / pipeline_m
    fwd = np.where(zero3, 1.0, zero2 * once) if isinstance(zero, np.ndarray) else (1.0 if zero3 else zero2 * once)
    return fwd, zero3 * once, zero2 * 0.0


def tail_layers(layer_stage: np.ndarray, p: int) -> np.ndarray:
    """The layers whose reduce-scatters end a pipelined step: those of each rank's first model
    chunk (virtual stage < p)."""
    return layer_stage < p


def pipelined_tail(per_layer_tail: np.ndarray, layer_stage: np.ndarray, layer_rank: np.ndarray, p: int) -> np.ndarray:
    """Per pipeline rank: the reduce-scatters (and copies out) exposed after its last backward,
    the sum of ``per_layer_tail`` (dp_sync.last_reduce_scatter of every layer) over its first
    chunk's layers."""
    return np.bincount(layer_rank, weights=per_layer_tail * tail_layers(layer_stage, p), minlength=p)
