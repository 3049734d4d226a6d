"""Context parallelism's costs, per attention layer and per rank: the K/V exchange, the causal
load balance of the sequence split, and the activations it divides.

Not yet wired into ``layer_cost.compute_layer_cost``: the planner's ``cp`` rule admits degree 1
only (planner/space.py) until it is, so no plan is priced without these terms.

Sources:

* All-gather of K/V (Dubey et al. 2024, "The Llama 3 Herd of Models", Sec. 3.3.2 "Context
  parallelism"): each rank gathers every rank's K and V before attention and computes its
  local queries against the whole sequence; the gather is *not* overlapped with attention --
  Llama 3 accepts it because K/V (with GQA, few heads) are small next to the O(S^2) attention.
  Its backward reduce-scatters dK and dV the same way.  This is what runtime/apply_cp.py runs.
* Ring attention (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers",
  Sec. 3): cp - 1 steps, each passing one rank's K/V block to the next rank while the current
  block's attention runs; a step's exchange hides behind the step's compute when the compute
  is at least as long (their overlap condition), otherwise the difference shows.
* Load balance: a contiguous split of a causal sequence gives rank i the queries of chunk i,
  which see (i + 1/2) chunks of keys on average: the last rank does (2 cp - 1) / cp times the
  mean work.  The head-tail split (rank i holds chunks i and 2 cp - 1 - i of 2 cp) gives every
  rank the same number of (query, key) pairs -- ``causal_pairs`` counts them exactly.  torch's
  ``context_parallel`` and torchtitan's CP use the head-tail order (torchtitan's CP write-up,
  "Breaking Barriers: Training Long Context LLMs with 1M Sequence Length in PyTorch Using
  Context Parallel", PyTorch forums 2025).
* Ring collectives' wire bytes: Patarasuk & Yuan 2009 (``layer_cost.ring_wire_bytes``).
"""
from __future__ import annotations

from dataclasses import dataclass


def head_tail_chunks(cp: int, rank: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def causal_pairs(seq: int, cp: int, rank: int, layout: str = "head_tail") -> int:
    """(query, key) pairs rank ``rank`` computes under a causal mask (a query at position p
    sees p + 1 keys): ``"head_tail"`` (chunks i and 2cp-1-i of 2cp) or ``"contiguous"``."""
    if layout == "contiguous":
        c = seq // cp
        starts = [rank * c]
    else:
        c = seq // (2 * cp)
        starts = [j * c for j in head_tail_chunks(cp, rank)]
    # sum over p in [s, s + c) of (p + 1)
    return sum(c * s + c * (c + 1) // 2 for s in starts)


def load_imbalance(seq: int, cp: int, layout: str = "head_tail") -> float:
    """The busiest rank's attention work over the mean: the factor the slowest rank stretches
    the attention by (the ranks meet at the next collective)."""
    work = [causal_pairs(seq, cp, r, layout) for r in range(cp)]
    return max(work) * cp / sum(work)


@dataclass(frozen=True)
class CPAttentionCost:
    """One attention layer on one rank, one micro-batch, forward and backward."""
    exchange_fwd_s: float        # exposed K/V exchange in forward
    exchange_bwd_s: float        # exposed dK/dV exchange in backward
    wire_bytes: float            # bytes this rank sends, forward + backward
    kv_buffer_bytes: float       # K/V of other ranks held during attention (transient)


def kv_bytes(micro_batch: int, seq: int, kv_heads: int, head_dim: int, elem_bytes: int) -> float:
    """K and V of the whole sequence for one layer: 2 x B x S x kv_heads x head_dim elements."""
    return 2.0 * micro_batch * seq * kv_heads * head_dim * elem_bytes


def cp_attention_cost(*, micro_batch: int, seq: int, kv_heads: int, head_dim: int, elem_bytes: int, cp: int,
                      attention_fwd_s: float, attention_bwd_s: float, bandwidth_Bps: float, latency_s: float,
                      method: str = "all_gather") -> CPAttentionCost:
    """The exposed K/V exchange of one attention layer.

    ``attention_fwd_s`` / ``attention_bwd_s``: this rank's attention compute (its 1/cp share of
    the whole sequence's, balanced); ``bandwidth_Bps`` / ``latency_s``: the cp group's link.
    ``all_gather`` (Llama 3): the ring all-gather of (cp - 1) / cp of the K/V bytes, cp - 1
    latency steps, exposed; the backward reduce-scatter of dK/dV likewise.  ``ring`` (Liu et
    al.): cp - 1 steps of one rank's block (1 / cp of K/V), each hidden behind 1 / cp of the
    attention compute, only the excess exposed (the backward passes dK/dV blocks as well as
    K/V: twice the bytes per step, against the backward's compute).
    """
    if cp == 1:
        return CPAttentionCost(0.0, 0.0, 0.0, 0.0)
    full = kv_bytes(micro_batch, seq, kv_heads, head_dim, elem_bytes)
    block = full / cp
    steps = cp - 1
    if method == "all_gather":
        wire = steps * block                     # = (cp - 1) / cp x full: ring all-gather / reduce-scatter
        t = wire / bandwidth_Bps + steps * latency_s
        return CPAttentionCost(exchange_fwd_s=t, exchange_bwd_s=t, wire_bytes=2 * wire,
                               kv_buffer_bytes=steps * block)
    if method == "ring":
        step_fwd = block / bandwidth_Bps + latency_s
        step_bwd = 2 * block / bandwidth_Bps + latency_s
        fwd = steps * max(0.0, step_fwd - attention_fwd_s / cp)
        bwd = steps * max(0.0, step_bwd - attention_bwd_s / cp)
        # two blocks in flight: the one computed on and the one arriving
        return CPAttentionCost(exchange_fwd_s=fwd, exchange_bwd_s=bwd, wire_bytes=3 * steps * block,
                               kv_buffer_bytes=2 * block)
    raise ValueError(f"method {method!r}: 'all_gather' or 'ring'")


def activation_bytes_per_rank(activation_bytes: float, cp: int) -> float:
    """Activations kept for backward: every op's saved tensors are per token, and each rank
    holds 1/cp of the tokens (the gathered K/V are a transient, ``kv_buffer_bytes``; the
    attention's saved statistics are per local query)."""
    return activation_bytes / cp
