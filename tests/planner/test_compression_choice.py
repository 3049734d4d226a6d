"""The planner's gradient compression (planner/compression_choice.py): the plan's own 16-bit type
on the wire where it shortens the step by more than 5%, nothing where the reduce is cheap,
PowerSGD only when the user allows it, and a fixed PowerSGD refused with the knobs it cannot run
with (exit 2)."""
from dataclasses import replace

import pytest

from autopar.core.cluster import Cluster, Link, NodeGroup
from autopar.core.errors import UserError
from autopar.planner.compression_choice import MIN_GAIN, choose_compression, constrain_for, options_for
from autopar.planner.search import Evaluated, PlanOptions, SearchResult
from autopar.simulator.configure import config_plan
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator
from sim_graphs import gpt_graph

PROFILE = dict(name="t", memory_bandwidth_Bps=2e12, peak_flops={"fp32": 20e12, "bf16": 250e12},
               efficiency={"linear": 0.8, "matmul": 0.8, "memory_bound": 0.8},
               collective_efficiency={"intra": 0.7, "inter": 0.9})
GRAPH = gpt_graph(4, 512, 8, 4096, 1000)


def _cluster(inter_GBps):
    # 4 nodes of 2 devices: a dp group of 8 spans the network
    return Cluster("c", (NodeGroup("n", "t", 4, 2, 80 * 2**30, Link(300.0, 3.0), 2**40, Link(25.0, 10.0)),),
                   Link(inter_GBps, 5.0))


def _result(cluster, zero, precision="bf16"):
    plan = config_plan(GRAPH, degrees={"dp": 8, "tp": 1, "pp": 1}, micro_batch=1, global_batch=8, schedule="1f1b", virtual_stages=1,
                       zero=zero, recompute="none", offload="none", precision=precision, sequence_parallel=False)
    r = PlanEvaluator(GRAPH, cluster, CostModel.from_profile(PROFILE)).evaluate(plan)
    return SearchResult(best=Evaluated(None, plan, r), runner_ups=[], num_evaluated=1, num_infeasible=0,
                        num_settings=1)


def test_bf16_on_the_wire_where_the_network_is_slow_none_where_it_is_fast():
    cm = {"t": CostModel.from_profile(PROFILE)}
    slow, fast = _cluster(0.5), _cluster(25.0)
    res, choice = choose_compression(_result(slow, 2), GRAPH, slow, cm, None, False)
    assert choice.compression == "bf16" and res.best.plan.grad_compression == "bf16"
    assert choice.chosen_step_s < choice.none_step_s * (1 - MIN_GAIN) and choice.wire_fraction == 0.5
    res, choice = choose_compression(_result(fast, 2), GRAPH, fast, cm, None, False)
    assert choice.compression == "none" and res.best.plan.grad_compression == "none"
    # an fp32 plan keeps fp32 gradients by default, even on the slow network
    _, choice = choose_compression(_result(slow, 2, "fp32"), GRAPH, slow, cm, None, False)
    assert choice.compression == "none" and "fp32" in choice.why


def test_powersgd_only_when_allowed_or_fixed():
    cm = {"t": CostModel.from_profile(PROFILE)}
    slow = _cluster(0.5)
    _, default = choose_compression(_result(slow, 0), GRAPH, slow, cm, None, False)
    assert not default.compression.startswith("powersgd")
    _, lossy = choose_compression(_result(slow, 0), GRAPH, slow, cm, None, True)
    assert lossy.compression.startswith("powersgd") and lossy.chosen_step_s < lossy.none_step_s
    res, fixed = choose_compression(_result(slow, 0), GRAPH, slow, cm, "powersgd:4", False)
    assert fixed.compression == "powersgd:4" and res.best.plan.grad_compression == "powersgd:4"


def test_options_and_constraints():
    plan = config_plan(GRAPH, degrees={"dp": 8, "tp": 1, "pp": 1}, micro_batch=1, global_batch=8, schedule="1f1b", virtual_stages=1,
                       zero=3, recompute="none", offload="none", precision="bf16", sequence_parallel=False)
    assert options_for(plan, None, True) == ["none", "bf16"]          # no PowerSGD under FSDP2
    assert options_for(replace(plan, precision="fp16"), None, False) == ["none", "fp16"]
    assert options_for(plan, "powersgd:2", False) == ["none"]
    opts = constrain_for("powersgd:2", PlanOptions(global_batch=8))
    assert ({n: opts.degrees[n] for n in ("tp", "pp", "cp")}, opts.zero_families) == (
        {"tp": 1, "pp": 1, "cp": 1}, ("ddp", "zero1"))
    assert constrain_for("bf16", PlanOptions(global_batch=8)) == PlanOptions(global_batch=8)
    with pytest.raises(UserError, match="--zero 2"):
        constrain_for("powersgd:2", PlanOptions(global_batch=8, zero=2))
    with pytest.raises(UserError, match="--tp 2"):
        constrain_for("powersgd:2", PlanOptions(global_batch=8, degrees={"tp": 2}))
