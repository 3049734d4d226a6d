"""The fitted constants as values (simulator/calibration.py): carried by the cost model, passed by
the fit and the tests, never module state.

The side-by-side test prices one sharded plan within one node (where the overlap slowdown applies,
sharded_dp item 2) under two calibrations; its reference is the closed form of item 2: the forward
of a ZeRO-3 layer runs ``slowdown * min(forward, next gather)`` longer, so the plan with no
slowdown is faster, and pricing one calibration never changes what another prices.
"""
import re
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest

from autopar.core.cluster import Cluster, Link, NodeGroup
from autopar.simulator.axes import sharded_dp
from autopar.simulator.device.calibration import FITTED, Calibration
from autopar.simulator.configure import config_plan
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator
from sim_graphs import gpt_graph

ROOT = Path(__file__).resolve().parents[2]


def test_no_fitted_constant_is_module_state():
    """The fitted constants are fields of a frozen value; no module holds them, and no file of the
    repository assigns to an upper-case attribute of another module (``mod.NAME = ...``), the way
    the fit used to vary them."""
    assert not hasattr(sharded_dp, "NCCL_OVERLAP_SLOWDOWN") and not hasattr(sharded_dp, "SHARDED_RING_EFFICIENCY")
    with pytest.raises(FrozenInstanceError):
        FITTED.nccl_overlap_slowdown = 0.0
    assign = re.compile(r"^\s*(?:[A-Za-z_][\w.]*\s*,\s*)*[a-z_][\w]*\.[A-Z][A-Z0-9_]+\s*(?:,[^=]*)?=[^=]")
    offenders = []
    for path in ROOT.rglob("*.py"):
        if any(part.startswith(".") for part in path.relative_to(ROOT).parts):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if assign.match(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "module constants reassigned:\n" + "\n".join(offenders)


def _setting():
    graph = gpt_graph(8, 512, 8, 256, 1000)
    group = NodeGroup("n", "h100-sxm", 1, 8, 80 * 2**30, Link(20.0, 1.0), 2**40, Link(50.0, 10.0))
    cluster = Cluster("c", (group,), Link(50.0, 5.0))
    plan = config_plan(graph, degrees={"dp": 8, "tp": 1, "pp": 1},
                       micro_batch=1, global_batch=16, schedule="1f1b", virtual_stages=1,
                       zero=3, recompute="none", offload="none", precision="bf16", sequence_parallel=False)
    return graph, cluster, plan


def test_two_calibrations_price_side_by_side():
    graph, cluster, plan = _setting()
    cm = CostModel.from_profile("h100-sxm")
    assert cm.calibration == FITTED
    none = Calibration(nccl_overlap_slowdown=0.0, sharded_ring_efficiency=FITTED.sharded_ring_efficiency)
    fitted_ev = PlanEvaluator(graph, cluster, cm)
    plain_ev = PlanEvaluator(graph, cluster, cm.for_calibration(none))
    first = fitted_ev.evaluate(plan).step_time_s
    plain = plain_ev.evaluate(plan).step_time_s
    assert plain < first                               # item 2's slowdown is what the two differ by
    assert fitted_ev.evaluate(plan).step_time_s == first   # pricing the other calibration left it alone
    assert cm.calibration == FITTED                    # for_calibration is a copy


def test_the_memo_keys_on_the_calibration():
    """An evaluator's memo of derived rows (step/layer_memo.LayerMemo) holds per calibration: a cost
    model given another calibration after the evaluator priced with it prices as a fresh one."""
    graph, cluster, plan = _setting()
    cm = CostModel.from_profile("h100-sxm")
    ev = PlanEvaluator(graph, cluster, cm)
    ev.evaluate(plan)
    other = Calibration(nccl_overlap_slowdown=0.9, sharded_ring_efficiency=0.5)
    cm.calibration = other
    fresh = PlanEvaluator(graph, cluster, CostModel.from_profile("h100-sxm").for_calibration(other))
    assert ev.evaluate(plan).step_time_s == fresh.evaluate(plan).step_time_s
    layers = tuple(replace(lp, recompute="full") if i == 3 else lp for i, lp in enumerate(plan.layers))
    changed = replace(plan, layers=layers)
    assert ev.evaluate(changed).step_time_s == fresh.evaluate(changed).step_time_s
