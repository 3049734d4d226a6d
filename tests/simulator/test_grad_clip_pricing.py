"""A plan priced as a clipped run (``Plan.grad_clip``: ``autopar plan --grad-clip``): its step is
the unclipped step plus the clip's cost on each rank -- three memory-bound passes over the
gradient elements the rank holds after the reduction (whole under DDP and ZeRO-1, 1/dp under
ZeRO-2/3; runtime/grad_norm.py: one read for the norm, a read and a write for the scaling) at
the profile's HBM bandwidth times its memory-bound efficiency, plus the ring all-reduce of one
fp32 scalar over every rank (2 (n - 1) link latencies and 2 (n - 1) / n x 4 bytes over the link's
bandwidth, Thakur et al. 2005) -- written here from the profile's and the cluster's own numbers;
the trace still ends at the predicted step; a plan without the field loads, prices and names
itself as before."""
import json
from dataclasses import replace

import pytest

from autopar.core.plan import Plan
from autopar.simulator.configure import config_plan
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.simulate import simulate_plan
from autopar.simulator.evaluator import PlanEvaluator
from sim_graphs import REDUCE_PROFILE, gpt_graph, toy_cluster

PROFILE = REDUCE_PROFILE
NODE_LINK = toy_cluster().groups[0].intra_node       # one node of 8 devices: every group on this link
GRAPH = gpt_graph(4, 256, 4, 128, 1000)


def _plan(dp, tp, zero, precision, m=2):
    return config_plan(GRAPH, degrees={"dp": dp, "tp": tp, "pp": 1},
                       micro_batch=1, global_batch=dp * m, schedule="1f1b",
                       virtual_stages=1, zero=zero, recompute="none", offload="none", precision=precision,
                       sequence_parallel=False)


def _by_hand(n_ranks, elements, grad_bytes):
    hbm = PROFILE["memory_bandwidth_Bps"] * PROFILE["efficiency"]["memory_bound"]
    eff = PROFILE["collective_efficiency"]["intra"]
    a, bw = NODE_LINK.latency_s, NODE_LINK.bandwidth_Bps * eff
    ring = 2 * (n_ranks - 1) * a + 2 * (n_ranks - 1) / n_ranks * 4 / bw if n_ranks > 1 else 0.0
    return 3 * elements * grad_bytes / hbm + ring


@pytest.mark.parametrize("dp,zero,precision,grad_bytes", [(8, 0, "fp32", 4), (8, 1, "bf16", 2), (8, 2, "fp32", 4),
                                                          (4, 3, "bf16", 2)])
def test_clip_adds_its_passes_and_the_norm_all_reduce(dp, zero, precision, grad_bytes):
    cm = CostModel.from_profile(PROFILE)
    plan = _plan(dp, 1, zero, precision)
    plain = simulate_plan(GRAPH, plan, toy_cluster(), cm)
    clipped = simulate_plan(GRAPH, replace(plan, grad_clip=True), toy_cluster(), cm)
    held = GRAPH.params_total / (dp if zero >= 2 else 1)      # gradient elements a rank holds once reduced
    want = _by_hand(dp, held, grad_bytes)
    assert clipped.step_time_s - plain.step_time_s == pytest.approx(want, rel=1e-9)
    assert want > 0
    # the planner's evaluator (its fast path) over cost models that clip prices the same step
    clip_cm = cm.for_code(replace(cm.code, grad_clip=True))
    ev = PlanEvaluator(GRAPH, toy_cluster(), clip_cm)
    for _ in range(2):                        # priced, then from the evaluator's memos
        assert ev.evaluate(plan).step_time_s == pytest.approx(clipped.step_time_s, rel=1e-12)
    # the flag changes the price, not the memory
    assert clipped.max_memory_bytes == plain.max_memory_bytes


def test_clip_under_tensor_parallelism_counts_the_local_shards():
    """tp = 2 splits every block's linear weights (each rank holds half of them); the rest --
    layer norms, row-wise biases, the embeddings, the head -- stays whole on each rank: the
    held elements are at least half of the model's and less than all of it."""
    cm = CostModel.from_profile(PROFILE)
    plan = _plan(4, 2, 0, "fp32")
    extra = simulate_plan(GRAPH, replace(plan, grad_clip=True), toy_cluster(), cm).step_time_s - \
        simulate_plan(GRAPH, plan, toy_cluster(), cm).step_time_s
    ring = _by_hand(8, 0, 4)
    assert _by_hand(8, GRAPH.params_total / 2, 4) <= extra < _by_hand(8, GRAPH.params_total, 4)
    assert extra > ring


def _rank_ends(res, plan):
    return [max(e["start_s"] + e["dur_s"] for e in res.timeline if e["device"] == plan.mesh.rank_at(pp=r))
            for r in range(plan.mesh.pp)]


@pytest.mark.parametrize("pp,zero", [(1, 0), (2, 3)])
def test_the_trace_ends_at_the_clipped_step(pp, zero):
    """Without a pipeline the trace ends at the step; with one whose stages are unequal and send
    between them (2 x 2 x 2, gpipe) the drawn schedule ends a little after the formula
    (test_simulator_trace.py, LATE) -- by as much clipped as unclipped: the clip moves each rank's
    drawn end as it moves the step model's."""
    cm = CostModel.from_profile(PROFILE)
    plan = config_plan(GRAPH, degrees={"dp": 8 // (2 * pp), "tp": 2, "pp": pp},
                       micro_batch=1, global_batch=4 * 8 // (2 * pp),
                       schedule="gpipe", virtual_stages=1, zero=zero, recompute="none", offload="none",
                       precision="fp32", sequence_parallel=False)
    plain = simulate_plan(GRAPH, plan, toy_cluster(), cm, timeline=True)
    plan = replace(plan, grad_clip=True)
    res = simulate_plan(GRAPH, plan, toy_cluster(), cm, timeline=True)
    if pp == 1:
        assert max(e["start_s"] + e["dur_s"] for e in res.timeline) == pytest.approx(res.step_time_s, rel=1e-12)
    moved = [a - b for a, b in zip(_rank_ends(res, plan), _rank_ends(plain, plan))]
    assert moved == pytest.approx([a - b for a, b in zip(res.stage_step_s, plain.stage_step_s)], rel=1e-9)
    assert min(moved) > _by_hand(8, 0, 4)
    norm = [e for e in res.timeline if e["name"] == "all_reduce grad norm"]
    assert len(norm) == pp and all(e["dur_s"] == pytest.approx(_by_hand(8, 0, 4), rel=1e-9) for e in norm)
    assert not [e for e in plain.timeline if e["name"] == "all_reduce grad norm"]
    ctx, rows = PlanEvaluator(GRAPH, toy_cluster(), cm).prepare(plan)
    assert ctx.grad_norm_s is None           # an evaluator's own cost models decide, not the plan


def test_old_plan_json_loads_and_prices_as_before():
    cm = CostModel.from_profile(PROFILE)
    plan = _plan(8, 1, 0, "fp32")
    d = json.loads(plan.to_json())
    assert "grad_clip" not in d               # written only when true
    again = Plan.from_dict(d)
    assert again.grad_clip is False and again.identity == plan.identity
    assert simulate_plan(GRAPH, again, toy_cluster(), cm).step_time_s == simulate_plan(GRAPH, plan, toy_cluster(), cm).step_time_s
    clipped = replace(plan, grad_clip=True)
    d2 = json.loads(clipped.to_json())
    assert d2["grad_clip"] is True
    back = Plan.from_dict(d2)
    assert back.grad_clip is True
    assert back.identity == plan.identity     # a pricing assumption: the run is the same run
    d2["grad_clip"] = "yes"
    from autopar.core.errors import PlanFileError
    with pytest.raises(PlanFileError, match="grad_clip"):
        Plan.from_dict(d2)
