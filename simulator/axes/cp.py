"""Context parallelism's costs, per attention layer and per rank: the K/V exchange, the causal
load balance of the sequence split, and the activations it divides.

``layer_cost.compute_layer_cost`` prices a layer on a cp rank with ``cp_layer_terms``: every op
on 1/cp of the tokens (its micro-batch scale divided by cp), each attention op run as the
runtime runs it (``cp_attention_op``), the K/V all-gather and the dK/dV reduce-scatter of
each attention op in the layer's ``cp_comm_*`` columns (on the critical path, as the
tensor-parallel collectives), and what the gather adds to the activations kept for
backward.  ``cp_attention_cost`` is the same exchange in closed form (alpha-beta, for the
tests and the ring variant).

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
* Ring collectives' wire bytes: Patarasuk & Yuan 2009 (``device/network.ring_wire_bytes``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.core.sharding import TPLayout
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.axes.tp import fold_into_tp


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


# ----------------------------------------------------------------------- wired into layer_cost
def cp_attention_op(op, how: str = "explicit_mask"):
    """The attention op as a cp rank runs it: its S/cp queries against all S gathered keys.
    ``how`` (``TrainingCode.cp_attention``): "explicit_mask" -- code that passes the head-tail
    causal mask as an explicit ``attn_mask`` (autopar's runtime before 2026-11-26),
    and a kernel given a mask computes every (query, key) pair of the S/cp x S block (no flash
    kernel skips the masked half of an arbitrary mask), so a causal op is priced as the full
    square (``causal=False``; the graph's FLOPs are the full square already, core/op_costs.py);
    "causal_blocks" -- the rank computes only its causal pairs, half the block with the head-tail
    split (``causal_pairs``), priced as the causal kernel; autopar's runtime
    (runtime/apply_cp.CPAttention._causal_blocks) runs each query chunk against its key prefix
    with a lower-right causal mask.  Its one reorder of the gathered K/V into sequence order (a
    copy of the gather's message, at memory bandwidth against the gather's link bandwidth) is
    left out.  Its FLOPs on the rank are 1/cp of the
    whole sequence's, the micro-batch scale divided by cp in layer_cost."""
    if how == "explicit_mask" and getattr(op, "causal", False):
        return replace(op, causal=False)
    return op


@dataclass(frozen=True)
class CPLayerTerms:
    """One layer on one cp rank, one micro-batch: its attention ops' K/V exchange and the
    activations the exchange adds."""
    fwd_s: float = 0.0           # the K/V all-gathers (exposed: not overlapped, Llama 3 Sec. 3.3.2)
    bwd_s: float = 0.0           # the dK/dV reduce-scatters
    wire_fwd: float = 0.0        # bytes this rank sends for them
    wire_bwd: float = 0.0
    meetings: int = 0            # collectives in forward (the ranks meet at each)
    saved_bytes: float = 0.0     # kept for backward beyond the rank's own K/V: the gathered K/V, the mask
    measured: int = 0
    estimated: int = 0


def cp_layer_terms(attention_ops, cp: int, local_scale: float, elem_bytes: float, cm, link,
                   processes: int | None = None, how: str = "explicit_mask", shard=None) -> CPLayerTerms:
    """The K/V exchange of a layer's attention ops on a cp rank (runtime/apply_cp.py).

    Per attention op, with K and V as SDPA receives them ([B, heads, S, d]; the graph's shapes
    are the whole sequence at the captured batch, ``local_scale`` = micro-batch / captured batch
    / cp turns them into the rank's share; ``shard``: op name -> the tensor-parallel split of the
    op's heads, which divides its K and V too):

    * forward: one all-gather of the rank's K and V, concatenated into one message (the runtime
      gathers them together), over the cp group's ``link`` -- a message of cp x the rank's K/V;
    * backward: its autograd reduce-scatter of dK/dV, the same message;
    * kept for backward: SDPA saves the gathered K and V (the whole sequence; the graph counts the
      rank's own 1/cp share already, so (cp - 1) x it more) and the mask it was given -- an
      [S/cp, S] tensor, converted from bool to the query's dtype before the kernel
      (aten/src/ATen/native/transformers/attention.cpp, ``convert_boolean_attn_mask``), which
      the memory-efficient kernel's backward reads again (its ``attn_bias`` input) -- where the
      code passes one (``how`` = "explicit_mask", ``cp_attention_op``).
    """
    if cp <= 1:
        return CPLayerTerms()
    fwd = bwd = wire = saved = 0.0
    n = measured = estimated = 0
    for op in attention_ops:
        if len(op.input_shapes) < 3:
            continue
        q, k, v = op.input_shapes[:3]
        heads_split = shard.get(op.name, 1) if shard else 1
        local_kv = (_numel(k) + _numel(v)) * local_scale * elem_bytes / heads_split
        message = cp * local_kv
        t_f, m_f = cm.collective_time_ex("all_gather", message, cp, link.link, link.level, processes=processes)
        t_b, m_b = cm.collective_time_ex("reduce_scatter", message, cp, link.link, link.level, processes=processes)
        fwd += t_f
        bwd += t_b
        wire += (cp - 1) * local_kv                 # (cp - 1) / cp of the message: ring_wire_bytes
        seq = q[-2] if len(q) >= 2 else 0
        saved += (cp - 1) * local_kv + ((seq / cp) * seq * elem_bytes if how == "explicit_mask" else 0.0)
        n += 1
        measured += m_f + m_b
        estimated += (not m_f) + (not m_b)
    return CPLayerTerms(fwd, bwd, wire, wire, n, saved, measured, estimated)


def _numel(shape) -> float:
    out = 1.0
    for d in shape:
        out *= d
    return out


def cp_layer_work(attention_ops: list, w: "OpWork", tpc: "TensorParallelComm", layout: TPLayout, cp: int,
                  scale: float, elem: float, cm: CostModel, cp_link, node_processes: int | None) -> CPLayerTerms:
    """Context parallelism's in-layer terms (``cp_layer_terms``), returned (the layer's
    ``cp_comm_*`` columns: step/layer_cost.py) and folded into ``w`` and ``tpc`` (step/op_work.py's
    ``OpWork``, tp.py's ``TensorParallelComm``): the K/V all-gather / reduce-scatter of the
    attention ops are collectives on the critical path inside the layer, which a full recompute
    reruns as it does the tensor-parallel ones (tp.fold_into_tp); a selective recompute reruns the
    K/V gather under every policy; the gathered K/V add to what attention keeps for backward.
    Its ``meetings``: the collectives where the ranks meet."""
    c = cp_layer_terms(attention_ops, cp, scale, elem, cm, cp_link, node_processes, cm.code.cp_attention,
                       layout.compute_shard)
    fold_into_tp(tpc, c)
    tpc.selective_fwd_s += c.fwd_s
    tpc.selective_wire += c.wire_fwd
    tpc.selective_meetings += c.meetings
    w.saved_bytes += c.saved_bytes
    return c
