"""simulate(graph, plan, cluster, cost_model) -> SimResult: the priced step, and its timeline.

One step model serves the planner, ``autopar simulate``, ``autopar report`` and the plan's
``predicted`` block: ``PlanEvaluator.evaluate`` (per-layer rows, then the step in closed form,
evaluator.closed_form_step).  ``simulate`` returns exactly that result; with
``timeline=True`` it also plays the schedule out event by event over the same rows
(engine.simulate_step) to draw the Chrome trace.  The trace is a picture of the step: where
pipeline stages are unequal the closed form idealises the schedule, so the trace's last event
may end a little off the step time (tests hold it within 5%).
"""
from __future__ import annotations

from typing import Mapping

from autopar.core.cluster import Cluster
from autopar.core.errors import InfeasibleError, PlanFileError
from autopar.core.graph import OpGraph
from autopar.core.plan import Plan
from autopar.simulator.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator, closed_form_step
from autopar.simulator.result import SimResult


def simulate(graph: OpGraph, plan: Plan, cluster: Cluster, cost_model: CostModel | Mapping[str, CostModel], *,
             timeline: bool = False, evaluator: PlanEvaluator | None = None) -> SimResult:
    """Price one training step of ``plan``; ``timeline=True`` also keeps every event of the trace."""
    try:
        plan.validate(len(graph.layers))
    except PlanFileError as e:
        raise InfeasibleError(str(e)) from None
    ev = evaluator or PlanEvaluator(graph, cluster, cost_model)
    ctx, rows = ev.prepare(plan)
    step_r, bubble = closed_form_step(ctx, rows)
    events = None
    if timeline:
        from autopar.simulator.engine import simulate_step
        from autopar.simulator.timeline import Timeline

        tl = Timeline(True)
        simulate_step(ctx, rows, tl, [plan.mesh.rank(0, r, 0) for r in range(plan.mesh.pp)])
        events = tl.events
    return ev.assemble(plan, ctx, rows, step_r, bubble, timeline=events)
