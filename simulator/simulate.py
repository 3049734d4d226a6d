"""simulate_plan(graph, plan, cluster, cost_model) -> SimResult: the priced step, and its timeline.

One step model serves the planner, ``autopar simulate``, ``autopar report`` and the plan's
``predicted`` block: ``PlanEvaluator.evaluate`` (per-layer rows, then the step in closed form,
evaluator.closed_form_step).  ``simulate`` returns exactly that result; with
``timeline=True`` it also lays the same step out as events for the Chrome trace
(step_trace.draw_step), from the step model's own terms, so each pipeline rank's last event
ends when the step model says that rank finishes.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from autopar.core.cluster import Cluster
from autopar.core.errors import InfeasibleError, PlanFileError
from autopar.core.graph import OpGraph
from autopar.core.plan import Plan
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator, closed_form_step
from autopar.simulator.result import SimResult


def plan_cost_models(plan: Plan, cost_model: CostModel | Mapping[str, CostModel]):
    """``cost_model`` (one, or by GPU name) pricing the training code the plan assumes: with
    ``TrainingCode.grad_clip`` when the plan is priced as a clipped run (``Plan.grad_clip``), and
    the plan's gradient compression (``Plan.grad_compression``, simulator/grad_compression.py)."""
    if not plan.grad_clip and plan.grad_compression == "none":
        return cost_model

    def code(cm: CostModel) -> CostModel:
        want = replace(cm.code, grad_clip=cm.code.grad_clip or plan.grad_clip, grad_compression=plan.grad_compression)
        return cm if want == cm.code else cm.for_code(want)

    return code(cost_model) if isinstance(cost_model, CostModel) else {k: code(cm) for k, cm in cost_model.items()}


def simulate_plan(graph: OpGraph, plan: Plan, cluster: Cluster, cost_model: CostModel | Mapping[str, CostModel], *,
             timeline: bool = False, evaluator: PlanEvaluator | None = None) -> SimResult:
    """Price one training step of ``plan``; ``timeline=True`` also keeps every event of the trace."""
    try:
        plan.validate(len(graph.layers))
    except PlanFileError as e:
        raise InfeasibleError(str(e)) from None
    ev = evaluator or PlanEvaluator(graph, cluster, plan_cost_models(plan, cost_model))
    ctx, rows = ev.prepare(plan)
    step_r, bubble = closed_form_step(ctx, rows)
    events = None
    if timeline:
        from autopar.simulator.step.trace import draw_step

        events = draw_step(ctx, rows, [plan.mesh.rank_at(pp=r) for r in range(plan.mesh.pp)]).events
    return ev.assemble(plan, ctx, rows, step_r, bubble, timeline=events)
