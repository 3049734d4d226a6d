"""The split-backward schedules' step model (simulator/pipeline_zero_bubble.py) against schedules
drawn by hand.

Each case lists, per pp rank, the order of its actions as torch 2.13 builds them for pp 2,
4 micro-batches ("3F0": stage 3 forward of micro-batch 0; I: input gradient; W: weight
gradient; B: the whole backward; "(0F3;3B1)": DualPipeV's pair of a forward and a backward).
``_play`` runs them: an action starts when its rank is free and its inputs are done (a forward
after the previous stage's forward of the micro-batch, an input gradient after the next
stage's and its own forward, a weight gradient after its input gradient), with no sends, and
the step model's length must equal the drawn schedule's end.  The drawings are checked to be
torch's own orders as well.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from autopar.core.rules import stage_rank
from autopar.simulator.axes.pp_zero_bubble import (dualpipev_time, inflight_chunks, split_backward_time,
                                                    stage_grid)
from autopar.simulator.axes.pp_torch_order import torch_action_order

# pp 2, m 4, two chunks per rank: stages 0..3
HAND = {
    # ZB-V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2 (the V)
    "zbv": ["0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3",
            "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3"],
    # interleaved zero bubble: looped chunks, rank 0 stages 0 and 2, rank 1 stages 1 and 3
    "interleaved-zb": [
        "0F0 0F1 2F0 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 2W3 0I2 0W2 0I3 0W3",
        "1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 3W3 1I3 1W2 1W3"],
    # DualPipeV: the V, with forward-backward pairs in its main step
    "dualpipev": ["0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3B1) (3F2;0B0) 3B2 (3F3;0B1) 3B3 0I2 0W2 0I3 0W3",
                  "1F0 2F0 1F1 2F1 1F2 2B0 (2F2;1B0) (1F3;2B1) (2F3;1B1) 2B2 1B2 2I3 1I3 2W3 1W3"],
}
_ACTION = re.compile(r"(\d+)([FIWB])(\d+)")


def _play(ranks: list[str], num_stages: int, f: float, b: float, w: float, pair: float | None = None) -> float:
    """The end of the drawn schedule: ``f``, ``b``, ``w`` per chunk action, ``pair`` a DualPipeV
    pair (default: its forward and whole backward one after the other)."""
    queues = [s.split() for s in ranks]
    done: dict[tuple[str, int, int], float] = {}
    free, pos = [0.0] * len(ranks), [0] * len(ranks)
    progressed = True
    while progressed:
        progressed = False
        for r, queue in enumerate(queues):
            while pos[r] < len(queue):
                parts = [(int(s), k, int(mb)) for s, k, mb in _ACTION.findall(queue[pos[r]])]
                own = {("F" if k == "F" else "I", s, mb) for s, k, mb in parts}
                deps = []
                for s, k, mb in parts:
                    if k == "F" and s > 0:
                        deps.append(("F", s - 1, mb))
                    elif k in "IB":
                        deps += [("F", s, mb)] + ([("I", s + 1, mb)] if s < num_stages - 1 else [])
                    elif k == "W":
                        deps.append(("I", s, mb))
                deps = [d for d in deps if d not in own]
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                if len(parts) > 1:
                    length = pair if pair is not None else f + b + w
                else:
                    length = {"F": f, "I": b, "W": w, "B": b + w}[parts[0][1]]
                end = free[r] = start + length
                for s, k, mb in parts:
                    for key in {"F": ("F",), "I": ("I",), "W": ("W",), "B": ("I", "W")}[k]:
                        done[(key, s, mb)] = end
                pos[r] += 1
                progressed = True
    assert all(p == len(q) for p, q in zip(pos, queues)), "the drawn schedule deadlocks"
    return max(free)


def _grid(schedule: str, f: float, b: float, w: float, p: int = 2, v: int = 2):
    return tuple(np.full((v, p), x) for x in (f, b, w))


@pytest.mark.parametrize("schedule", list(HAND))
def test_drawn_schedules_place_stages_as_the_runtime(schedule):
    """Each rank's actions are on the stages the runtime puts on it (core/rules.stage_rank), and
    every stage runs F, its input and its weight gradient of each micro-batch exactly once."""
    for r, s in enumerate(HAND[schedule]):
        stages = {int(st) for st, _, _ in _ACTION.findall(s)}
        assert all(stage_rank(schedule, st, 2) == r for st in stages), (schedule, r, stages)
        assert set(stage_grid(schedule, 2, 2)[:, r].tolist()) == stages
    acts = [(int(s), k, int(mb)) for rank in HAND[schedule] for s, k, mb in _ACTION.findall(rank)]
    for stage in range(4):
        for mb in range(4):
            kinds = sorted(k for s, k, m in acts if s == stage and m == mb)
            assert kinds in (["F", "I", "W"], ["B", "F"]), (schedule, stage, mb, kinds)


@pytest.mark.parametrize("schedule", list(HAND))
def test_drawn_schedules_are_torchs(schedule):
    """The hand drawings are the orders torch's own classes build for each rank (read through
    simulator/torch_pipeline_order.py, which the trace draws; a pair as its forward then its
    backward)."""
    for r in range(2):
        torchs = [f"{stage}{kind}{mb}" for kind, mb, stage in torch_action_order(schedule, 2, 4)[r]]
        drawn = [f"{s}{k}{mb}" for s, k, mb in _ACTION.findall(HAND[schedule][r])]
        assert torchs == drawn, (schedule, r)


@pytest.mark.parametrize("schedule", list(HAND))
def test_equal_chunks_step_model_is_the_drawn_length(schedule):
    """F = B = W = 1 per chunk: 2 chunks x 4 micro-batches x 3 = 24 of work per rank, plus one
    boundary's bubble: X = max(F, B, F + B - W) = 1 for the zero-bubble schedules (25), and for
    DualPipeV (F&B + B - 2W) = 3 + 1 - 2 = 2 with its pairs run one action after the other (26)."""
    drawn = _play(HAND[schedule], 4, 1.0, 1.0, 1.0)
    assert drawn == {"zbv": 25.0, "interleaved-zb": 25.0, "dualpipev": 26.0}[schedule]
    assert split_backward_time(schedule, *_grid(schedule, 1.0, 1.0, 1.0), m=4) == pytest.approx(drawn)


@pytest.mark.parametrize("f, b, w", [(1.0, 2.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 0.25), (0.5, 0.5, 2.0)])
def test_interleaved_zb_unequal_passes(f, b, w):
    """Interleaved zero bubble: (p - 1) max(F, B, F + B - W) holds for any pass times."""
    drawn = _play(HAND["interleaved-zb"], 4, f, b, w)
    assert split_backward_time("interleaved-zb", *_grid("interleaved-zb", f, b, w), m=4) == pytest.approx(drawn)
    assert drawn == pytest.approx(8 * (f + b + w) + max(f, b, f + b - w))


def test_zbv_balanced_passes():
    """ZB-V with F = B = W (the case it is designed for) at another scale: 2 x 4 x 3 x 0.5 + 0.5."""
    assert _play(HAND["zbv"], 4, 0.5, 0.5, 0.5) == pytest.approx(12.5)
    assert split_backward_time("zbv", *_grid("zbv", 0.5, 0.5, 0.5), m=4) == pytest.approx(12.5)


def test_dualpipev_pairs_and_overlap():
    """DualPipeV: rank 0 runs 2m - 3p + 1 = 3 pairs (drawn above).  Unequal passes (F 1, B 2,
    W 1): the drawn schedule ends at 35 (work 32, then 3); the published bubble charges
    F&B + B - 2W = 4 + 2 - 2 = 4 (36), one W more than torch's order needs here.  With the
    all-to-all hidden (a pair costs max(compute, a2a) < F + B + W) the published bubble is
    again an upper bound of the drawn schedule."""
    assert sum(s.count("(") for s in HAND["dualpipev"][:1]) == 3
    drawn = _play(HAND["dualpipev"], 4, 1.0, 2.0, 1.0)
    assert drawn == pytest.approx(35.0)
    assert dualpipev_time(1.0, 2.0, 1.0, m=4, p=2) == pytest.approx(36.0)
    assert split_backward_time("dualpipev", *_grid("dualpipev", 1.0, 2.0, 1.0), m=4) == pytest.approx(36.0)
    # each chunk's forward and input backward hold 0.5 of all-to-all; overlapped, a pair costs
    # max(4 - 1, 1) = 3 instead of 4: work 32 - 3 pairs x 1, bubble 3 + 2 - 2
    overlapped = dualpipev_time(1.0, 2.0, 1.0, m=4, p=2, a2a_f=0.5, a2a_b=0.5, overlap_a2a=True)
    assert overlapped == pytest.approx(32 - 3 * 1 + (3 + 2 - 2))
    assert _play(HAND["dualpipev"], 4, 1.0, 2.0, 1.0, pair=3.0) <= overlapped + 1e-12
    # the published bubble is not a bound either way for unequal passes: F 2, B 1, W 1 draws 36,
    # one more than its 35 (pp_zero_bubble's docstring)
    assert _play(HAND["dualpipev"], 4, 2.0, 1.0, 1.0) == 36.0 and dualpipev_time(2.0, 1.0, 1.0, m=4, p=2) == 35.0


def test_inflight_chunks_per_schedule():
    """Activation memory in chunks: ZB-V 1F1B's peak (2p chunks of half a stage), DualPipeV PP + 1,
    interleaved zero bubble interleaved 1F1B's warm-up."""
    p, m = 4, 16
    assert [inflight_chunks("zbv", p, r, m, 2) for r in range(p)] == [8] * 4
    assert [inflight_chunks("dualpipev", p, r, m, 2) for r in range(p)] == [9] * 4
    assert [inflight_chunks("interleaved-zb", p, r, m, 2) for r in range(p)] == [11, 9, 7, 5]


def test_weight_gradient_share_of_a_block():
    """step/op_work.WEIGHT_GRAD_SHARE: a GPT block's W is half of its linears' backward (dgrad and
    wgrad are GEMMs of equal FLOPs); attention's matmuls, the softmax and the norms add none."""
    from autopar.core.plan import LayerPlan, Mesh
    from autopar.core.sharding import propagate
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.step.op_work import op_work as _op_work
    from sim_graphs import gpt_graph

    graph = gpt_graph(2, 512, 8, 256, 1000)
    cm = CostModel.from_profile("h100-sxm")
    i = next(i for i, layer in enumerate(graph.layers) if layer.kind not in ("pre", "post"))
    layout = propagate(graph, i, {}, 1, False)
    work = _op_work(graph.layer_ops(i), layout, LayerPlan(layer=i), Mesh(), "bf16", cm, 1.0, 1.0)
    linears = [op.name for op in graph.layer_ops(i) if op.kind == "linear" and op.params]
    assert linears and work.bwd_weight_s == pytest.approx(0.5 * sum(work.op_bwd_s[n] for n in linears), rel=1e-12)
    assert 0 < work.bwd_weight_s < 0.5 * work.bwd_s


@pytest.mark.parametrize("schedule", ["interleaved-zb", "zbv"])
def test_split_backward_plans_price_below_interleaved_1f1b(schedule):
    """On a GPT whose blocks' backward holds weight gradients, the zero-bubble schedules' bubble
    is below interleaved 1F1B's over the same two chunks per rank (the evaluator's step model).
    (Not DualPipeV's as torch runs it: its pairs one action after the other make its bubble
    F + 2B - W per boundary, above interleaved's F + B + W wherever B > 2W -- this GPT's
    unfused attention backward.)"""
    from autopar.core.cluster import load_cluster
    from autopar.simulator.configure import config_plan
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.simulate import simulate_plan
    from sim_graphs import gpt_graph

    graph = gpt_graph(8, 512, 8, 256, 1000)       # 8 blocks: 2 chunks on each of 4 ranks
    cluster, cm = load_cluster("h100-16x8"), CostModel.from_profile("h100-sxm")
    kw = dict(degrees={"pp": 4}, micro_batch=1, global_batch=8, virtual_stages=2, zero=0, recompute="none",
              offload="none", precision="bf16", sequence_parallel=False)
    base = simulate_plan(graph, config_plan(graph, schedule="interleaved", **kw), cluster, cm)
    split = simulate_plan(graph, config_plan(graph, schedule=schedule, **kw), cluster, cm)
    assert split.bubble_fraction < base.bubble_fraction


def test_dualpipev_with_and_without_the_all_to_all_overlap_is_the_drawn_length():
    """Equal chunks, F = B = W = 1, each chunk's forward and input backward holding 0.5 of expert
    all-to-all.  Run one after the other (torch's default, or without ep) a pair costs
    F + B + W = 3 and the drawn schedule ends at 26 = 2m(F + B + W) + (p - 1)(F&B + B - 2W) =
    24 + 2.  In turns (runtime/dualpipe_overlap.py) a pair costs F&B = max(compute 3 - 1,
    all-to-all 0.5 + 0.5) = 2 (DeepSeek-V3 report Fig. 4): rank 0's 3 pairs save 1 each and the
    bubble is F&B + B - 2W = 1, so 24 - 3 + 1 = 22 -- the drawn schedule's end with pairs of 2."""
    grids = _grid("dualpipev", 1.0, 1.0, 1.0)
    half = np.full((2, 2), 0.5)
    assert _play(HAND["dualpipev"], 4, 1.0, 1.0, 1.0) == 26.0
    assert _play(HAND["dualpipev"], 4, 1.0, 1.0, 1.0, pair=2.0) == 22.0
    assert split_backward_time("dualpipev", *grids, m=4, a2a_f_vp=half, a2a_b_vp=half) == pytest.approx(26.0)
    assert split_backward_time("dualpipev", *grids, m=4, overlap_a2a=True, a2a_f_vp=half,
                               a2a_b_vp=half) == pytest.approx(22.0)
    assert dualpipev_time(1.0, 1.0, 1.0, m=4, p=2, a2a_f=0.5, a2a_b=0.5, overlap_a2a=True) == pytest.approx(22.0)


def test_dualpipev_pairs_join_the_forward_of_one_chunk_and_the_backward_of_the_other():
    """Overlap priced per pair kind: on a rank whose chunk 0 holds all the all-to-all (1.0 in its
    forward, 1.0 in its input backward) and chunk 1 none, a pair (F of 0, B of 1) hides chunk 0's
    forward exchange behind chunk 1's backward compute -- max(3 - 1, 1) = 2, saving 1 -- and a
    pair (F of 1, B of 0) chunk 0's backward exchange: saving 1 as well; pricing each chunk's
    forward with its own backward would hide both exchanges in chunk 0's pairs (max(3 - 2, 2),
    saving 1 per chunk 0 pair, none for chunk 1: 0.5 a pair).  m = 4, p = 2: 3 pairs of each
    rank save 1 each."""
    grids = _grid("dualpipev", 1.0, 1.0, 1.0)
    a = np.array([[1.0, 1.0], [0.0, 0.0]])          # (chunk, rank)
    off = split_backward_time("dualpipev", *grids, m=4, a2a_f_vp=a, a2a_b_vp=a)
    on = split_backward_time("dualpipev", *grids, m=4, overlap_a2a=True, a2a_f_vp=a, a2a_b_vp=a)
    # the work falls by 3 pairs x 1; the bubble keeps chunk 1's own F&B + B - 2W = 3 + 1 - 2
    assert off == pytest.approx(26.0) and on == pytest.approx(24.0 - 3.0 + 2.0)
