"""simulate(graph, plan, cluster, cost_model) -> SimResult: the event-simulated step.

The per-layer costs and the memory model are the fast path's (evaluator.PlanEvaluator); the
step time comes from playing the schedule out event by event (engine.simulate_step), which
also yields the timeline.  ``PlanEvaluator.evaluate`` prices the same plan in closed form for
the search; tests hold the two within a few percent of each other.
"""
from __future__ import annotations

from typing import Mapping

from autopar.core.cluster import Cluster
from autopar.core.errors import InfeasibleError, PlanFileError
from autopar.core.graph import OpGraph
from autopar.core.plan import Plan
from autopar.simulator.cost_model import CostModel
from autopar.simulator.engine import simulate_step
from autopar.simulator.evaluator import PlanEvaluator
from autopar.simulator.result import SimResult
from autopar.simulator.timeline import Timeline


def simulate(graph: OpGraph, plan: Plan, cluster: Cluster, cost_model: CostModel | Mapping[str, CostModel], *,
             timeline: bool = False, evaluator: PlanEvaluator | None = None) -> SimResult:
    """Simulate one training step of ``plan``; ``timeline=True`` keeps every event."""
    try:
        plan.validate(len(graph.layers))
    except PlanFileError as e:
        raise InfeasibleError(str(e)) from None
    ev = evaluator or PlanEvaluator(graph, cluster, cost_model)
    ctx, rows = ev.prepare(plan)
    tl = Timeline(timeline)
    devices = [plan.mesh.rank(0, r, 0) for r in range(plan.mesh.pp)]
    finish, bubble = simulate_step(ctx, rows, tl, devices)
    return ev.assemble(plan, ctx, rows, finish, bubble, timeline=tl.events if timeline else None)
