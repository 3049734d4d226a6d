"""The split-backward pipeline schedules: interleaved zero bubble, ZB-V and DualPipeV, in closed form.

Each splits a model chunk's backward into B, the gradient of its input, and W, the gradient of
its weights (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR 2024, Sec. 2): B is what
the previous stage waits for, W can run later, in what would be a bubble.  Per micro-batch and
chunk: F (forward), B (backward input: the backward less its weight gradients, with recompute and
the backward's tensor-parallel collectives) and W (``LayerCost.bwd_weight_s``, the GEMMs'
weight-gradient half: step/op_work.WEIGHT_GRAD_SHARE).  A rank's work is m sum_chunks (F + B + W);
the step adds a bubble per pipeline boundary, (p - 1) X over the p ranks (for unequal ranks
sum_r X_r - max_r X_r, as ``pp.interleaved_time`` spreads the interleaved bubble):

* interleaved zero bubble (torch's ``ScheduleInterleavedZeroBubble``, ZB1P: ZB-H1 of Qi et al.
  Sec. 2.1 over looped chunks): X = max(F, B, F + B - W).  ZB-H1's bubble is (p - 1)(F + B - W)
  (Qi et al. Sec. 2.1, W filling a third of 1F1B's (p - 1)(F + B + W)); it cannot drop below the
  fill's chain of p - 1 forwards nor the drain's chain of p - 1 input backwards, which W cannot
  fill -- hence the max.  Equal chunks, any m a multiple of p and any v: the schedule torch
  builds, played action by action, has exactly this length
  (tests/simulator/test_zero_bubble_pricing.py draws it by hand);
* ZB-V (torch's ``ScheduleZBVZeroBubble``, Qi et al. Sec. 6: two chunks per rank in a V): the
  same X with m >= 2p (its steady state: torch warms up max(2p - 1, m) micro-batches of chunk 0
  and drops the extra ones, so below 2p the V is cut short; there the 1F1B chunk bubble
  X = F + B + W is charged, the longest torch's truncated schedule was seen to run);
  exact for F = B = W, the case Qi et al. design ZB-V for (torch's docstring: zero bubble "only
  if time forward == time backward input == time backward weights");
* DualPipeV (torch's ``ScheduleDualPipeV``; DeepSeek-AI 2024, "DeepSeek-V3 Technical Report",
  Sec. 3.2.1 and Table 2, DualPipe's bubble (PP/2 - 1)(F&B + B - 3W) with B the full backward;
  the V form runs PP = 2p chunks on p ranks, so (p - 1)(F&B + B_full - 3W) = (p - 1)(F&B + B - 2W)
  in B = input gradient terms): torch pairs a forward of one chunk with a full backward of the
  other (``OVERLAP_F_B``) 2m - 3p + 1 times on rank 0 (its main step m - 2p + 1 rounds of two
  pairs, then p - 1 pairs: the rank with the fewest pairs), each costing F&B instead of
  F + B + W.  F&B (``overlapped_pair``): DeepSeek overlaps the forward chunk's compute with the
  backward chunk's communication (the MoE all-to-all dispatch and combine) and the other way
  round (the report's Fig. 4), so F&B = max(compute of both, all-to-all of both).  torch 2.13
  runs the pair's two actions one after the other unless a function is registered for
  OVERLAP_F_B; autopar's runtime registers one where ep > 1 (runtime/dualpipe_overlap.py: the two
  passes in turns, each all-to-all in flight while the other pass computes, in Fig. 4's order),
  and the step prices those pairs with F&B = max(compute, all-to-all)
  (``overlap_a2a``, axes/pp.expert_all_to_all_times); without ep a pair costs F + B + W.  A pair
  joins the forward of one of the rank's chunks and the backward of the other, so with overlap
  each of the two kinds is priced with its own chunks' terms.  Max(compute, all-to-all) is the
  pair's length when each all-to-all is no longer than the other pass's compute it runs beside
  (or the other way round throughout): the report's Fig. 4 balance.  For equal chunks with
  F = B = W and F&B from 3F (no overlap) down to 2F, the schedule torch builds for pp 2 and 4
  micro-batches, played action by action with such pairs, has exactly the published length
  (tests/simulator/test_zero_bubble_pricing.py draws it); for unequal F, B, W it differs from it
  by up to a pass either way (F 1, B 2, W 1: drawn 35, priced 36; F 2, B 1, W 1: drawn 36,
  priced 35).

The activation sends of the fill and drain are charged as for the other schedules
(``pp.pipeline_time``: 2 (p v - 1) sends).
"""
from __future__ import annotations

import numpy as np

from autopar.core.rules import V_SCHEDULES


#: the part of the interleaved 1F1B chunk bubble (p - 1)(F + B + W) each schedule keeps when a
#: chunk's backward is 2F, half of it the weight gradients (B = W = F: a transformer's backward is
#: its linears' dgrad and wgrad GEMMs, each as long as the forward GEMM) -- Qi et al. 2024 Sec. 2.1:
#: ZB-H1's bubble is a third of 1F1B's, max(F, B, F + B - W) = F of 3F; DualPipeV's
#: F&B + B - 2W = 2F of 3F.  For the planner's screen, which knows whole backward passes only.
SCREEN_BUBBLE_SHARE = {"interleaved-zb": 1.0 / 3.0, "zbv": 1.0 / 3.0, "dualpipev": 2.0 / 3.0}


def screen_bubble_share(schedule: str) -> float:
    return SCREEN_BUBBLE_SHARE.get(schedule, 1.0)


def rank_chunk_sums(chunk: np.ndarray, schedule: str, p: int) -> np.ndarray:
    """Per pipeline rank, the sum of its chunks' values ``chunk`` (one per virtual stage)."""
    v = len(chunk) // p
    return np.asarray(chunk)[stage_grid(schedule, p, v)].sum(axis=0)


def stage_grid(schedule: str, p: int, v: int) -> np.ndarray:
    """(v, p) array: the virtual stage that rank r runs as its chunk c -- c p + r when looped,
    and for the V schedules r on the way down, 2p - 1 - r on the way back (core/rules.stage_rank)."""
    grid = np.arange(v * p).reshape(v, p)
    if schedule in V_SCHEDULES and v == 2:
        grid[1] = grid[1][::-1]
    return grid


def boundary_bubble(f: np.ndarray, b: np.ndarray, w: np.ndarray) -> np.ndarray:
    """X per chunk of the zero-bubble schedules, max(F, B, F + B - W) (module docstring)."""
    return np.maximum(np.maximum(f, b), f + b - w)


def overlapped_pair(f: float, b: float, w: float, a2a_f: float = 0.0, a2a_b: float = 0.0,
                    overlap_a2a: bool = False) -> float:
    """F&B: one chunk's forward ``f`` paired with another's full backward ``b + w``; ``a2a_f``,
    ``a2a_b``: the expert-parallel all-to-all time inside ``f`` and ``b``.  With ``overlap_a2a``
    (DeepSeek-V3 report Sec. 3.2.1 and Fig. 4: each chunk's all-to-all hidden behind the other's
    compute) max(compute of both, all-to-all of both), else the two one after the other."""
    if not overlap_a2a:
        return f + b + w
    return max(f + b + w - a2a_f - a2a_b, a2a_f + a2a_b)


def dualpipev_pairs(m: int, p: int) -> int:
    """Forward-backward pairs torch's ScheduleDualPipeV runs on pp rank 0 (the fewest of any rank)."""
    return max(0, 2 * m - 3 * p + 1)


def dualpipev_time(f: float, b: float, w: float, m: int, p: int, a2a_f: float = 0.0, a2a_b: float = 0.0,
                   overlap_a2a: bool = False) -> float:
    """DualPipeV's step (without the sends) for equal chunks: F ``f``, B ``b`` (input gradient),
    W ``w`` per chunk and micro-batch, ``a2a_f`` / ``a2a_b`` the all-to-all inside f / b:
    rank 0's work 2m (F + B + W) - pairs (F + B + W - F&B) plus the published bubble
    (p - 1)(F&B + B - 2W) (module docstring)."""
    fb = overlapped_pair(f, b, w, a2a_f, a2a_b, overlap_a2a)
    work = 2 * m * (f + b + w) - dualpipev_pairs(m, p) * (f + b + w - fb)
    return work + max(0.0, (p - 1) * (fb + b - 2 * w))


def split_backward_time(schedule: str, f_vp: np.ndarray, b_vp: np.ndarray, w_vp: np.ndarray, m: int,
                        overlap_a2a: bool = False, a2a_f_vp: np.ndarray | None = None,
                        a2a_b_vp: np.ndarray | None = None) -> float:
    """The split-backward schedule's length without sends, from (v, p) arrays of per-chunk F, B
    (input gradient) and W per micro-batch (``stage_grid`` order): m max_r (rank's work) plus the
    boundary bubble sum_r X_r - max_r X_r (module docstring); DualPipeV with its pairs."""
    v, p = f_vp.shape
    t_r = (f_vp + b_vp + w_vp).sum(axis=0)
    if schedule == "dualpipev":
        a_f = np.zeros_like(f_vp) if a2a_f_vp is None else a2a_f_vp
        a_b = np.zeros_like(b_vp) if a2a_b_vp is None else a2a_b_vp
        # a pair joins the forward of one chunk c and the backward of the rank's other chunk
        # (V: v = 2), the two kinds in turn: each saves F + B + W - F&B of its own terms
        o = [(c + 1) % v for c in range(v)]
        pair = np.array([[overlapped_pair(f_vp[c, r], b_vp[o[c], r], w_vp[o[c], r], a_f[c, r], a_b[o[c], r],
                                          overlap_a2a) for r in range(p)] for c in range(v)])
        saving = (f_vp + b_vp[o] + w_vp[o] - pair).mean(axis=0)
        work = m * t_r - dualpipev_pairs(m, p) * saving
        # the published bubble per chunk, F&B of the chunk's own terms (equal chunks: the same)
        fb = np.array([[overlapped_pair(f_vp[c, r], b_vp[c, r], w_vp[c, r], a_f[c, r], a_b[c, r], overlap_a2a)
                        for r in range(p)] for c in range(v)])
        x_r = np.maximum(0.0, fb + b_vp - 2 * w_vp).max(axis=0)
        return float(work.max() + x_r.sum() - x_r.max())
    if schedule == "zbv" and m < 2 * p:
        x_r = (f_vp + b_vp + w_vp).max(axis=0)
    else:
        x_r = boundary_bubble(f_vp, b_vp, w_vp).max(axis=0)
    return float(m * t_r.max() + x_r.sum() - x_r.max())


def inflight_chunks(schedule: str, p: int, r: int, m: int, v: int) -> int:
    """Model chunks' micro-batch activations rank ``r`` holds at peak (a chunk holds 1/v of the
    rank's layers): interleaved zero bubble warms up as interleaved 1F1B does (torch builds its
    order from the same warm-up, ``_get_warmup_ops``), 2(p - r - 1) + (v - 1) p + 1 chunks
    (memory.inflight_microbatches); ZB-V keeps 1F1B's peak, 2p chunks of half a stage on every
    rank (Qi et al. 2024 Sec. 6: "the same peak memory as 1F1B", the V balancing the ranks);
    DualPipeV PP + 1 = 2p + 1 chunks (DeepSeek-V3 report Table 2, activation per device PP + 1
    of PP chunks)."""
    if schedule == "interleaved-zb":
        if v == 1:                 # ZB-H1 keeps 1F1B's peak (Qi et al. 2024 Sec. 2.1)
            return min(p - r, m)
        return min(2 * (p - r - 1) + (v - 1) * p + 1, m * v)
    if schedule == "zbv":
        return min(2 * p, m * v)
    return min(2 * p + 1, m * v)           # dualpipev
